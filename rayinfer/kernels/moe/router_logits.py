"""MoE router logits in float32 from 16-bit activations, on the tensor cores.

DeepSeek and Qwen3-MoE route on `x.float() @ W.T` with a float32 router weight W [E, H]. Done
as torch does it, that is a conversion of the whole [T, H] activation to float32 (a read and a
write twice its size) and a float32 GEMM on the CUDA cores: ~0.2 ms per layer at 16k tokens of
V2-Lite on an H200, two launches.

Here one kernel reads x in its own dtype and W in float32, and splits each W tile in registers
into three pieces of x's dtype, W = W1 + W2 + W3 (each the rounding of what the previous ones
left): 24 bits of mantissa in all for bf16, so the pieces hold W exactly (fp16's small exponent
range leaves ~1e-6 of W's magnitude out: its third piece is subnormal). Every product of x with
a piece is exact in float32 (8 or 11 bits times 8 or 11). The tensor cores add the products of
one K tile (64) in float32 but truncating; the tiles are added in registers (rounding).
"""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton

BLOCK_M = 64
BLOCK_K = 64
# Below this the torch path wins (H200, bf16): its conversion is small and its GEMM spreads
# better (V2-Lite, 256 tokens: 20 us against 42; 4,096: 67 against 42; V3 4,096: 389 against 214).
MIN_TOKENS = 2048


@triton.jit
def _split_dot(x, w, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """x [BM, BK] @ w [BK, BE] (float32) as three exact products of x's dtype, summed by the
    tensor cores into a fresh float32 tile: they truncate as they add, so a whole row's sum there
    drifted by 2e-5 of the largest logit at H 7,168 (H200); the caller adds the tiles."""
    first = w.to(DTYPE)
    rest = w - first.to(tl.float32)
    second = rest.to(DTYPE)
    third = (rest - second.to(tl.float32)).to(DTYPE)
    part = tl.dot(x, first, tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32))
    part = tl.dot(x, second, part)
    return tl.dot(x, third, part)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for any count (kernel_compiles.py)
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr, num_tokens, hidden, num_experts,
    stride_x, stride_w, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out [BM, BE] of one token tile and one expert tile: sum over K of x . W^T."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    cols = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]  # [BM, BK]
    w_ptrs = w_ptr + experts[None, :] * stride_w + cols[:, None]  # [BK, BE]: W^T
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        in_k = cols < hidden - k * BLOCK_K
        x = tl.load(x_ptrs, mask=(rows < num_tokens)[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=in_k[:, None] & (experts < num_experts)[None, :], other=0.0)
        acc += _split_dot(x, w, x_ptr.dtype.element_ty, BLOCK_M, BLOCK_E)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + experts[None, :]
    tl.store(out_ptrs, acc, mask=(rows < num_tokens)[:, None] & (experts < num_experts)[None, :])


def router_logits(
    x: torch.Tensor,  # [T, H] bfloat16 or float16
    weight: torch.Tensor,  # [E, H] float32
) -> torch.Tensor:  # [T, E] float32
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} [T, H] and weight {tuple(weight.shape)} [E, H]")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != torch.float32:
        raise ValueError(f"x must be bf16/fp16 and weight float32, got {x.dtype}, {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous rows")
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    out = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_e = min(128, max(16, triton.next_power_of_2(num_experts)))
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(num_experts, block_e))
    _router_logits_kernel[grid](
        x, weight, out, num_tokens, hidden, num_experts,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_E=block_e, BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip
    return out


def router_logits_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, H] @ [E, H]^T in float32: what transformers' DeepSeek and Qwen3-MoE gates compute."""
    return torch.nn.functional.linear(x.float(), weight.float())


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether router_logits serves x: 16-bit activations of at least MIN_TOKENS rows."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and x.shape[0] >= MIN_TOKENS
