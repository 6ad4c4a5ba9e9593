"""The DSA wrappers take per-token tensors in any layout: a strided view or a broadcast (stride 0)
of positions, slots and weights gives what their dense copies give (the kernels read them one
element at a time, without strides, so the wrappers make them dense)."""

import torch

from rayinfer.kernels.dsa.dsa_cache import dsa_write_cache
from rayinfer.kernels.dsa.dsa_indexer import dsa_index_topk, dsa_write_cache_reference
from rayinfer.kernels.dsa.v4_attention import (
    v4_attention,
    v4_attention_reference,
    v4_write_rows,
    v4_write_rows_reference,
)


def strided(values: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2."""
    return torch.stack([values, torch.full_like(values, -7)], 1)[:, 0]


def test_indexer_positions_and_weights_in_any_layout():
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 4, 16, generator=gen)  # 3 blocks of 4 tokens, keys at column 0
    tables, query_seq = (
        torch.tensor([[0, 1, 2]], dtype=torch.int32),
        torch.zeros(3, dtype=torch.int32),
    )
    q, weights = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, generator=gen)
    positions = torch.tensor([9, 10, 11])

    def select(positions, weights, selection):
        chosen = dsa_index_topk(q, weights, cache, 0, tables, query_seq, positions, 5, 12,
                                selection=selection)  # fmt: skip
        return chosen.sort(1).values

    for selection in ("radix", "torch"):
        dense = select(positions, weights, selection)
        assert torch.equal(select(strided(positions), weights, selection), dense)
        assert torch.equal(select(positions, weights.t().contiguous().t(), selection), dense)
    last = torch.tensor([11])
    assert torch.equal(
        select(last.expand(3), weights, "radix"), select(last.repeat(3), weights, "radix")
    )


def test_cache_writes_take_strided_slots():
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([0, 5, 11])
    kv_c, k_pe, key = (torch.randn(3, n, generator=gen) for n in (4, 2, 2))
    cache = torch.randn(3, 4, 8, generator=gen)
    ours, reference = cache.clone(), cache.clone()
    dsa_write_cache(ours, strided(slots), kv_c, k_pe, key)
    dsa_write_cache_reference(reference, slots, kv_c, k_pe, key)
    assert torch.equal(ours, reference)
    dsa_write_cache(cache, slots[:0], torch.randn(0, 1) * 10, k_pe[:0], None)  # nothing: no error

    rows, values = torch.randn(12, 8, generator=gen), torch.randn(3, 5, generator=gen)
    ours, reference = rows.clone(), rows.clone()
    v4_write_rows(ours, strided(torch.tensor([1, 4, 9])), values, 2)
    v4_write_rows_reference(reference, torch.tensor([1, 4, 9]), values, 2)
    assert torch.equal(ours, reference)


def test_v4_attention_positions_in_any_layout():
    gen = torch.Generator().manual_seed(2)
    window_tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    tables = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    window_cache, cache = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 4, 4, generator=gen)
    q, sinks = torch.randn(3, 3, 16, generator=gen), torch.randn(3, generator=gen)
    seq_ids, positions = torch.zeros(3, dtype=torch.long), torch.tensor([3, 7, 11])

    def args(seq_ids, positions):
        return (q, window_cache, window_tables, cache, tables, seq_ids, positions, 8, (4, 4, 0),
                None, 3, sinks, 0.25, 12)  # fmt: skip

    expected = v4_attention_reference(*args(seq_ids, positions))
    ours = v4_attention(*args(strided(seq_ids), strided(positions)))
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    last = torch.tensor([11])
    torch.testing.assert_close(
        v4_attention(*args(seq_ids, last.expand(3))),
        v4_attention_reference(*args(seq_ids, last.repeat(3))), atol=1e-5, rtol=1e-5,
    )  # fmt: skip
