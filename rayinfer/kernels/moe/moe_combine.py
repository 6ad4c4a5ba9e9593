"""MoE combine: per token, the sum of the rows that came back to it from each EP rank.

Combine's all-to-all returns `back` [S, H]: one row per (token, rank) that dispatch sent, grouped
by rank. `row_index` [T, world] int32 says, for every token, which row of `back` came from each
rank (-1 where the token did not go there). The kernel gathers up to `world` rows per token, adds
them in float32 in rank order and writes [T, H] in the output dtype: no atomics, no float32
[T, H] buffer. Tokens that went to no rank get zeros. `addends` (up to two [T, H] tensors, e.g.
a rank's own experts' share of its tokens computed beside the exchange) are summed first, in the
same pass.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton


def combine_row_index(
    send_token_ids: torch.Tensor,  # [S] int: source token of each row, grouped by rank
    splits: list[int],  # [world] host ints: rows per rank, in that order
    num_tokens: int,
) -> torch.Tensor:
    """-> [T, world] int32: position in `back` of each token's row from each rank, or -1.
    No host sync: the split sizes are host ints."""
    world = len(splits)
    device = send_token_ids.device
    index = torch.full((num_tokens, world), -1, dtype=torch.int32, device=device)
    rows = torch.arange(send_token_ids.shape[0], dtype=torch.int32, device=device)
    start = 0
    for rank, count in enumerate(splits):
        if count:
            index[:, rank].index_copy_(0, send_token_ids[start : start + count].long(),
                                       rows[start : start + count])  # fmt: skip
        start += count
    return index


MAX_ADDENDS = 2


def moe_combine_reference(
    back: torch.Tensor,  # [S, H]
    row_index: torch.Tensor,  # [T, world] int
    out_dtype: torch.dtype | None = None,
    addends: tuple[torch.Tensor, ...] = (),  # each [T, H]
) -> torch.Tensor:
    """Sum in float32, addends then rank by rank (the order the kernel adds in) -> [T, H]."""
    num_tokens, world = row_index.shape
    acc = torch.zeros(num_tokens, back.shape[1], dtype=torch.float32, device=back.device)
    for addend in _checked(addends, num_tokens, back.shape[1]):
        acc = acc + addend.float()
    for rank in range(world if back.shape[0] else 0):  # no rows: every token sums to zero
        pos = row_index[:, rank].long()
        valid = pos >= 0
        rows = back.index_select(0, pos.clamp(min=0)).float()
        acc = acc + torch.where(valid.unsqueeze(1), rows, 0.0)
    return acc.to(out_dtype or back.dtype)


def _checked(addends, num_tokens: int, hidden: int) -> tuple[torch.Tensor, ...]:
    if len(addends) > MAX_ADDENDS:
        raise ValueError(f"moe_combine takes at most {MAX_ADDENDS} addends, got {len(addends)}")
    for addend in addends:
        if tuple(addend.shape) != (num_tokens, hidden):
            shape = tuple(addend.shape)
            raise ValueError(f"addend {shape} must be [T, H] = [{num_tokens}, {hidden}]")
    return tuple(addends)


@triton.jit
def _moe_combine_kernel(
    back_ptr, index_ptr, out_ptr, first_ptr, second_ptr, num_tokens, hidden, stride_back,
    stride_out, stride_first, stride_second,
    WORLD: tl.constexpr, NUM_ADDENDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One (token block, hidden block): out = the addends plus the sum over ranks of the gathered
    rows (float32)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_mask = tokens < num_tokens
    col_mask = cols < hidden
    rows64 = tokens.to(tl.int64)[:, None]
    both = token_mask[:, None] & col_mask[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    if NUM_ADDENDS >= 1:
        acc += tl.load(first_ptr + rows64 * stride_first + cols[None, :], mask=both).to(tl.float32)
    if NUM_ADDENDS >= 2:
        acc += tl.load(second_ptr + rows64 * stride_second + cols[None, :], mask=both).to(
            tl.float32
        )
    for rank in tl.static_range(WORLD):
        pos = tl.load(index_ptr + tokens * WORLD + rank, mask=token_mask, other=-1)
        pos = pos.to(tl.int64)
        mask = (pos >= 0)[:, None] & col_mask[None, :]
        rows = tl.load(back_ptr + pos[:, None] * stride_back + cols[None, :], mask=mask, other=0.0)
        acc += rows.to(tl.float32)
    tl.store(out_ptr + rows64 * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=both)  # fmt: skip


def moe_combine(
    back: torch.Tensor,  # [S, H], rows contiguous
    row_index: torch.Tensor,  # [T, world] int32 (see combine_row_index)
    out_dtype: torch.dtype | None = None,
    addends: tuple[torch.Tensor, ...] = (),  # each [T, H], rows contiguous
) -> torch.Tensor:
    """-> [T, H] out_dtype (default back.dtype): per token, the float32 sum of its addends' rows
    and its rows from each rank."""
    if back.dim() != 2 or row_index.dim() != 2:
        raise ValueError(f"back {tuple(back.shape)} must be [S, H], row_index [T, world]")
    if back.shape[1] and back.stride(1) != 1:
        back = back.contiguous()
    index = row_index.to(torch.int32).contiguous()
    num_tokens, world = index.shape
    hidden = back.shape[1]
    addends = tuple(
        a if not hidden or a.stride(1) == 1 else a.contiguous()
        for a in _checked(addends, num_tokens, hidden)
    )
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or back.dtype, device=back.device)
    if num_tokens == 0 or hidden == 0:
        return out
    first, second = (addends + (out, out))[:2]  # unread where absent
    block_t = 4
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    _moe_combine_kernel[grid](
        back, index, out, first, second, num_tokens, hidden, back.stride(0), out.stride(0),
        first.stride(0), second.stride(0),
        WORLD=world, NUM_ADDENDS=len(addends), BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return out
