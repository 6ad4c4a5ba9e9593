"""DeepSeek-V4 attention's Triton kernel (interpreter on CPU) against the torch reference, and
the lightning indexer over pooled entries (`entry_stride`), at odd and edge shapes: a query
before its first window ends, windows longer than the context, a window boundary inside a
block, top-k larger than the entries available, heads not a multiple of the head block."""

import pytest
import torch

from rayinfer.kernels.dsa.dsa_indexer import dsa_index_topk, dsa_index_topk_reference
from rayinfer.kernels.dsa.v4_attention import v4_attention, v4_attention_reference
from tests.kernels.test_dsa_indexer import paged_batch

WIDTH, ENTRY_COL = 40, 20  # row: key [0, D) ... entry [20, 20 + D)


def cache_and_batch(seq_lens, query_lens, block_size, generator, dtype=torch.float32):
    tables, query_seq, positions, num_blocks = paged_batch(
        seq_lens, query_lens, block_size, generator
    )
    cache = torch.randn(num_blocks, block_size, WIDTH, generator=generator).to(dtype)
    return cache, tables, query_seq.long(), positions


@pytest.mark.parametrize(
    "seq_lens, query_lens, block_size, window, entries",
    [
        ([3], [3], 4, 8, "none"),  # context shorter than the window
        ([37, 5], [1, 5], 4, 8, "every"),  # a decode and a prompt before its first entry
        ([50, 21], [7, 21], 3, 16, "every"),  # windows cross blocks of 3
        ([29, 9], [29, 2], 8, 4, "listed"),  # listed entries, -1 padded
        ([64], [1], 16, 128, "listed"),  # window past the context; a decode
    ],
)
@pytest.mark.parametrize("num_heads", [3, 16, 20])
def test_kernel_matches_the_reference(seq_lens, query_lens, block_size, window, entries,
                                      num_heads):  # fmt: skip
    generator = torch.Generator().manual_seed(len(seq_lens) * 100 + window + num_heads)
    cache, tables, seq_ids, positions = cache_and_batch(seq_lens, query_lens, block_size,
                                                        generator)  # fmt: skip
    dim, rate = 16, 4
    queries = torch.randn(positions.shape[0], num_heads, dim, generator=generator)
    sinks = torch.randn(num_heads, generator=generator)
    entry_slots, stride, most = None, 0, 0
    if entries == "every":
        stride, most = rate, max(seq_lens) // rate
    elif entries == "listed":
        slots = torch.randint(0, cache.shape[0] * block_size, (positions.shape[0], 6),
                              generator=generator)  # fmt: skip
        slots[:, 4:] = -1
        slots[0, :] = -1  # a query with no entry at all
        entry_slots = slots.to(torch.int32)
    args = (queries, cache, tables, seq_ids, positions, window, ENTRY_COL, entry_slots, stride,
            most, sinks, dim**-0.5, max(seq_lens))  # fmt: skip
    expected = v4_attention_reference(*args)
    torch.testing.assert_close(v4_attention(*args), expected, atol=1e-5, rtol=1e-5)


def test_sinks_take_probability_mass():
    generator = torch.Generator().manual_seed(7)
    cache, tables, seq_ids, positions = cache_and_batch([9], [9], 4, generator)
    queries = torch.randn(9, 2, 16, generator=generator)
    args = (cache, tables, seq_ids, positions, 4, ENTRY_COL, None, 0, 0)
    none = v4_attention_reference(queries, *args, torch.full((2,), -1e9), 0.25, 9)
    heavy = v4_attention_reference(queries, *args, torch.full((2,), 1e9), 0.25, 9)
    assert heavy.abs().max() < 1e-6 < none.abs().max()


@pytest.mark.parametrize("topk", [1, 3, 50])  # 50: more than any query's entries
def test_indexer_over_pooled_entries_matches_the_reference(topk):
    generator = torch.Generator().manual_seed(topk)
    seq_lens, query_lens, block_size, rate = [45, 6, 17], [3, 6, 1], 4, 4
    cache, tables, seq_ids, positions = cache_and_batch(seq_lens, query_lens, block_size,
                                                        generator)  # fmt: skip
    queries = torch.randn(positions.shape[0], 5, 8, generator=generator)
    weights = torch.rand(positions.shape[0], 5, generator=generator)
    most = max(seq_lens) // rate
    args = (queries, weights, cache, ENTRY_COL, tables, seq_ids.int(), positions, topk, most)
    ours = dsa_index_topk(*args, entry_stride=rate)
    expected = dsa_index_topk_reference(*args, False, rate)
    assert torch.equal(ours.sort(dim=1).values, expected.sort(dim=1).values)
    # every chosen slot holds an entry the query has reached: the last row of a window
    slot_positions = {}
    for seq, n in enumerate(seq_lens):
        for p in range(n):
            slot = int(tables[seq, p // block_size]) * block_size + p % block_size
            slot_positions[slot] = p
    for row, position in enumerate(positions.tolist()):
        chosen = [slot_positions[s] for s in expected[row].tolist() if s >= 0]
        assert all((p + 1) % rate == 0 and p <= position for p in chosen)
        assert len(chosen) == min(topk, (position + 1) // rate)
