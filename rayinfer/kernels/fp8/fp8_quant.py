"""Activation quantization for W8A8 FP8 GEMMs: one float32 scale per token per group of channels.

DeepSeek-V3 quantizes activations per token and per 128 channels (matching its 128x128 weight
blocks): each group's max magnitude maps to 448, the float8_e4m3fn maximum, and `x ~= q * scale`.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1e-10  # an all-zero group gets this scale instead of dividing by zero


@triton.jit
def _round_to_e4m3_grid(x):
    """Round float32 onto e4m3's grid, to nearest even, so the fp8 cast below is exact.

    The Triton interpreter's fp8 cast drops the carry into the exponent (124.3 -> 64, not 128);
    rounding here first makes CPU and GPU agree with torch. Normal values keep 3 mantissa bits
    (a few integer ops); below 2^-6 e4m3 is subnormal, a fixed step of 2^-9, which adding and
    taking away 1.5 * 2^14 rounds to (float32's step there is 2^-9).
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _fp8_quant_kernel(
    x_ptr, q_ptr, scale_ptr,
    num_rows, num_cols,
    stride_xm, stride_qm, stride_sm, stride_sg,
    GROUP_SIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):  # fmt: skip
    """One program per BLOCK_ROWS rows x one group of GROUP_SIZE channels: [R, G] in, each row's
    scale out."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    in_rows = rows < num_rows
    mask = in_rows[:, None] & (cols[None, :] < num_cols)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / FP8_MAX, MIN_SCALE)  # [R]
    q = _round_to_e4m3_grid(tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip
    tl.store(scale_ptr + rows * stride_sm + group * stride_sg, scale, mask=in_rows)


def fp8_quant(
    x: torch.Tensor, group_size: int = 128, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] float8_e4m3fn, [M, ceil(K / group)] float32)
    """x [M, K] (rows contiguous) -> (q, scale) with x[m, k] ~= q[m, k] * scale[m, k // group].

    column_major_scales stores scale transposed (strides (1, M)), so a GEMM tile reads the
    scales of its rows for one K group in one coalesced load.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got {tuple(x.shape)} {x.stride()}")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size} must be a power of two >= 16")
    num_rows, num_cols = x.shape
    num_groups = triton.cdiv(num_cols, group_size)
    q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale_shape = (num_groups, num_rows) if column_major_scales else (num_rows, num_groups)
    scale = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    scale = scale.t() if column_major_scales else scale  # [M, G]
    if num_rows == 0:
        return q, scale
    # 16 rows a program (4 KiB of bf16 loads each): a program per row and group spends the GPU
    # on scheduling programs, not moving bytes (393k single-warp programs for a 24,576 x 2,048
    # MoE act, 4x slower: benchmarks/RESULTS.md, kernels, `fp8_quant`).
    block_rows = min(16, triton.next_power_of_2(num_rows))
    _fp8_quant_kernel[(triton.cdiv(num_rows, block_rows), num_groups)](
        x, q, scale, num_rows, num_cols, x.stride(0), q.stride(0), *scale.stride(),
        GROUP_SIZE=group_size, BLOCK_ROWS=block_rows, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        num_warps=4,
    )  # fmt: skip
    return q, scale


def fp8_quant_reference(
    x: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] float8_e4m3fn, [M, ceil(K / group)] float32)
    num_rows, num_cols = x.shape
    num_groups = -(-num_cols // group_size)
    padded = torch.zeros(num_rows, num_groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :num_cols] = x.float()
    groups = padded.view(num_rows, num_groups, group_size)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, G]
    q = (
        (groups / scale[..., None])
        .clamp(-FP8_MAX, FP8_MAX)
        .reshape(num_rows, num_groups * group_size)[:, :num_cols]
    )
    return q.to(torch.float8_e4m3fn), scale


def fp8_dequant_reference(
    q: torch.Tensor,  # [M, K] float8_e4m3fn
    scale: torch.Tensor,  # [M, ceil(K / group)] float32
    group_size: int = 128,
) -> torch.Tensor:  # [M, K] float32
    expanded = scale.repeat_interleave(group_size, dim=1)[:, : q.shape[1]]
    return q.float() * expanded
