"""FP8 e4m3 indexer keys with one float32 scale per token (kernels/dsa/dsa_index_fp8.py): the
Triton write (interpreter on CPU) byte for byte against the torch reference, what the bytes
dequantize to, and the indexer's Triton scores over FP8 keys against the reference that
dequantizes them (selections compared by the reference scores of the chosen tokens)."""

import pytest
import torch

from rayinfer.config import ConfigError
from rayinfer.kernels.dsa.dsa_cache import dsa_write_cache
from rayinfer.kernels.dsa.dsa_index_fp8 import (
    FP8_MAX,
    check_fp8_index_device,
    gather_index_keys,
    quantize_index_keys,
)
from rayinfer.kernels.dsa.dsa_indexer import (
    context_slots,
    dsa_index_topk,
    dsa_index_topk_reference,
    dsa_write_cache_reference,
)
from tests.kernels.test_dsa_indexer import assert_same_selection, paged_batch

LATENT_RANK, ROPE_DIM = 16, 8


def key_columns(dtype: torch.dtype, head_dim: int) -> int:
    return (head_dim + 4) // torch.empty(0, dtype=dtype).element_size()


def fp8_batch(num_tokens, head_dim, dtype, generator, num_slots=None):
    """(cache [blocks, 4, L + R + key columns], slots [T] with a padding -1, kv_c, k_pe, keys
    [T, D] spanning 12 decades, one all-zero)."""
    num_slots = num_slots or num_tokens + 3
    width = LATENT_RANK + ROPE_DIM + key_columns(dtype, head_dim)
    cache = torch.randn(-(-num_slots // 4), 4, width, generator=generator).to(dtype)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[0] = -1
    kv_c = torch.randn(num_tokens, LATENT_RANK, generator=generator).to(dtype)
    k_pe = torch.randn(num_tokens, ROPE_DIM, generator=generator).to(dtype)
    magnitude = torch.logspace(-3, 3, num_tokens)[:, None]  # fp16 keeps these finite
    keys = (torch.randn(num_tokens, head_dim, generator=generator) * magnitude).to(dtype)
    keys[1] = 0  # scale 1, bytes 0
    return cache, slots, kv_c, k_pe, keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens, head_dim", [(200, 128), (3, 16), (9, 12)])
def test_write_is_byte_exact_with_the_reference(num_tokens, head_dim, dtype):
    generator = torch.Generator().manual_seed(num_tokens)
    cache, slots, kv_c, k_pe, keys = fp8_batch(num_tokens, head_dim, dtype, generator)
    expected = cache.clone()
    dsa_write_cache_reference(expected, slots, kv_c, k_pe, keys, index_fp8=True)
    dsa_write_cache(cache, slots, kv_c, k_pe, keys, index_fp8=True)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    flat = cache.view(-1, cache.shape[-1])
    real = slots >= 0
    latent = torch.cat([kv_c, k_pe], dim=-1)[real]
    assert torch.equal(flat[slots[real], : LATENT_RANK + ROPE_DIM], latent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_bytes_dequantize_to_the_quantized_keys(dtype):
    """The bytes decode to quantize_index_keys' fp8 values times its scales, exactly; those are
    within e4m3's half step of the keys (2^-4 relative; 2^-10 x scale among subnormals)."""
    generator = torch.Generator().manual_seed(1)
    cache, slots, kv_c, k_pe, keys = fp8_batch(64, 128, dtype, generator)
    dsa_write_cache(cache, slots, kv_c, k_pe, keys, index_fp8=True)
    real = slots >= 0
    ours = gather_index_keys(cache, LATENT_RANK + ROPE_DIM, 128, slots[real])  # [T', D]
    fp8, scale = quantize_index_keys(keys[real])
    assert torch.equal(ours, fp8.float() * scale[:, None])
    assert torch.equal(scale, keys[real].float().abs().amax(-1).div(FP8_MAX).masked_fill(
        keys[real].float().abs().amax(-1) == 0, 1.0))  # fmt: skip
    exact = keys[real].float()
    bound = torch.maximum(exact.abs() * 2**-4, scale[:, None] * 2**-10)
    assert ((ours - exact).abs() <= bound * (1 + 1e-6)).all()


def test_a_layer_without_indexer_leaves_the_key_bytes():
    generator = torch.Generator().manual_seed(2)
    cache, slots, kv_c, k_pe, _ = fp8_batch(5, 16, torch.bfloat16, generator)
    before = cache.clone()
    dsa_write_cache(cache, slots, kv_c, k_pe, None, index_fp8=True)
    key_start = LATENT_RANK + ROPE_DIM
    assert torch.equal(cache[..., key_start:].view(torch.uint8), before[..., key_start:].view(
        torch.uint8))  # fmt: skip


def test_rows_that_misalign_the_scale_are_refused():
    cache = torch.zeros(2, 4, LATENT_RANK + ROPE_DIM + 9, dtype=torch.bfloat16)  # 18 bytes < 20
    args = (torch.zeros(1, dtype=torch.long), torch.zeros(1, 16), torch.zeros(1, 8))
    with pytest.raises(ValueError, match="rows of at least 16 \\+ 8 \\+ 10"):
        dsa_write_cache(cache, *args, torch.zeros(1, 16), index_fp8=True)
    cache = torch.zeros(2, 4, LATENT_RANK + ROPE_DIM + 7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="4-byte aligned"):  # 10 + 4 bytes: scale at byte 58
        dsa_write_cache(cache, *args, torch.zeros(1, 10), index_fp8=True)


def dequantized_scores(q_index, weights, kv_cache, key_offset, tables, query_seq, max_context):
    """{slot: reference score} per query over the dequantized keys, in float64."""
    slots = context_slots(tables, query_seq, kv_cache.shape[1], max_context)  # [T, S]
    keys = gather_index_keys(kv_cache, key_offset, q_index.shape[-1], slots.clamp(min=0))
    logits = torch.einsum("thd,tsd->ths", q_index.double(), keys.double()).relu()
    scores = torch.einsum("th,ths->ts", weights.double(), logits)
    return [dict(zip(s.tolist(), v.tolist())) for s, v in zip(slots, scores)]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
@pytest.mark.parametrize(
    "seq_lens,query_lens,num_heads,head_dim,block_size,topk",
    [
        ([37, 9, 50], [6, 1, 3], 5, 24, 4, 8),  # a chunk over its cached prefix, decodes
        ([12, 5], [1, 1], 4, 32, 1, 64),  # top-k past every context; block_size 1
    ],
)
def test_selection_over_fp8_keys_matches_the_dequantizing_reference(
    seq_lens, query_lens, num_heads, head_dim, block_size, topk, dtype, tol
):
    generator = torch.Generator().manual_seed(5)
    tables, query_seq, positions, num_blocks = paged_batch(seq_lens, query_lens, block_size,
                                                           generator)  # fmt: skip
    key_offset = LATENT_RANK + ROPE_DIM
    width = key_offset + key_columns(dtype, head_dim) + 2  # columns after the key too
    kv_cache = torch.randn(num_blocks, block_size, width, generator=generator).to(dtype)
    num_slots = num_blocks * block_size
    keys = torch.randn(num_slots, head_dim, generator=generator)
    dsa_write_cache_reference(kv_cache, torch.arange(num_slots), kv_cache.view(
        num_slots, -1)[:, :LATENT_RANK], kv_cache.view(num_slots, -1)[:, LATENT_RANK:key_offset],
        keys, index_fp8=True)  # fmt: skip
    q_index = torch.randn(len(positions), num_heads, head_dim, generator=generator).to(dtype)
    weights = torch.randn(len(positions), num_heads, generator=generator)
    max_context = max(seq_lens) + 3
    args = (q_index, weights, kv_cache, key_offset, tables, query_seq, positions, topk,
            max_context)  # fmt: skip
    ours = dsa_index_topk(*args, index_fp8=True)
    reference = dsa_index_topk_reference(*args, index_fp8=True)
    scores = dequantized_scores(q_index, weights, kv_cache, key_offset, tables, query_seq,
                                max_context)  # fmt: skip
    assert_same_selection(ours, reference, scores, tol)


def test_gpus_before_sm89_are_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="index_cache_dtype='fp8_e4m3' needs .* 8.9 or later"):
        check_fp8_index_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_index_device(torch.device("cuda", 0))
    check_fp8_index_device(torch.device("cpu"))  # the torch references
