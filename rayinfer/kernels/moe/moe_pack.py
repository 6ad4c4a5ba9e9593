"""The all-tokens MoE exchange's two row passes, one launch each (rayinfer.comm.moe):

- `pack_for_every_rank`: every token's row (activations, its top-k global expert ids as int32, its
  router weights as float32, zero padding) written once per rank, `world` copies back to back, in
  the byte layout of comm.moe.RowLayout: [world * T, row_bytes] uint8.
- `localize_expert_ids`: on receipt, each slot's global expert id -> this rank's local id, or -1
  (and weight 0) where another rank holds the expert.
- FP8 dispatch: `pack_fp8_for_every_rank` quantizes each token once (one scale per token) and
  writes its e4m3 row for every rank; `unpack_fp8_rows` dequantizes what arrived. Done with torch
  ops these took ~20 launches and float32 copies of the whole batch per exchange.

Row layout, in bytes: payload [0, H * itemsize), ids int32 [ids_at, ids_at + 4K), weights float32
[ids_at + 4K, ids_at + 8K), zeros up to row_bytes (a multiple of 64). Done with torch ops these
took ~15 launches per exchange, which the host pays twice per MoE layer and micro-batch.
"""

from __future__ import annotations

import math

import torch

from rayinfer.kernels.fp8.fp8_quant import FP8_MAX, _round_to_e4m3_grid
from rayinfer.kernels.triton_compat import tl, triton

MIN_AMAX = 1e-12  # an all-zero token gets this magnitude instead of a zero scale


def _unit_stride_and_rows(x: torch.Tensor, world: int, row_bytes: int):
    """(x with unit column stride, the [world * T, row_bytes] uint8 rows a pack kernel fills)."""
    rows = torch.empty(world * x.shape[0], row_bytes, dtype=torch.uint8, device=x.device)
    return (x if x.stride(1) == 1 else x.contiguous()), rows


def _check_layout(hidden: int, itemsize: int, ids_at: int, topk: int, row_bytes: int) -> None:
    if ids_at % 4 or row_bytes % 64 or ids_at < hidden * itemsize or row_bytes < ids_at + 8 * topk:
        raise ValueError(
            f"row layout ids_at={ids_at}, row_bytes={row_bytes} cannot hold {hidden} x "
            f"{itemsize}-byte values and {topk} ids and weights"
        )


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[T, ...] -> [T, bytes per row] uint8 (a copy when t is strided)."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)


def _rows_reference(payload, topk_ids, topk_weights, world, ids_at, row_bytes):
    """payload [T, P] uint8 at bytes [0, P) of each row, then ids and weights at ids_at, zeros
    elsewhere -> [world * T, row_bytes] uint8."""
    num_tokens, topk = topk_ids.shape
    rows = torch.zeros(num_tokens, row_bytes, dtype=torch.uint8, device=payload.device)
    rows[:, : payload.shape[1]] = payload
    rows[:, ids_at : ids_at + 4 * topk] = _as_bytes(topk_ids.to(torch.int32))
    rows[:, ids_at + 4 * topk : ids_at + 8 * topk] = _as_bytes(topk_weights.float())
    return rows.repeat(world, 1)


def pack_for_every_rank_reference(x, topk_ids, topk_weights, world, ids_at, row_bytes):
    """x [T, H], topk_ids [T, K] int, topk_weights [T, K] -> [world * T, row_bytes] uint8."""
    _check_layout(x.shape[1], x.element_size(), ids_at, topk_ids.shape[1], row_bytes)
    return _rows_reference(_as_bytes(x), topk_ids, topk_weights, world, ids_at, row_bytes)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (values [T, H] float8_e4m3fn, scales [T] float32): one scale per token, its
    largest magnitude mapped to FP8_MAX (the FP8 dispatch payload; error bound in comm/fp8.py)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_min(MIN_AMAX)  # [T, 1]
    scales = amax / FP8_MAX
    values = (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scales.squeeze(1)


def pack_fp8_for_every_rank_reference(x, topk_ids, topk_weights, world, scale_at, ids_at,
                                      row_bytes):  # fmt: skip
    """x [T, H] -> [world * T, row_bytes] uint8: e4m3 values at [0, H), the token's float32
    scale at scale_at, then ids and weights at ids_at (comm.moe.RowLayout with use_fp8)."""
    _check_fp8_layout(x.shape[1], scale_at, ids_at, topk_ids.shape[1], row_bytes)
    values, scales = quantize_rows_reference(x)
    payload = torch.zeros(x.shape[0], ids_at, dtype=torch.uint8, device=x.device)
    payload[:, : x.shape[1]] = values.view(torch.uint8)
    payload[:, scale_at : scale_at + 4] = _as_bytes(scales.unsqueeze(1))
    return _rows_reference(payload, topk_ids, topk_weights, world, ids_at, row_bytes)


def _check_fp8_layout(hidden, scale_at, ids_at, topk, row_bytes) -> None:
    if scale_at < hidden or scale_at % 4 or ids_at < scale_at + 4:
        raise ValueError(f"FP8 row layout: scale_at={scale_at} must be a multiple of 4 at or "
                         f"past the {hidden} values, and ids_at={ids_at} past it")  # fmt: skip
    _check_layout(hidden, 1, ids_at, topk, row_bytes)


@triton.jit
def _pack_fp8_kernel(
    x_ptr, ids_ptr, weights_ptr, payload_ptr, words_ptr, num_tokens, hidden, stride_x,
    payload_stride, words_stride, scale_word, ids_word, pad_words,
    WORLD: tl.constexpr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_PAD: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):  # fmt: skip
    """One program per token: its scale from the whole row, its e4m3 values, scale, ids,
    weights and padding, written into each rank's copy."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + token * stride_x + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), MIN_AMAX) / FP8_MAX
    values = _round_to_e4m3_grid(tl.clamp(x / scale, -FP8_MAX, FP8_MAX))
    values = values.to(payload_ptr.dtype.element_ty)
    slots = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + token * TOPK + slots, mask=slots < TOPK, other=0).to(tl.int32)
    weights = tl.load(weights_ptr + token * TOPK + slots, mask=slots < TOPK, other=0.0)
    pad = tl.arange(0, BLOCK_PAD)
    for rank in tl.static_range(WORLD):
        row = rank * num_tokens + token
        tl.store(payload_ptr + row * payload_stride + cols, values, mask=cols < hidden)
        words = words_ptr + row * words_stride
        tl.store(words + scale_word, scale.to(tl.int32, bitcast=True))
        tl.store(words + ids_word + slots, ids, mask=slots < TOPK)
        tl.store(words + ids_word + TOPK + slots, weights.to(tl.float32).to(tl.int32, bitcast=True),
                 mask=slots < TOPK)  # fmt: skip
        tl.store(words + ids_word + 2 * TOPK + pad, tl.zeros((BLOCK_PAD,), dtype=tl.int32),
                 mask=pad < pad_words)  # fmt: skip


def pack_fp8_for_every_rank(
    x: torch.Tensor,  # [T, H] bf16/fp16/fp32
    topk_ids: torch.Tensor,  # [T, K] int: global expert ids
    topk_weights: torch.Tensor,  # [T, K] float
    world: int,
    scale_at: int,  # byte offset of the float32 scale (past the H e4m3 values)
    ids_at: int,
    row_bytes: int,
) -> torch.Tensor:  # [world * T, row_bytes] uint8
    """Quantize each token once (per-token scale) and write its row for every rank, one launch.
    Bytes between the values and the scale are left unwritten (never read)."""
    num_tokens, topk = topk_ids.shape
    hidden = x.shape[1]
    _check_fp8_layout(hidden, scale_at, ids_at, topk, row_bytes)
    x, rows = _unit_stride_and_rows(x, world, row_bytes)
    if num_tokens == 0:
        return rows
    payload, words = rows.view(torch.float8_e4m3fn), rows.view(torch.int32)
    pad_words = (row_bytes - ids_at) // 4 - 2 * topk
    block_h = triton.next_power_of_2(hidden)
    _pack_fp8_kernel[(num_tokens,)](
        x, topk_ids.contiguous(), topk_weights.contiguous(), payload, words, num_tokens, hidden,
        x.stride(0), payload.stride(0), words.stride(0), scale_at // 4, ids_at // 4, pad_words,
        WORLD=world, TOPK=topk, BLOCK_H=block_h, BLOCK_K=triton.next_power_of_2(topk),
        BLOCK_PAD=triton.next_power_of_2(max(pad_words, 1)), FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
        num_warps=4 if block_h <= 2048 else 8,
    )  # fmt: skip
    return rows


def unpack_fp8_rows_reference(rows, hidden: int, scale_at: int, dtype) -> torch.Tensor:
    """rows [R, row_bytes] uint8 -> [R, H] dtype: the e4m3 values times their row's scale."""
    values = rows[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    scales = rows[:, scale_at : scale_at + 4].contiguous().view(torch.float32)  # [R, 1]
    return (values.float() * scales).to(dtype)


@triton.jit
def _unpack_fp8_kernel(
    payload_ptr, words_ptr, out_ptr, num_rows, hidden, payload_stride, words_stride, out_stride,
    scale_word, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols < hidden)[None, :]
    rows = rows.to(tl.int64)
    scales = tl.load(words_ptr + rows * words_stride + scale_word, mask=row_mask, other=0)
    scales = scales.to(tl.float32, bitcast=True)
    values = tl.load(payload_ptr + rows[:, None] * payload_stride + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)  # fmt: skip
    out = (values * scales[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out, mask=mask)


def unpack_fp8_rows(rows: torch.Tensor, hidden: int, scale_at: int, dtype) -> torch.Tensor:
    """rows [R, row_bytes] uint8 (FP8 dispatch rows as they arrived) -> [R, H] dtype."""
    num_rows = rows.shape[0]
    out = torch.empty(num_rows, hidden, dtype=dtype, device=rows.device)
    if num_rows == 0:
        return out
    payload, words = rows.view(torch.float8_e4m3fn), rows.view(torch.int32)
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_rows, 8), triton.cdiv(hidden, block_h))
    _unpack_fp8_kernel[grid](
        payload, words, out, num_rows, hidden, payload.stride(0), words.stride(0), out.stride(0),
        scale_at // 4, BLOCK_R=8, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _pack_kernel(
    x_ptr, ids_ptr, weights_ptr, payload_ptr, words_ptr, num_tokens, hidden, stride_x,
    payload_stride, words_stride, ids_word, pad_words,
    TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
):  # fmt: skip
    """Program (token block, hidden block, rank): that block of the payload; the hidden block 0
    programs also write the ids, weights and padding words of their rows."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = (tl.program_id(2) * num_tokens + tokens).to(tl.int64)  # rank r's copy
    token_mask = tokens < num_tokens
    mask = token_mask[:, None] & (cols < hidden)[None, :]
    values = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask)
    tl.store(payload_ptr + rows[:, None] * payload_stride + cols[None, :], values, mask=mask)
    if tl.program_id(1) == 0:
        slots = tl.arange(0, BLOCK_K)
        slot_mask = token_mask[:, None] & (slots < TOPK)[None, :]
        offs = tokens.to(tl.int64)[:, None] * TOPK + slots[None, :]
        ids = tl.load(ids_ptr + offs, mask=slot_mask, other=0).to(tl.int32)
        weights = tl.load(weights_ptr + offs, mask=slot_mask, other=0.0).to(tl.float32)
        words = words_ptr + rows[:, None] * words_stride + ids_word + slots[None, :]
        tl.store(words, ids, mask=slot_mask)
        tl.store(words + TOPK, weights.to(tl.int32, bitcast=True), mask=slot_mask)
        pad = tl.arange(0, BLOCK_PAD)
        pad_mask = token_mask[:, None] & (pad < pad_words)[None, :]
        pad_at = words_ptr + rows[:, None] * words_stride + ids_word + 2 * TOPK + pad[None, :]
        tl.store(pad_at, tl.zeros((BLOCK_T, BLOCK_PAD), dtype=tl.int32), mask=pad_mask)


def pack_for_every_rank(
    x: torch.Tensor,  # [T, H] bf16/fp16/fp32
    topk_ids: torch.Tensor,  # [T, K] int: global expert ids
    topk_weights: torch.Tensor,  # [T, K] float
    world: int,
    ids_at: int,  # byte offset of the ids in a row
    row_bytes: int,
) -> torch.Tensor:  # [world * T, row_bytes] uint8
    num_tokens, topk = topk_ids.shape
    hidden, itemsize = x.shape[1], x.element_size()
    _check_layout(hidden, itemsize, ids_at, topk, row_bytes)
    x, rows = _unit_stride_and_rows(x, world, row_bytes)
    if num_tokens == 0:
        return rows
    payload, words = rows.view(x.dtype), rows.view(torch.int32)  # same bytes, typed views
    pad_words = (row_bytes - ids_at) // 4 - 2 * topk
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, 4), triton.cdiv(hidden, block_h), world)
    _pack_kernel[grid](
        x, topk_ids.contiguous(), topk_weights.contiguous(), payload, words, num_tokens, hidden,
        x.stride(0), payload.stride(0), words.stride(0), ids_at // 4, pad_words,
        TOPK=topk, BLOCK_T=4, BLOCK_H=block_h, BLOCK_K=triton.next_power_of_2(topk),
        BLOCK_PAD=triton.next_power_of_2(max(pad_words, 1)), num_warps=4,
    )  # fmt: skip
    return rows


def localize_expert_ids_reference(rows, ids_at, topk, first_expert, num_local):
    """rows [R, row_bytes] uint8 -> (local ids [R, K] int64, -1 where not held here;
    weights [R, K] float32, 0 where not held)."""
    words = rows[:, ids_at : ids_at + 8 * topk].contiguous().view(torch.int32)  # [R, 2K]
    local = words[:, :topk].long() - first_expert
    weights = words[:, topk:].view(torch.float32)
    held = (local >= 0) & (local < num_local)
    return torch.where(held, local, -1), torch.where(held, weights, 0.0)


@triton.jit
def _localize_kernel(
    words_ptr, ids_out_ptr, weights_out_ptr, num_rows, words_stride, ids_word, first_expert,
    num_local, TOPK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    slots = tl.arange(0, BLOCK_K)
    mask = (rows < num_rows)[:, None] & (slots < TOPK)[None, :]
    at = words_ptr + rows.to(tl.int64)[:, None] * words_stride + ids_word + slots[None, :]
    local = tl.load(at, mask=mask, other=0) - first_expert
    weights = tl.load(at + TOPK, mask=mask, other=0).to(tl.float32, bitcast=True)
    held = (local >= 0) & (local < num_local)
    out = rows.to(tl.int64)[:, None] * TOPK + slots[None, :]
    tl.store(ids_out_ptr + out, tl.where(held, local, -1).to(tl.int64), mask=mask)
    tl.store(weights_out_ptr + out, tl.where(held, weights, 0.0), mask=mask)


def localize_expert_ids(
    rows: torch.Tensor,  # [R, row_bytes] uint8 as they arrived
    ids_at: int,
    topk: int,
    first_expert: int,  # this rank's first global expert id
    num_local: int,  # experts held here
) -> tuple[torch.Tensor, torch.Tensor]:  # [R, K] int64, [R, K] float32
    num_rows = rows.shape[0]
    if ids_at % 4 or rows.shape[1] < ids_at + 8 * topk:
        raise ValueError(f"rows of {rows.shape[1]} bytes cannot hold {topk} ids and weights "
                         f"at byte {ids_at} (a multiple of 4)")  # fmt: skip
    local = torch.empty(num_rows, topk, dtype=torch.int64, device=rows.device)
    weights = torch.empty(num_rows, topk, dtype=torch.float32, device=rows.device)
    if num_rows == 0:
        return local, weights
    words = rows.view(torch.int32)
    _localize_kernel[(triton.cdiv(num_rows, 64),)](
        words, local, weights, num_rows, words.stride(0), ids_at // 4, first_expert, num_local,
        TOPK=topk, BLOCK_R=64, BLOCK_K=triton.next_power_of_2(topk), num_warps=4,
    )  # fmt: skip
    return local, weights
