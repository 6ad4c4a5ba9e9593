"""DeepSeek-V4 attention's Triton kernel (interpreter on CPU) against the torch reference over the
hybrid cache (window pool + entries spread over the paged cache's rows, config_v4.py), and the
lightning indexer over spread entries, at odd and edge shapes: a query before its first window
ends, windows longer than the context, a window boundary inside a block, an entry that spreads
over more rows than a block holds, top-k larger than the entries available, heads not a
multiple of the head block, window tables with released (-1) blocks before the window."""

import pytest
import torch

from rayinfer.kernels.dsa.dsa_indexer import dsa_index_topk, dsa_index_topk_reference
from rayinfer.kernels.dsa.v4_attention import (
    gather_entries,
    v4_attention,
    v4_attention_reference,
)
from tests.kernels.test_dsa_indexer import paged_batch

DIM, WINDOW_WIDTH, WIDTH = 16, 24, 10  # key [0, 16) of a window row; a paged row of 10 columns


def hybrid_batch(seq_lens, query_lens, block_size, window, generator, dtype=torch.float32):
    """(window cache, window tables, cache, block tables, seq ids, positions): the window
    tables hold blocks only from each sequence's first window token on (-1 before)."""
    tables, query_seq, positions, num_blocks = paged_batch(
        seq_lens, query_lens, block_size, generator
    )
    window_tables, _, _, num_window_blocks = paged_batch(seq_lens, query_lens, block_size,
                                                         generator)  # fmt: skip
    for seq, (n, q) in enumerate(zip(seq_lens, query_lens)):
        first = max(n - q - window, 0) // block_size
        window_tables[seq, :first] = -1  # released: never read
    window_cache = torch.randn(num_window_blocks, block_size, WINDOW_WIDTH, generator=generator)
    cache = torch.randn(num_blocks, block_size, WIDTH, generator=generator)
    return (window_cache.to(dtype), window_tables, cache.to(dtype), tables, query_seq.long(),
            positions)  # fmt: skip


@pytest.mark.parametrize(
    "seq_lens, query_lens, block_size, window, entries, spread",
    [
        ([3], [3], 4, 8, "none", None),  # context shorter than the window
        ([37, 5], [1, 5], 4, 8, "every", (4, 4, 0)),  # a decode; a prompt before its first entry
        ([50, 21], [7, 21], 3, 16, "every", (8, 2, 4)),  # an entry over 8 rows, blocks of 3
        ([29, 9], [29, 2], 8, 4, "listed", (4, 4, 6)),  # listed entries, -1 padded
        ([64], [1], 16, 128, "listed", (4, 4, 0)),  # window past the context; a decode
        ([30, 11], [30, 3], 3, 8, "listed", (4, 4, 1)),  # listed entries across blocks of 3
        ([41, 17], [9, 17], 4, 8, "every", (8, 2, 0)),  # entries over two whole blocks
        ([70], [5], 2, 16, "every", (16, 2, 2)),  # over eight whole blocks of 2
        ([70], [5], 2, 16, "every", (32, 2, 0)),  # over sixteen: a table load per element
    ],
)
@pytest.mark.parametrize("num_heads", [3, 16, 20])
def test_kernel_matches_the_reference(seq_lens, query_lens, block_size, window, entries, spread,
                                      num_heads):  # fmt: skip
    generator = torch.Generator().manual_seed(len(seq_lens) * 100 + window + num_heads)
    window_cache, window_tables, cache, tables, seq_ids, positions = hybrid_batch(
        seq_lens, query_lens, block_size, window, generator
    )
    queries = torch.randn(positions.shape[0], num_heads, DIM, generator=generator)
    sinks = torch.randn(num_heads, generator=generator)
    entry_list, most = None, 0
    if entries == "every":
        most = max(seq_lens) // spread[0]
    elif entries == "listed":
        visible = (positions + 1) // spread[0]
        picks = torch.randint(0, 1 << 20, (positions.shape[0], 6), generator=generator)
        picks = picks % visible.clamp(min=1)[:, None]
        picks[:, 4:] = -1
        picks[0, :] = -1  # a query with no entry at all
        entry_list = torch.where(visible[:, None] > 0, picks, -1).to(torch.int32)
    args = (queries, window_cache, window_tables, cache, tables, seq_ids, positions, window,
            spread, entry_list, most, sinks, DIM**-0.5, max(seq_lens))  # fmt: skip
    expected = v4_attention_reference(*args)
    torch.testing.assert_close(v4_attention(*args), expected, atol=1e-5, rtol=1e-5)


def test_an_entry_is_read_from_the_rows_of_the_tokens_it_pools():
    block_size, (rate, share, column) = 3, (4, 5, 2)  # 16 values over rows of 4 tokens
    tables = torch.tensor([[2, 0, 1]], dtype=torch.int32)  # positions 0-8 in shuffled blocks
    cache = torch.zeros(3, block_size, 8)
    entry = torch.arange(16.0)
    for c in range(16):  # entry 1 pools tokens 4-7: element c in token 4 + c // 5
        position = 4 + c // share
        block = int(tables[0, position // block_size])
        cache[block, position % block_size, column + c % share] = entry[c]
    got = gather_entries(cache, tables, torch.tensor([0]), torch.tensor([[1, -1]]),
                         (rate, share, column), 16)  # fmt: skip
    assert torch.equal(got[0, 0], entry) and torch.equal(got[0, 1], torch.zeros(16))


def test_sinks_take_probability_mass():
    generator = torch.Generator().manual_seed(7)
    window_cache, window_tables, cache, tables, seq_ids, positions = hybrid_batch(
        [9], [9], 4, 4, generator
    )
    queries = torch.randn(9, 2, DIM, generator=generator)
    args = (window_cache, window_tables, cache, tables, seq_ids, positions, 4, None, None, 0)
    none = v4_attention_reference(queries, *args, torch.full((2,), -1e9), 0.25, 9)
    heavy = v4_attention_reference(queries, *args, torch.full((2,), 1e9), 0.25, 9)
    assert heavy.abs().max() < 1e-6 < none.abs().max()


@pytest.mark.parametrize("topk", [1, 3, 50])  # 50: more than any query's entries
# blocks of 4 and 8: each entry's rows in one block (one table load per entry); of 3: entries
# across blocks (a table load per element)
@pytest.mark.parametrize("block_size", [4, 3, 8])
def test_indexer_over_spread_entries_matches_the_reference(topk, block_size):
    generator = torch.Generator().manual_seed(topk)
    seq_lens, query_lens, rate, share, column = [45, 6, 17], [3, 6, 1], 4, 2, 3
    _, _, cache, tables, seq_ids, positions = hybrid_batch(seq_lens, query_lens, block_size, 8,
                                                           generator)  # fmt: skip
    queries = torch.randn(positions.shape[0], 5, 8, generator=generator)
    weights = torch.rand(positions.shape[0], 5, generator=generator)
    most = max(seq_lens) // rate
    args = (queries, weights, cache, column, tables, seq_ids.int(), positions, topk, most)
    ours = dsa_index_topk(*args, spread=(rate, share))
    expected = dsa_index_topk_reference(*args, False, (rate, share))
    assert torch.equal(ours.sort(dim=1).values, expected.sort(dim=1).values)
    # entry numbers the query has reached, as many as it can have
    for row, position in enumerate(positions.tolist()):
        chosen = [e for e in expected[row].tolist() if e >= 0]
        assert all(e < (position + 1) // rate for e in chosen)
        assert len(set(chosen)) == len(chosen) == min(topk, (position + 1) // rate)
