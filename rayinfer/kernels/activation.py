"""SiLU-and-multiply: the gated activation of SwiGLU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels.triton_compat import tl, triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr
):
    """Row `program_id(0)`, columns of block `program_id(1)`: silu(gate) * up."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    # The reference computes silu in x's dtype (rounded) and multiplies in x's dtype.
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate then up) -> [..., I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dim {x.shape[-1]} must be even: gate and up halves")
    intermediate = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], intermediate, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(intermediate))
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(intermediate, block))
        _silu_and_mul_kernel[grid](
            rows, out, rows.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block
        )
    return out.view(*x.shape[:-1], intermediate)
