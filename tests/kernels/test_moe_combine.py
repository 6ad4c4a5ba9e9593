"""MoE combine (Triton, interpreter on CPU) against the reference and against the index_add_ sum
that combine used before: tokens that went to no rank, to one, to all; world sizes 1, 2, 4."""

import pytest
import torch

from rayinfer.kernels.moe.moe_combine import combine_row_index, moe_combine, moe_combine_reference

TOLERANCES = {torch.float32: 1e-6, torch.float16: 1e-3}


def _rows(num_tokens: int, world: int, hidden: int, dtype, seed: int):
    """A routing in which token 0 goes nowhere, token 1 to rank 0 only, token 2 to every rank,
    the rest at random -> (back [S, H], send_token_ids [S], splits [world])."""
    gen = torch.Generator().manual_seed(seed)
    goes_to = torch.rand(num_tokens, world, generator=gen) < 0.5
    goes_to[0] = False
    if num_tokens > 1:
        goes_to[1] = False
        goes_to[1, 0] = True
    if num_tokens > 2:
        goes_to[2] = True
    dest_ids, token_ids = goes_to.t().nonzero(as_tuple=True)
    splits = torch.bincount(dest_ids, minlength=world).tolist()
    back = torch.randn(token_ids.shape[0], hidden, generator=gen).to(dtype)
    return back, token_ids, splits


def _index_add(back, token_ids, num_tokens):
    out = torch.zeros(num_tokens, back.shape[1], dtype=torch.float32)
    out.index_add_(0, token_ids, back.float())
    return out.to(back.dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 16), (7, 33), (13, 1100)])
def test_matches_reference_and_index_add(dtype, world, num_tokens, hidden):
    back, token_ids, splits = _rows(num_tokens, world, hidden, dtype, seed=world + num_tokens)
    index = combine_row_index(token_ids, splits, num_tokens)
    assert index.shape == (num_tokens, world) and index.dtype == torch.int32
    ours = moe_combine(back, index)
    expected = moe_combine_reference(back, index)
    assert ours.shape == (num_tokens, hidden) and ours.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(expected, _index_add(back, token_ids, num_tokens), atol=0, rtol=0)
    assert bool((ours[0] == 0).all())  # went nowhere
    if num_tokens > 1:
        torch.testing.assert_close(ours[1], back[0])  # rank 0 only: its row, as it was


def test_row_index_places_every_row_once():
    back, token_ids, splits = _rows(9, 4, 8, torch.float32, seed=3)
    index = combine_row_index(token_ids, splits, 9)
    valid = index[index >= 0].sort().values
    assert torch.equal(valid, torch.arange(token_ids.shape[0], dtype=torch.int32))
    rank_of_row = torch.repeat_interleave(torch.arange(4), torch.tensor(splits))
    for token, rank in (index >= 0).nonzero().tolist():
        row = int(index[token, rank])
        assert int(token_ids[row]) == token and int(rank_of_row[row]) == rank


def test_output_dtype_and_no_rows():
    back = torch.randn(0, 5)
    index = torch.full((3, 2), -1, dtype=torch.int32)
    out = moe_combine(back, index, torch.float16)
    assert out.dtype == torch.float16 and torch.equal(out, torch.zeros(3, 5, dtype=torch.float16))
    assert moe_combine(torch.randn(4, 5), torch.empty(0, 2, dtype=torch.int32)).shape == (0, 5)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_addends_are_summed_with_the_rows(count, dtype):
    """A rank's own experts' share (and the shared experts') added in the same pass: the float32
    sum of the addends and the rows, in the output dtype; a strided addend reads right."""
    num_tokens, hidden = 11, 40
    back, token_ids, splits = _rows(num_tokens, 2, hidden, dtype, seed=5)
    index = combine_row_index(token_ids, splits, num_tokens)
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(num_tokens, 2 * hidden, generator=gen).to(dtype)
    addends = (wide[:, :hidden], torch.randn(num_tokens, hidden, generator=gen).to(dtype))[:count]
    ours = moe_combine(back, index, torch.float32, addends)
    expected = _index_add(back.float(), token_ids, num_tokens) + sum(a.float() for a in addends)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe_combine_reference(back, index, torch.float32, addends), expected)
    went_nowhere = sum(a[0].float() for a in addends)  # token 0: its addends alone
    torch.testing.assert_close(ours[0], went_nowhere, atol=1e-6, rtol=1e-6)


def test_addends_must_be_t_by_h_and_at_most_two():
    back, token_ids, splits = _rows(5, 2, 8, torch.float32, seed=1)
    index = combine_row_index(token_ids, splits, 5)
    with pytest.raises(ValueError, match=r"must be \[T, H\] = \[5, 8\]"):
        moe_combine(back, index, addends=(torch.zeros(5, 7),))
    with pytest.raises(ValueError, match="at most 2 addends"):
        moe_combine(back, index, addends=(torch.zeros(5, 8),) * 3)
