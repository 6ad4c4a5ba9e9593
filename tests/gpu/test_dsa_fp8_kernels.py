"""FP8 e4m3 index keys (index_cache_dtype="fp8_e4m3") on a GPU at GLM-5's shapes (indexer 32
heads x 128, bf16 cache rows 576 + 72 = 648 wide: 132 bytes padded to 16-byte rows, blocks of
64, index_topk 2048): the Triton write against the torch reference (within one rounding), and
the score kernel's selections against the float32 scores of the dequantized keys:

    python -m pytest -q -m gpu tests/gpu/test_dsa_fp8_kernels.py
"""

import pytest
import torch

from rayinfer.kernels.dsa.dsa_cache import dsa_write_cache
from rayinfer.kernels.dsa.dsa_index_fp8 import gather_index_keys
from rayinfer.kernels.dsa.dsa_indexer import (
    context_slots,
    dsa_index_topk,
    dsa_index_topk_reference,
    dsa_write_cache_reference,
)
from rayinfer.kernels.fp8.fp8_support import FP8_CAPABILITY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < FP8_CAPABILITY,
        reason="needs a CUDA GPU of sm_89 or later",
    ),
]

LATENT_WIDTH, INDEX_HEADS, INDEX_DIM, BLOCK_SIZE, TOPK = 576, 32, 128, 64, 2048
ROW_WIDTH = LATENT_WIDTH + 72  # bf16: 128 key bytes + 4 scale bytes, rows of 16-byte multiples


def written_cache(num_slots: int, seed: int):
    """(cache [blocks, 64, 648] bf16 whose every row the Triton write filled, its inputs)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.zeros(num_slots // BLOCK_SIZE, BLOCK_SIZE, ROW_WIDTH, device="cuda").bfloat16()
    latent = torch.randn(num_slots, LATENT_WIDTH, device="cuda", generator=generator).bfloat16()
    kv_c, k_pe = latent[:, :512], latent[:, 512:]
    magnitude = torch.logspace(-3, 3, num_slots, device="cuda")[:, None]
    keys = torch.randn(num_slots, INDEX_DIM, device="cuda", generator=generator) * magnitude
    keys = keys.bfloat16()
    slots = torch.randperm(num_slots, device="cuda", generator=generator)
    dsa_write_cache(cache, slots, kv_c, k_pe, keys, index_fp8=True)
    return cache, (slots, kv_c, k_pe, keys)


def test_write_matches_the_reference_within_one_rounding():
    """Latent bytes exact; each scale within 2 ulp of torch's amax / 448 on the same GPU (they
    differ by 1 ulp in about half the rows) and each FP8 key the reference's or one e4m3 step
    from it (where that 1-ulp scale difference tips the rounding over)."""
    cache, inputs = written_cache(1 << 16, seed=0)
    expected = torch.zeros_like(cache)
    dsa_write_cache_reference(expected, *inputs, index_fp8=True)
    ours, theirs = cache.view(torch.uint8).flatten(0, 1), expected.view(torch.uint8).flatten(0, 1)
    latent_bytes, key_end = LATENT_WIDTH * 2, LATENT_WIDTH * 2 + INDEX_DIM
    assert torch.equal(ours[:, :latent_bytes], theirs[:, :latent_bytes])
    keys = [x[:, latent_bytes:key_end].view(torch.float8_e4m3fn).float() for x in (ours, theirs)]
    step = keys[0].abs().maximum(keys[1].abs()) / 8 + 2**-9  # e4m3: 3 mantissa bits; subnormals
    assert bool(((keys[0] - keys[1]).abs() <= step).all())
    scales = [x[:, key_end : key_end + 4].contiguous().view(torch.float32) for x in (ours, theirs)]
    torch.testing.assert_close(scales[0], scales[1], rtol=2.5e-7, atol=0)


@pytest.mark.parametrize("seq_lens,query_lens", [([8192] * 16, [1] * 16), ([16384], [64])],
                         ids=["decode-16x8k", "chunk-64-over-16k"])  # fmt: skip
def test_selection_over_fp8_keys_matches_the_dequantized_scores(seq_lens, query_lens):
    cache, _ = written_cache(sum(seq_lens), seed=1)
    generator = torch.Generator(device="cuda").manual_seed(2)
    counts = [n // BLOCK_SIZE for n in seq_lens]
    order = torch.randperm(sum(counts), device="cuda", generator=generator).to(torch.int32)
    tables = torch.stack(order.split(counts[0])) if len(set(counts)) == 1 else order[None]
    query_seq = torch.cat([torch.full((q,), i, dtype=torch.int32, device="cuda")
                           for i, q in enumerate(query_lens)])  # fmt: skip
    positions = torch.cat([torch.arange(n - q, n, device="cuda")
                           for n, q in zip(seq_lens, query_lens)])  # fmt: skip
    q_index = torch.randn(len(positions), INDEX_HEADS, INDEX_DIM, device="cuda").bfloat16()
    weights = torch.randn(len(positions), INDEX_HEADS, device="cuda") * 0.01
    args = (q_index, weights, cache, LATENT_WIDTH, tables, query_seq, positions, TOPK,
            max(seq_lens))  # fmt: skip
    ours = dsa_index_topk(*args, index_fp8=True)
    reference = dsa_index_topk_reference(*args, index_fp8=True)
    context = context_slots(tables, query_seq, BLOCK_SIZE, max(seq_lens))  # [T, S]
    for t in range(len(positions)):  # sorted float32 scores of what each chose
        keys = gather_index_keys(cache, LATENT_WIDTH, INDEX_DIM, context[t])  # [S, D]
        scores = (q_index[t].float() @ keys.t()).relu().t() @ weights[t]  # [S]
        by_slot = dict(zip(context[t].tolist(), scores.tolist()))
        picked = [
            sorted(by_slot[s] for s in row if s >= 0)
            for row in (ours[t].tolist(), reference[t].tolist())
        ]
        scale = max(abs(v) for v in picked[1])
        torch.testing.assert_close(picked[0], picked[1], atol=1e-3 * scale, rtol=0)
