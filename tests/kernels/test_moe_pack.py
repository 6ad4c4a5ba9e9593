"""The all-tokens exchange's row passes (Triton, interpreter on CPU) against their torch references:
bytes equal, for odd hidden sizes, one token, no tokens, top-k 1 to 8 and 1 to 3 ranks."""

import pytest
import torch

from rayinfer.kernels.moe.moe_pack import (
    localize_expert_ids,
    localize_expert_ids_reference,
    pack_for_every_rank,
    pack_for_every_rank_reference,
    pack_fp8_for_every_rank,
    pack_fp8_for_every_rank_reference,
    unpack_fp8_rows,
    unpack_fp8_rows_reference,
)


def _layout(hidden: int, itemsize: int, topk: int) -> tuple[int, int]:
    """(ids_at, row_bytes) as comm.moe.RowLayout lays out a non-FP8 row."""
    ids_at = -(-hidden * itemsize // 4) * 4
    return ids_at, -(-(ids_at + 8 * topk) // 64) * 64


def _routing(num_tokens: int, hidden: int, topk: int, num_experts: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(1)[:, :topk]
    weights = torch.rand(num_tokens, topk, generator=gen)
    return x, ids, weights


# bfloat16 too: these kernels only move bytes, which the interpreter gets right for it
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "num_tokens, hidden, topk, world", [(5, 48, 2, 2), (1, 33, 8, 3), (0, 64, 4, 2), (7, 130, 1, 1)]
)
def test_pack_writes_the_reference_bytes(dtype, num_tokens, hidden, topk, world):
    x, ids, weights = _routing(num_tokens, hidden, topk, 8, dtype, seed=hidden)
    ids_at, row_bytes = _layout(hidden, x.element_size(), topk)
    got = pack_for_every_rank(x, ids, weights, world, ids_at, row_bytes)
    expected = pack_for_every_rank_reference(x, ids, weights, world, ids_at, row_bytes)
    assert got.shape == (world * num_tokens, row_bytes)
    payload = hidden * x.element_size()  # bytes between the payload and the ids are unused
    assert torch.equal(got[:, :payload], expected[:, :payload])
    assert torch.equal(got[:, ids_at:], expected[:, ids_at:])


@pytest.mark.parametrize("first_expert, num_local", [(0, 4), (4, 4), (0, 8), (6, 2)])
def test_localize_keeps_only_this_ranks_experts(first_expert, num_local):
    x, ids, weights = _routing(9, 40, 3, 8, torch.float32, seed=first_expert)
    ids_at, row_bytes = _layout(40, 4, 3)
    rows = pack_for_every_rank_reference(x, ids, weights, 1, ids_at, row_bytes)
    local, kept = localize_expert_ids(rows, ids_at, 3, first_expert, num_local)
    expected_local, expected_kept = localize_expert_ids_reference(
        rows, ids_at, 3, first_expert, num_local
    )
    assert torch.equal(local, expected_local) and torch.equal(kept, expected_kept)
    held = (ids >= first_expert) & (ids < first_expert + num_local)
    assert torch.equal(local, torch.where(held, ids - first_expert, -1))
    assert torch.equal(kept, torch.where(held, weights, 0.0))


def test_a_layout_too_small_for_the_row_is_refused():
    x, ids, weights = _routing(2, 40, 3, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="cannot hold 40 x 4-byte values and 3 ids"):
        pack_for_every_rank(x, ids, weights, 2, ids_at=64, row_bytes=128)


def _fp8_layout(hidden: int, topk: int) -> tuple[int, int, int]:
    """(scale_at, ids_at, row_bytes) as comm.moe.RowLayout lays out an FP8 row."""
    scale_at = -(-hidden // 4) * 4
    ids_at = scale_at + 4
    return scale_at, ids_at, -(-(ids_at + 8 * topk) // 64) * 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "num_tokens, hidden, topk, world", [(5, 48, 2, 2), (1, 33, 8, 3), (0, 64, 4, 2), (7, 130, 1, 1)]
)
def test_fp8_pack_quantizes_once_and_writes_every_ranks_row(dtype, num_tokens, hidden, topk, world):
    x, ids, weights = _routing(num_tokens, hidden, topk, 8, dtype, seed=hidden)
    x[:1] *= 0  # an all-zero token: a tiny scale, zero values
    scale_at, ids_at, row_bytes = _fp8_layout(hidden, topk)
    got = pack_fp8_for_every_rank(x, ids, weights, world, scale_at, ids_at, row_bytes)
    expected = pack_fp8_for_every_rank_reference(
        x, ids, weights, world, scale_at, ids_at, row_bytes
    )
    assert got.shape == (world * num_tokens, row_bytes)
    assert torch.equal(got[:, scale_at:], expected[:, scale_at:])  # scale, ids, weights, zeros
    values, want = (rows[:, :hidden].contiguous().view(torch.float8_e4m3fn).float()
                    for rows in (got, expected))  # fmt: skip
    # The kernel rounds onto the e4m3 grid itself: at most one step apart from torch's cast,
    # and only on rare values (fp8_quant's tests saw one in ~1,900).
    assert (values - want).abs().le(want.abs() / 8 + 2**-9).all()
    assert (values != want).sum() <= 0.01 * values.numel()
    written = torch.cat([got[:, :hidden], got[:, scale_at:]], dim=1)  # the gap is never read
    for rank in range(world):  # the same row for every rank
        copy = written[rank * num_tokens : (rank + 1) * num_tokens]
        assert torch.equal(copy, written[:num_tokens])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)  # bf16: on the GPU
def test_fp8_unpack_dequantizes_the_rows_as_they_arrived(dtype):
    x, ids, weights = _routing(6, 130, 3, 8, torch.float32, seed=3)
    scale_at, ids_at, row_bytes = _fp8_layout(130, 3)
    rows = pack_fp8_for_every_rank_reference(x, ids, weights, 2, scale_at, ids_at, row_bytes)
    got = unpack_fp8_rows(rows, 130, scale_at, dtype)
    expected = unpack_fp8_rows_reference(rows, 130, scale_at, dtype)
    assert got.dtype == dtype and got.shape == (12, 130)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # and within the documented FP8 dispatch bound of the tokens themselves (comm/fp8.py)
    from rayinfer.comm.fp8 import error_bound

    assert ((got[:6].float() - x).abs() <= error_bound(x).to(dtype).float() + 1e-6).all()
