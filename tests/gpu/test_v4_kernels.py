"""DeepSeek-V4's attention kernel and pooled-entry indexer on CUDA against their torch references
at V4-Flash shapes (64 heads sharing one 512-wide key, window 128, CSA entries of 4 tokens with
512 picks, HCA entries of 128 tokens, blocks of 64), bf16 and float32.

    python -m pytest -q -s -m gpu tests/gpu/test_v4_kernels.py
"""

import pytest
import torch

from rayinfer.kernels.dsa.dsa_indexer import dsa_index_topk, dsa_index_topk_reference
from rayinfer.kernels.dsa.v4_attention import v4_attention, v4_attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, DIM, WINDOW, BLOCK = 64, 512, 128, 64
WIDTH, ENTRY_COL = 3712, 2560  # V4-Flash's row and its entry columns (config_v4.V4CacheRow)


def batch(seq_lens, query_lens, dtype, generator):
    counts = [-(-n // BLOCK) for n in seq_lens]
    pool = torch.randperm(sum(counts), generator=generator).int()
    tables = torch.full((len(seq_lens), max(counts)), -1, dtype=torch.int32)
    start = 0
    for i, count in enumerate(counts):
        tables[i, :count] = pool[start : start + count]
        start += count
    seq_ids = torch.cat([torch.full((q,), i) for i, q in enumerate(query_lens)])
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, query_lens)])
    cache = (torch.randn(sum(counts), BLOCK, WIDTH, generator=generator) * 0.5).to(dtype)
    return cache.cuda(), tables.cuda(), seq_ids.cuda(), positions.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("shape", [([4096] * 8, [1] * 8), ([2048, 700], [512, 700])])
def test_attention_kernel_matches_the_reference(dtype, kind, shape):
    generator = torch.Generator().manual_seed(0)
    seq_lens, query_lens = shape
    cache, tables, seq_ids, positions = batch(seq_lens, query_lens, dtype, generator)
    queries = (torch.randn(len(positions), HEADS, DIM, generator=generator) * 0.05).to(dtype)
    sinks = torch.randn(HEADS, generator=generator).cuda()
    entry_slots, stride, most = None, 0, 0
    if kind == "csa":
        slots = torch.randint(0, cache.shape[0] * BLOCK, (len(positions), 512), generator=generator)
        slots[:, 400:] = -1
        entry_slots = slots.int().cuda()
    else:
        stride, most = 128, max(seq_lens) // 128
    args = (queries.cuda(), cache, tables, seq_ids, positions, WINDOW, ENTRY_COL, entry_slots,
            stride, most, sinks, DIM**-0.5, max(seq_lens))  # fmt: skip
    expected = v4_attention_reference(*args).float()
    ours = v4_attention(*args).float()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(ours, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_over_pooled_entries_matches_the_reference(dtype):
    generator = torch.Generator().manual_seed(1)
    seq_lens, query_lens = [8192, 3000], [16, 64]
    cache, tables, seq_ids, positions = batch(seq_lens, query_lens, dtype, generator)
    queries = torch.randn(len(positions), 64, 128, generator=generator).to(dtype).cuda()
    weights = torch.rand(len(positions), 64, generator=generator).cuda()
    args = (queries, weights, cache, 3584, tables, seq_ids.int(), positions, 512, 8192 // 4)
    ours = dsa_index_topk(*args, entry_stride=4)
    expected = dsa_index_topk_reference(*args, False, 4)
    # ties aside, the same entries: compare the sorted slot sets' overlap
    same = [len(set(a.tolist()) & set(b.tolist())) / len(set(b.tolist()))
            for a, b in zip(ours.cpu(), expected.cpu())]  # fmt: skip
    assert min(same) > 0.98, min(same)
