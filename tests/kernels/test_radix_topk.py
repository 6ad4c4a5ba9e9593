"""The radix-select top-k (Triton, interpreter on CPU) against torch.topk: the same values chosen,
each column once, ties taken lowest column first, and the same result for every split of a row."""

import pytest
import torch

from rayinfer.kernels.dsa.dsa_indexer import chosen_slots
from rayinfer.kernels.dsa.radix_topk import choose_splits, radix_topk
from tests.kernels.test_dsa_indexer import paged_batch

ONE_SPLIT = dict(BLOCK=64, num_warps=4, target_programs=1, min_cols_per_split=64)
MANY_SPLITS = dict(BLOCK=16, num_warps=4, target_programs=64, min_cols_per_split=16)


def topk_columns(scores: torch.Tensor, k: int, params: dict) -> torch.Tensor:
    out = torch.full((scores.shape[0], k + 3), -7, dtype=torch.int32)
    radix_topk(scores, k, out, params)
    assert (out[:, k:] == -7).all()  # nothing written past k
    return out[:, :k]


def assert_top_values(scores: torch.Tensor, columns: torch.Tensor, k: int) -> None:
    assert ((columns >= 0) & (columns < scores.shape[1])).all()
    assert all(len(set(row.tolist())) == k for row in columns)  # each column once
    chosen = scores.gather(1, columns.long()).sort(-1).values
    torch.testing.assert_close(chosen, scores.topk(k, dim=-1).values.sort(-1).values)


@pytest.mark.parametrize("params", [ONE_SPLIT, MANY_SPLITS], ids=["one_split", "many_splits"])
@pytest.mark.parametrize(
    "num_rows,num_cols,k",
    [
        (3, 211, 37),  # odd row length, a partial last block
        (2, 90, 90),  # k = the whole row
        (4, 130, 1),  # top-k = 1
        (1, 1, 1),  # a one-column row
    ],
)
def test_radix_topk_picks_the_top_values(num_rows, num_cols, k, params):
    scores = torch.randn(num_rows, num_cols, generator=torch.Generator().manual_seed(num_cols))
    assert_top_values(scores, topk_columns(scores, k, params), k)


@pytest.mark.parametrize("params", [ONE_SPLIT, MANY_SPLITS], ids=["one_split", "many_splits"])
def test_radix_topk_edge_values_and_ties(params):
    """-inf (causal masking), both zeros, negatives, huge magnitudes, and ties at the threshold."""
    scores = torch.randn(5, 120, generator=torch.Generator().manual_seed(0))
    scores[0, ::2] = float("-inf")  # more -inf than k leaves room for: some are chosen
    scores[0, 1::2] = -1.0
    scores[1, :] = 0.0
    scores[1, ::3] = -0.0
    scores[2, :] = -scores[2].abs() - 1e30  # all negative, near float32's end
    scores[3, :60] = 0.25  # 60 tied above the rest: 40 of them are taken
    scores[3, 60:] = -1.0
    scores[4, 100:] = 3e38
    columns = topk_columns(scores, 40, params)
    assert_top_values(scores, columns, 40)
    assert sorted(columns[3].tolist()) == list(range(40))  # lowest tied columns first
    assert sorted(columns[1].tolist()) == [c for c in range(120) if c % 3][:40]  # +0.0 first


def test_radix_topk_is_the_same_for_every_split_and_run():
    scores = torch.randn(2, 300, generator=torch.Generator().manual_seed(1)).round(decimals=1)
    one = topk_columns(scores, 77, ONE_SPLIT)
    many = topk_columns(scores, 77, MANY_SPLITS)
    assert choose_splits(2, 300, MANY_SPLITS)[0] > 1
    assert torch.equal(one, many)
    assert torch.equal(many, topk_columns(scores, 77, MANY_SPLITS))
    # above-threshold columns first, each group in ascending column order
    threshold = scores.topk(77, dim=-1).values[:, -1:]
    for row in range(2):
        above = [c for c in one[row].tolist() if scores[row, c] > threshold[row]]
        assert above == sorted(above) and one[row, : len(above)].tolist() == above


def test_radix_topk_writes_cache_slots_like_chosen_slots():
    """to_slots: the write pass maps positions through the block table."""
    generator = torch.Generator().manual_seed(2)
    tables, query_seq, positions, _ = paged_batch([70, 23, 41], [2, 1, 3], 4, generator)
    num_cols = 80
    scores = torch.randn(len(positions), num_cols, generator=generator)
    visible = torch.arange(num_cols) < positions[:, None] + 1
    scores = scores.masked_fill(~visible, float("-inf"))
    slots = torch.full((len(positions), 30), -7, dtype=torch.int32)
    radix_topk(scores, 30, slots, MANY_SPLITS, (tables, query_seq, positions, 4))
    columns = topk_columns(scores, 30, MANY_SPLITS)
    expected = chosen_slots(columns.long(), tables, query_seq, positions, 4)
    assert torch.equal(slots, expected)
    assert ((slots == -1) == ~visible.gather(1, columns.long())).all()


def test_radix_topk_bad_arguments_name_what_is_wrong():
    scores = torch.randn(2, 10)
    with pytest.raises(ValueError, match=r"k = 11 must be in \[1, 10\]"):
        radix_topk(scores, 11, torch.empty(2, 11, dtype=torch.int32), ONE_SPLIT)
    with pytest.raises(ValueError, match="float32"):
        radix_topk(scores.double(), 3, torch.empty(2, 3, dtype=torch.int32), ONE_SPLIT)
    with pytest.raises(ValueError, match=r"out \(2, 2\)"):
        radix_topk(scores, 3, torch.empty(2, 2, dtype=torch.int32), ONE_SPLIT)
