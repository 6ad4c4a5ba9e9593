"""The Triton kernel of fused_moe_mxfp4: one grouped GEMM over expert row tiles whose weights are
MXFP4 (e2m1 values two per byte, low nibble first, and one UE8M0 exponent byte per 32 values
along K), dequantized in registers by `tl.dot_scaled`.

`tl.dot_scaled(x, None, "bf16", w, scale, "e2m1")` is native on Blackwell and emulated
elsewhere: the packed tile is copied to shared memory asynchronously (cp.async, pipelined like
any dot operand), then upcast to bf16 in registers and multiplied by its scales (exact: powers
of two). On Hopper the compiler swaps the product so that the upcast weights are wgmma's
register operand and the activations its shared one (benchmarks/compile_moe_kernels.py shows
the loop). No bf16 copy of an expert is ever written.
"""

from __future__ import annotations

from rayinfer.kernels.activation import clamp_gate_up
from rayinfer.kernels.tile_order import grouped_tile_ids
from rayinfer.kernels.triton_compat import tl, triton

MXFP4_GROUP = 32  # values per UE8M0 scale along K


@triton.jit
def _dot_mxfp4(acc, a, w_ptrs, s_ptrs, k_step, k_in, s_in, FORMAT: tl.constexpr,
               EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc [BM, BN] += a [BM, BK] @ dequant(w [BK/2, BN] packed, scales [BN, BK/32])."""
    byte_step = k_step * (BLOCK_K // 2)
    scale_step = k_step * (BLOCK_K // 32)
    if EVEN_K:
        w = tl.load(w_ptrs + byte_step)
        scale = tl.load(s_ptrs + scale_step)
    else:  # masked K groups add zeros: x is 0 there, and e2m1 0 times any scale is 0
        w = tl.load(w_ptrs + byte_step, mask=k_in[:, None], other=0)
        scale = tl.load(s_ptrs + scale_step, mask=s_in[None, :], other=127)
    return tl.dot_scaled(a, None, FORMAT, w, scale, "e2m1", acc)


@triton.jit
def _moe_mxfp4_gemm_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K, num_slots, up_offset, num_blocks_m,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    SLOTS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    FORMAT: tl.constexpr, EVEN_K: tl.constexpr, USE_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """c[slot, n] for one tile of sorted slots (one expert) and one tile of output columns.

    w [E, N_total, K/2] uint8 and s [E, N_total, K/32] uint8 (UE8M0) are the expert weights.
    A row of a is slot // SLOTS_PER_A_ROW (x for gate+up, the slot's own act row for down).
    With FUSE_SILU, weight rows n and up_offset + n make silu(gate) * up (USE_LIMIT: gate
    clamped above and up both ways at LIMIT first); with MUL_WEIGHT the slot's router weight
    scales its row.
    """
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slots = tl.load(sorted_slot_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    is_real = slots < num_slots
    a_rows = (slots // SLOTS_PER_A_ROW).to(tl.int64)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrapped: no row masks
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    offs_group = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    rows = offs_n.to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + rows[None, :] * stride_wn + offs_byte[:, None]
    s_ptrs = s_ptr + expert * stride_se + rows[:, None] * stride_sn + offs_group[None, :]
    up_w = up_offset * stride_wn
    up_s = up_offset * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k_step * BLOCK_K
        k_in = offs_byte < k_left // 2
        s_in = offs_group < k_left // 32
        if EVEN_K:
            a = tl.load(a_ptrs, mask=is_real[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=is_real[:, None] & (offs_k < k_left)[None, :], other=0.0)
        acc = _dot_mxfp4(acc, a, w_ptrs, s_ptrs, k_step, k_in, s_in, FORMAT, EVEN_K, BLOCK_K)
        if FUSE_SILU:
            acc_up = _dot_mxfp4(acc_up, a, w_ptrs + up_w, s_ptrs + up_s, k_step, k_in, s_in,
                                FORMAT, EVEN_K, BLOCK_K)  # fmt: skip
        a_ptrs += BLOCK_K
    if FUSE_SILU:
        acc, acc_up = clamp_gate_up(acc, acc_up, USE_LIMIT, LIMIT)
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + slots, mask=is_real, other=0.0)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=is_real[:, None] & (cols[None, :] < N))
