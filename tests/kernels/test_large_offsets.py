"""Kernels whose element offsets pass 2**31 (interpreter on CPU): a 1M-token context makes
operands of more than 2**31 elements (kv_b_proj's output, a big per-layer cache), which int32
offsets would wrap. Each operand here is real memory that large (2-4 GiB, of which only the rows
the kernels touch are ever written), never a stride over a small storage; the results must equal
the same kernels' on small operands holding the same rows."""

import pytest
import torch

from rayinfer.kernels.attention.prefill_attention import (
    prefill_attention,
    prefill_attention_reference,
)
from rayinfer.kernels.attention.reshape_and_cache import reshape_and_cache
from rayinfer.kernels.elementwise.rotary import rotary_embedding_and_cache
from rayinfer.kernels.mla import mla_attention as mla
from rayinfer.kernels.triton_compat import tma_rows_fit

PAST_INT32 = 2**31 + 4096  # elements: every operand below reaches past int32 offsets
LATENT, ROPE, BLOCK = 64, 16, 16  # a small MLA cache row [L + R] and block size


@pytest.fixture(scope="module")
def big_mla_cache():
    """[blocks, 16, 80] float16 of more than 2**31 elements (4 GiB, left uninitialized)."""
    num_blocks = -(-PAST_INT32 // (BLOCK * (LATENT + ROPE)))
    return torch.empty(num_blocks, BLOCK, LATENT + ROPE, dtype=torch.float16)


def rows_past(num_rows: int, row_elements: int, width: int, dtype) -> torch.Tensor:
    """[num_rows, width] rows `row_elements` apart in a storage that holds them all."""
    storage = torch.empty(row_elements * (num_rows - 1) + width, dtype=dtype)
    return storage.as_strided((num_rows, width), (row_elements, 1))


def test_cache_writes_read_token_rows_past_2_31_elements():
    """mla_write_cache and reshape_and_cache: token x row stride in int64."""
    generator = torch.Generator().manual_seed(0)
    # Strides below 2**31 (int32 arguments) whose product with token 2 is not.
    kv_c = rows_past(3, 2**30 + 64, LATENT, torch.int8)
    kv_c.copy_(torch.randint(-100, 100, (3, LATENT), generator=generator, dtype=torch.int8))
    k_pe = torch.randint(-100, 100, (3, ROPE), generator=generator, dtype=torch.int8)
    cache = torch.zeros(4, BLOCK, LATENT + ROPE, dtype=torch.int8)
    slots = torch.tensor([5, 40, 17])
    mla.mla_write_cache(cache, slots, kv_c, k_pe)
    assert torch.equal(cache.view(-1, LATENT + ROPE)[slots], torch.cat([kv_c, k_pe], -1))

    key = rows_past(3, 2**30 + 64, 2 * 8, torch.int8).view(3, 2, 8)  # [T, Hkv, D]
    key.copy_(torch.randint(-100, 100, (3, 2, 8), generator=generator, dtype=torch.int8))
    value = key.clone()
    gqa_cache = torch.zeros(4, BLOCK, 2, 2, 8, dtype=torch.int8)
    reshape_and_cache(key, value, gqa_cache, slots)
    assert torch.equal(gqa_cache.view(-1, 2, 2, 8)[slots, 0], key)


def test_rope_and_decode_over_cache_slots_past_2_31_elements(big_mla_cache):
    """The fused rope + cache write at the last slots of a cache of more than 2**31 elements,
    then the absorbed decode over them (block ids x block x row in int64), equal to both on a
    small cache holding the same blocks."""
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_heads = 40, 4
    top_blocks = torch.arange(big_mla_cache.shape[0] - 3, big_mla_cache.shape[0])  # [3]
    slots = (top_blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:num_tokens]
    assert slots[-1] * (LATENT + ROPE) > 2**31
    positions = torch.arange(num_tokens)
    q_pe = torch.randn(num_tokens, num_heads, ROPE, generator=generator).half()
    k_pe = torch.randn(num_tokens, 1, ROPE, generator=generator).half()
    kv_c = torch.randn(num_tokens, LATENT, generator=generator).half()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    small_cache = torch.zeros(3, BLOCK, LATENT + ROPE, dtype=torch.float16)
    small_slots = torch.arange(num_tokens)
    for cache, where in ((big_mla_cache, slots), (small_cache, small_slots)):
        rotary_embedding_and_cache(positions, q_pe, k_pe, inv_freq, cache, where, kv_c)
    big_rows = big_mla_cache.view(-1, LATENT + ROPE)[slots]
    assert torch.equal(big_rows, small_cache.view(-1, LATENT + ROPE)[:num_tokens])

    q_latent = torch.randn(1, num_heads, LATENT, generator=generator).half()
    q_rope = torch.randn(1, num_heads, ROPE, generator=generator).half()
    args = (q_latent, q_rope)
    ours = mla.mla_decode_attention(*args, big_mla_cache, top_blocks[None].int(), [40], 0.1)
    small = mla.mla_decode_attention(*args, small_cache, torch.arange(3)[None].int(), [40], 0.1)
    torch.testing.assert_close(ours, small, atol=0, rtol=0)


def test_prefill_reads_key_rows_past_2_31_elements():
    """A sequence whose keys start past 2**31 elements of packed K/V (cu_seqlens_k): the
    prefill kernel's row offsets in int64, its output and log-sum-exp equal to the same
    sequence's on its own rows."""
    generator = torch.Generator().manual_seed(2)
    num_heads, head_dim, q_len, k_len = 2, 16, 5, 24
    row = num_heads * head_dim
    first_key = -(-(2**31) // row)  # the sequence's first key row starts past element 2**31
    packed = torch.empty(first_key + k_len, num_heads, head_dim, dtype=torch.float16)
    keys = torch.randn(k_len, num_heads, head_dim, generator=generator).half()
    packed[first_key:] = keys
    query = torch.randn(q_len, num_heads, head_dim, generator=generator).half()
    cu_q = torch.tensor([0, 0, q_len], dtype=torch.int32)  # sequence 0: no queries
    cu_k = torch.tensor([0, first_key, first_key + k_len], dtype=torch.int32)
    lse = torch.empty(q_len, num_heads)
    ours = prefill_attention(query, packed, packed, cu_q, cu_k, q_len, 0.25, lse=lse)
    own = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([0, k_len], dtype=torch.int32)
    expected_lse = torch.empty_like(lse)
    expected = prefill_attention_reference(query.float(), keys.float(), keys.float(), *own, q_len,
                                           0.25, lse=expected_lse)  # fmt: skip
    torch.testing.assert_close(ours.float(), expected, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, expected_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    "num_rows,stride_bytes,fits",
    [(2**31 - 1, 1152, True), (2**31, 1152, False), (1024, 2**40, False), (1, 16, True)],
)
def test_tma_descriptors_only_over_rows_int32_coordinates_reach(num_rows, stride_bytes, fits):
    assert tma_rows_fit(num_rows, stride_bytes) is fits
