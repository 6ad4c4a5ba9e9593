"""DeepSeek-V4's attention kernel and pooled-entry indexer on CUDA against their torch references
at V4-Flash shapes over its hybrid cache (64 heads sharing one 512-wide key from the window pool,
window 128; CSA entries of 4 tokens with 512 picks and HCA entries of 128 tokens spread over the
paged cache's 160-column rows; blocks of 64), bf16 and float32.

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
WINDOW_WIDTH, WIDTH, INDEX_COL = 3072, 160, 128  # V4-Flash's rows (config_v4.py)
SPREADS = {"csa": (4, 128, 0), "hca": (128, 4, 0)}  # (rate, share, column) of the entries


def shuffled_tables(seq_lens, generator):
    counts = [-(-n // BLOCK) for n in seq_lens]
    pool = torch.randperm(sum(counts), generator=generator).int()
    tables = torch.full((len(seq_lens), max(counts)), -1, dtype=torch.int32)
    start = 0
    for i, count in enumerate(counts):
        tables[i, :count] = pool[start : start + count]
        start += count
    return tables, sum(counts)


def batch(seq_lens, query_lens, dtype, generator):
    """(window cache, window tables, cache, tables, seq ids, positions) on the GPU."""
    tables, num_blocks = shuffled_tables(seq_lens, generator)
    window_tables, _ = shuffled_tables(seq_lens, generator)
    seq_ids = torch.cat([torch.full((q,), i) for i, q in enumerate(query_lens)])
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, query_lens)])
    window = (torch.randn(num_blocks, BLOCK, WINDOW_WIDTH, generator=generator) * 0.5).to(dtype)
    cache = (torch.randn(num_blocks, BLOCK, WIDTH, generator=generator) * 0.5).to(dtype)
    return (window.cuda(), window_tables.cuda(), cache.cuda(), tables.cuda(), seq_ids.cuda(),
            positions.cuda())  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("shape", [([4096] * 8, [1] * 8), ([2048, 700], [512, 700])])
def test_attention_kernel_matches_the_reference(dtype, kind, shape):
    generator = torch.Generator().manual_seed(0)
    seq_lens, query_lens = shape
    window, window_tables, cache, tables, seq_ids, positions = batch(
        seq_lens, query_lens, dtype, generator
    )
    queries = (torch.randn(len(positions), HEADS, DIM, generator=generator) * 0.05).to(dtype)
    sinks = torch.randn(HEADS, generator=generator).cuda()
    entry_list, most = None, 0
    if kind == "csa":
        visible = ((positions.cpu() + 1) // 4).clamp(min=1)
        picks = (
            torch.randint(0, 1 << 30, (len(positions), 512), generator=generator) % visible[:, None]
        )
        picks[:, 400:] = -1
        entry_list = picks.int().cuda()
    else:
        most = max(seq_lens) // 128
    args = (queries.cuda(), window, window_tables, cache, tables, seq_ids, positions, WINDOW,
            SPREADS[kind], entry_list, most, sinks, DIM**-0.5, max(seq_lens))  # fmt: skip
    expected = v4_attention_reference(*args).float()
    ours = v4_attention(*args).float()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(ours, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_over_pooled_entries_matches_the_reference(dtype):
    generator = torch.Generator().manual_seed(1)
    seq_lens, query_lens = [8192, 3000], [16, 64]
    _, _, cache, tables, seq_ids, positions = batch(seq_lens, query_lens, dtype, generator)
    queries = torch.randn(len(positions), 64, 128, generator=generator).to(dtype).cuda()
    weights = torch.rand(len(positions), 64, generator=generator).cuda()
    args = (queries, weights, cache, INDEX_COL, tables, seq_ids.int(), positions, 512, 8192 // 4)
    ours = dsa_index_topk(*args, spread=(4, 32))
    expected = dsa_index_topk_reference(*args, False, (4, 32))
    # ties aside, the same entries: compare the chosen sets' overlap
    same = [len(set(a.tolist()) & set(b.tolist())) / len(set(b.tolist()))
            for a, b in zip(ours.cpu(), expected.cpu())]  # fmt: skip
    assert min(same) > 0.98, min(same)
