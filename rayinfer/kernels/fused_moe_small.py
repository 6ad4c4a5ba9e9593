"""Fused MoE for a handful of (token, expert) slots, as in a batch-1 decode: two launches.

The general fused MoE (fused_moe.py) sorts the slots by expert and pads each expert's rows to a
tile: ~10 launches per layer (alignment, chunking, two GEMMs in two row lists, the top-k sum),
which at batch 1 cost more than the weights they read (a decode step there is bound by its kernel
count, see benchmarks/RESULTS.md). With few slots every slot reads its own expert's rows anyway,
so no sorting is needed:

- `_gate_up_kernel`: one program per (slot, block of I): gate and up rows of the slot's expert
  against the token, SiLU(gate) * up -> act [S, I] (x's dtype, as the general path rounds it).
- `_down_kernel`: one program per (token, block of H): each slot's down rows against its act,
  weighted by the router and summed over the token's K slots in float32 -> out [T, H].

Slots whose expert id is outside [0, E) (another rank's expert) add nothing. Weights in x's dtype
only (FP8 experts take the general path). `SMALL_BATCH_MAX_SLOTS` bounds where this pays: past a
few slots per expert the general path reads each expert once for all its tokens.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton

SMALL_BATCH_MAX_SLOTS = 16  # T x K up to this: e.g. batch 1-2 at top-8


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, act_ptr, num_experts, hidden, inter,
    stride_x, stride_we, stride_wn, stride_act,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    expert = tl.load(ids_ptr + slot)
    held = (expert >= 0) & (expert < num_experts)
    rows = w13_ptr + tl.where(held, expert, 0).to(tl.int64) * stride_we
    x_row = x_ptr + (slot // TOP_K) * stride_x
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k_start in range(0, hidden * held.to(tl.int32), BLOCK_K):  # no pass: another rank's
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        xk = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        mask = n_mask[:, None] & k_mask[None, :]
        tile = offs_n[:, None] * stride_wn + offs_k[None, :]
        w_gate = tl.load(rows + tile, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        w_up = tl.load(rows + inter * stride_wn + tile, mask=mask, other=0.0).to(tl.float32)
        gate += tl.sum(w_gate * xk[None, :], 1)
        up += tl.sum(w_up * xk[None, :], 1)
    act = gate * tl.sigmoid(gate) * up  # SiLU(gate) * up, as the general path; 0 off this rank
    tl.store(act_ptr + slot * stride_act + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, num_experts, hidden, inter,
    stride_act, stride_we, stride_wh, stride_out,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        expert = tl.load(ids_ptr + slot)
        held = (expert >= 0) & (expert < num_experts)
        rows = w2_ptr + tl.where(held, expert, 0).to(tl.int64) * stride_we
        partial = tl.zeros([BLOCK_N], tl.float32)
        for i_start in range(0, inter * held.to(tl.int32), BLOCK_K):
            offs_i = i_start + tl.arange(0, BLOCK_K)
            i_mask = offs_i < inter
            a = tl.load(act_ptr + slot * stride_act + offs_i, mask=i_mask, other=0.0)
            mask = n_mask[:, None] & i_mask[None, :]
            w = tl.load(rows + offs_n[:, None] * stride_wh + offs_i[None, :], mask=mask, other=0.0)
            partial += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], 1)
        weight = tl.load(weights_ptr + slot).to(tl.float32)
        acc += tl.where(held, weight, 0.0) * partial
    tl.store(out_ptr + token * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def fits_small_batch(topk_ids: torch.Tensor, w13: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `fused_moe_small_batch` takes this call: few slots, weights in x's dtype."""
    return 0 < topk_ids.numel() <= SMALL_BATCH_MAX_SLOTS and w13.dtype == x.dtype


def fused_moe_small_batch(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows, x.dtype
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int: ids outside [0, E) are experts this rank does not hold
) -> torch.Tensor:  # [T, H] x.dtype
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if w2.shape != (num_experts, hidden, inter) or x.shape != (num_tokens, hidden):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} "
                         "do not fit [T, H], [E, 2I, H], [E, H, I]")  # fmt: skip
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.float().contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)  # [S, I]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    block_n, block_k = 32, 128
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, block_n))](
        x, w13, ids, act, num_experts, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    _down_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        act, w2, ids, weights, out, num_experts, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out
