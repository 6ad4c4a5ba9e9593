"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton


def rms_norm_reference(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]: added to x first, returned updated
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * out.to(dtype)
    return out if residual is None else (out, residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One row: (x + residual) -> residual_out; its RMS-normed, weighted copy -> out."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
    # The reference rounds the normed row to x's dtype before the weight multiply.
    normed = (x32 * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H]: added to x first, returned updated
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} must be [{hidden}] like x's last dim")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    weight = weight.contiguous()  # read as one dense row
    rows = x.reshape(-1, hidden)  # [N, H]: a view unless x is not row-contiguous
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    # x + residual in their promoted dtype (an fp16 x and an fp32 residual sum in fp32), as
    # the reference does; the normed row rounds to that dtype before the weight multiply.
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(
        rows.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device
    )
    residual_rows = residual.reshape(-1, hidden).contiguous() if residual is not None else rows
    residual_out = (
        rows if residual is None else torch.empty(rows.shape, dtype=sum_dtype, device=x.device)
    )
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight, out, residual_out, eps,
            rows.stride(0), residual_rows.stride(0), out.stride(0), residual_out.stride(0),
            HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
            num_warps=4 if hidden <= 4096 else 8,
        )  # fmt: skip
    out = out.view(x.shape)
    return out if residual is None else (out, residual_out.view(x.shape))
