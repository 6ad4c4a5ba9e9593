"""Fused MoE for a handful of (token, expert) slots, as in a batch-1 decode: two launches.

The general fused MoE (fused_moe.py) sorts the slots by expert and pads each expert's rows to a
tile: ~10 launches per layer (alignment, chunking, two GEMMs in two row lists, the top-k sum),
which at batch 1 cost more than the weights they read (a decode step there is bound by its kernel
count, see benchmarks/RESULTS.md). With few slots every slot reads its own expert's rows anyway,
so no sorting is needed:

- `_gate_up_kernel`: one program per (slot, block of I): gate and up rows of the slot's expert
  against the token, SiLU(gate) * up -> act [S, I] (x's dtype, as the general path rounds it).
- `_down_kernel`: one program per (token, block of H), one flat loop over the token's K slots'
  down rows against their act, weighted by the router and summed in float32 -> out [T, H].

Slots whose expert id is outside [0, E) (another rank's expert) add nothing. Weights in x's dtype
only (FP8 experts take the general path). `SMALL_BATCH_MAX_SLOTS` bounds where this pays: past a
few slots per expert the general path reads each expert once for all its tokens.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.elementwise.activation import clamp_gate_up
from rayinfer.kernels.tile_configs import pick_tile_config, tile_entry_names
from rayinfer.kernels.triton_compat import tl, triton

SMALL_BATCH_MAX_SLOTS = 16  # T x K up to this: e.g. batch 1-2 at top-8
MAX_TOP_K = 16  # the down kernel keeps one dot column per slot of a token


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, act_ptr, num_experts, hidden, inter,
    stride_x, stride_we, stride_wn, stride_act,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """One (slot, block of I): act[slot, block] = SiLU(gate) * up of the slot's token (with
    USE_LIMIT, gate clamped above and up both ways at LIMIT first).

    The matrix-vector products run as dots against [BLOCK_K, 16] tiles whose column 0 is the
    token (the others zero): a dot's operands are what Triton's pipeliner streams
    asynchronously, several weight tiles ahead, where plain loads would wait one by one."""
    slot = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    expert = tl.load(ids_ptr + slot)
    held = (expert >= 0) & (expert < num_experts)
    rows = w13_ptr + tl.where(held, expert, 0).to(tl.int64) * stride_we
    x_row = x_ptr + (slot // TOP_K) * stride_x
    column = tl.arange(0, 16)
    gate = tl.zeros([BLOCK_N, 16], tl.float32)
    up = tl.zeros([BLOCK_N, 16], tl.float32)
    for k_start in range(0, hidden * held.to(tl.int32), BLOCK_K):  # no pass: another rank's
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        xk = tl.load(x_row + offs_k[:, None] + column[None, :] * 0,
                     mask=k_mask[:, None] & (column[None, :] == 0), other=0.0)  # fmt: skip
        mask = n_mask[:, None] & k_mask[None, :]
        tile = offs_n[:, None] * stride_wn + offs_k[None, :]
        w_gate = tl.load(rows + tile, mask=mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        w_up = tl.load(rows + inter * stride_wn + tile, mask=mask, other=0.0)
        gate = tl.dot(w_gate, xk, gate, input_precision=DOT_PRECISION)
        up = tl.dot(w_up, xk, up, input_precision=DOT_PRECISION)
    gate_n, up_n = tl.sum(gate, 1), tl.sum(up, 1)  # column 0 (the others are zero)
    gate_n, up_n = clamp_gate_up(gate_n, up_n, USE_LIMIT, LIMIT)
    act = gate_n * tl.sigmoid(gate_n) * up_n  # SiLU(gate) * up as the general path; 0 elsewhere
    tl.store(act_ptr + slot * stride_act + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, num_experts, hidden, inter,
    stride_act, stride_we, stride_wh, stride_out,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (token, block of H): sum over the token's K slots of router weight times
    w2[expert][block] @ act[slot], in float32.

    One flat loop over (slot, block of I), a single pipelined stream of weight tiles (a loop
    per slot would restart the pipeline K times). Slot k's act goes in column k of the dot's
    [BLOCK_K, 16] right-hand tile, so each slot accumulates in its own column, and the router
    weights apply once at the end, in float32. A slot off this rank loads nothing."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    column = tl.arange(0, 16)
    tiles_per_slot = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)  # column k: slot k's partial product
    for step in range(0, TOP_K * tiles_per_slot):
        k = step // tiles_per_slot
        slot = token * TOP_K + k
        offs_i = (step % tiles_per_slot) * BLOCK_K + tl.arange(0, BLOCK_K)
        expert = tl.load(ids_ptr + slot)
        held = (expert >= 0) & (expert < num_experts)
        i_mask = offs_i < tl.where(held, inter, 0)  # nothing loaded for another rank's expert
        a = tl.load(act_ptr + slot * stride_act + offs_i[:, None] + column[None, :] * 0,
                    mask=i_mask[:, None] & (column[None, :] == k), other=0.0)  # fmt: skip
        rows = w2_ptr + tl.where(held, expert, 0).to(tl.int64) * stride_we
        w = tl.load(rows + offs_n[:, None] * stride_wh + offs_i[None, :],
                    mask=n_mask[:, None] & i_mask[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)
    slots = token * TOP_K + column
    in_top_k = column < TOP_K
    experts = tl.load(ids_ptr + slots, mask=in_top_k, other=-1)
    held = in_top_k & (experts >= 0) & (experts < num_experts)
    weights = tl.load(weights_ptr + slots, mask=held, other=0.0).to(tl.float32)  # [16]
    out = tl.sum(acc * weights[None, :], 1)
    tl.store(out_ptr + token * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def fits_small_batch(topk_ids: torch.Tensor, w13: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `fused_moe_small_batch` takes this call: few slots, weights in x's dtype."""
    fits = 0 < topk_ids.numel() <= SMALL_BATCH_MAX_SLOTS and topk_ids.shape[-1] <= MAX_TOP_K
    return fits and w13.dtype == x.dtype


def fused_moe_small_batch(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows, x.dtype
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int: ids outside [0, E) are experts this rank does not hold
    params: dict | None = None,  # tile override (sweeps, tests); else configs/fused_moe_small.json
    *,
    swiglu_limit: float | None = None,  # DeepSeek-V4: silu(min(gate, l)) * clamp(up, -l, l)
) -> torch.Tensor:  # [T, H] x.dtype
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if top_k > MAX_TOP_K:
        raise ValueError(f"top_k={top_k}: the small-batch kernels take at most {MAX_TOP_K}")
    if w2.shape != (num_experts, hidden, inter) or x.shape != (num_tokens, hidden):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} "
                         "do not fit [T, H], [E, 2I, H], [E, H, I]")  # fmt: skip
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.float().contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)  # [S, I]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    tiles = {**small_batch_tiles(x.device, hidden, inter), **(params or {})}
    up, down = tiles["gate_up"], tiles["down"]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 exact; 16-bit: unused
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13, ids, act, num_experts, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"], DOT_PRECISION=precision,
        USE_LIMIT=swiglu_limit is not None, LIMIT=float(swiglu_limit or 0.0),
        num_warps=up["num_warps"], num_stages=up["num_stages"],
    )  # fmt: skip
    _down_kernel[(num_tokens, triton.cdiv(hidden, down["BLOCK_N"]))](
        act, w2, ids, weights, out, num_experts, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"], DOT_PRECISION=precision,
        num_warps=down["num_warps"], num_stages=down["num_stages"],
    )  # fmt: skip
    return out


# Weight rows are read as [BLOCK_N, BLOCK_K] tiles; small BLOCK_N gives many programs (a batch-1
# layer has few slots), BLOCK_K long contiguous row segments.

_DEFAULT_TILES = {
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
    "down": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
}


def small_batch_tiles(device: torch.device, hidden: int, inter: int) -> dict:
    """{"gate_up": tiles, "down": tiles} for this GPU and expert shape, from
    configs/fused_moe_small.json ("H=..,I=.." keys, else "default"), else the defaults."""
    entries = tile_entry_names(device)
    found = pick_tile_config("fused_moe_small", entries, f"H={hidden},I={inter}", 1)
    return found or _DEFAULT_TILES
