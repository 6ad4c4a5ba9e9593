"""The hand-off's one-launch gather and scatter of every layer's cache rows (Triton, interpreter on
CPU) against the per-layer torch reference: rows of one width and of mixed widths (DeepSeek-V4's
layer types, DSA layers without an indexer key), units of 8, 4, 2 and 1 bytes, slots in any order,
one token, no tokens, more tokens than a program's block; and the table's units and offsets."""

import pytest
import torch

from rayinfer.kernels.cache_rows import (
    BLOCK_TOKENS,
    CacheRowsTable,
    cache_rows,
    cache_rows_reference,
)


def byte_rows(widths, num_slots, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (num_slots, w), generator=generator, dtype=torch.uint8)
            for w in widths]  # fmt: skip


@pytest.mark.parametrize("widths", [(24, 24, 24), (1152,) * 3, (12, 20, 4), (6, 10), (7, 3, 1)])
@pytest.mark.parametrize("num_tokens", [0, 1, BLOCK_TOKENS + 5])
def test_gather_and_scatter_match_the_reference(widths, num_tokens):
    num_slots = 2 * BLOCK_TOKENS + 7
    layers = byte_rows(widths, num_slots, seed=sum(widths) + num_tokens)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(3))[:num_tokens]
    packed = torch.full((num_tokens * sum(widths),), 7, dtype=torch.uint8)
    cache_rows(CacheRowsTable(layers), packed, slots, to_cache=False)
    expected = torch.empty_like(packed)
    cache_rows_reference(layers, expected, slots, to_cache=False)
    assert torch.equal(packed, expected)

    targets = [torch.zeros_like(rows) for rows in layers]
    cache_rows(CacheRowsTable(targets), packed, slots, to_cache=True)
    for target, source in zip(targets, layers):
        assert torch.equal(target[slots], source[slots])
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[slots] = False
        assert not target[untouched].any()  # no other row written


def test_the_table_picks_the_widest_unit_that_divides_rows_and_addresses():
    backing = torch.zeros(8192, dtype=torch.uint8)
    assert CacheRowsTable([backing[:1024].view(64, 16), backing[2048:4096].view(64, 32)]).unit == (
        torch.int64
    )
    assert CacheRowsTable([backing[:1024].view(64, 16), backing[2052:4100].view(64, 32)]).unit == (
        torch.int32
    )
    table = CacheRowsTable([backing[:960].view(64, 15), backing[1024:1984].view(64, 15)])
    assert table.unit == torch.uint8
    assert table.layer_offsets.tolist() == [0, 1024]
    assert table.widths.tolist() == [15, 15]
    assert table.packed_starts.tolist() == [0, 15]
