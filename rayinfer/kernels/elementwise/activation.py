"""SiLU-and-multiply: the gated activation of SwiGLU MLPs.

With `limit` (DeepSeek-V4's `swiglu_limit`), gate and up are clamped first, as transformers'
DeepseekV4MLP and DeepseekV4Experts._apply_gate do: silu(min(gate, limit)) * clamp(up, -limit,
limit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayinfer.kernels.triton_compat import tl, triton


def silu_and_mul_reference(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[T, 2I] (gate then up) -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@triton.jit
def clamp_gate_up(gate, up, USE_LIMIT: tl.constexpr, LIMIT: tl.constexpr):
    """(min(gate, LIMIT), clamp(up, -LIMIT, LIMIT)) with USE_LIMIT; (gate, up) otherwise."""
    if USE_LIMIT:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return gate, up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr,
    USE_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """Row `program_id(0)`, columns of block `program_id(1)`: silu(gate) * up."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0)
    gate32, up32 = clamp_gate_up(gate.to(tl.float32), up.to(tl.float32), USE_LIMIT, LIMIT)
    # The reference clamps, computes silu in x's dtype (rounded) and multiplies in x's dtype.
    gate32 = gate32.to(gate.dtype).to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = silu.to(tl.float32) * up32.to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[..., 2I] (gate then up) -> [..., I]; limit: clamp gate above and up both ways first."""
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
            rows, out, rows.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block,
            USE_LIMIT=limit is not None, LIMIT=float(limit or 0.0),
        )  # fmt: skip
    return out.view(*x.shape[:-1], intermediate)
