"""The Triton kernels of fused_moe_mxfp4: grouped GEMMs over expert row tiles whose weights are
MXFP4 (e2m1 values two per byte, low nibble first, and one UE8M0 exponent byte per 32 values
along K), dequantized in registers by `tl.dot_scaled`.

`tl.dot_scaled(x, None, "bf16", w, scale, "e2m1")` is native on Blackwell and emulated
elsewhere: the packed tile is copied to shared memory asynchronously (cp.async, pipelined like
any dot operand), then upcast to bf16 in registers and multiplied by its scales (exact: powers
of two). On Hopper the compiler swaps the product so that the upcast weights are wgmma's
register operand and the activations its shared one (benchmarks/compile_moe_kernels.py shows
the loop). No bf16 copy of an expert is ever written. The split kernel below is the other form
(and the faster one on an H200).
"""

from __future__ import annotations

from rayinfer.kernels.elementwise.activation import clamp_gate_up
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


# --- the split kernel: even and odd K values as two dots, no nibble interleave ----------------
# x @ w^T = x[:, 0::2] @ lo^T + x[:, 1::2] @ hi^T, where lo/hi are the low/high nibbles of the
# packed bytes. The activations come de-interleaved ([evens | odds] along K: x by a copy before
# the call, act by the gate+up program writing its columns in that order), so each K step loads
# one byte tile, dequantizes its two nibbles elementwise, and multiplies two contiguous halves.
# The upcast weights are the dot's left operand (wgmma's register operand on Hopper).

# 4 packed bytes and their 4 bf16 scales -> bf16x2 pairs of the low nibbles (bytes 0-1, 2-3)
# and of the high nibbles. An e2m1 nibble seeeem-shifted into a bf16's low exponent bits and
# top mantissa bit is its value times 2^-126 (0.5 a subnormal): one fma by 2^126, one by the
# scale, both exact. fma.rn.bf16x2 (sm_80+) keeps subnormal inputs.
_E2M1_TO_BF16_ASM = tl.constexpr("""{
.reg .b32 t<2>, a, b, k126, nzero;
mov.b32 k126, 0x7E807E80;
mov.b32 nzero, 0x80008000;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 a, t0, 6; shl.b32 b, t0, 12; and.b32 b, b, 0x80008000;
lop3.b32 a, a, 0x01C001C0, b, 0xEA;
fma.rn.bf16x2 a, a, k126, nzero; fma.rn.bf16x2 $0, a, $5, nzero;
shl.b32 a, t1, 6; shl.b32 b, t1, 12; and.b32 b, b, 0x80008000;
lop3.b32 a, a, 0x01C001C0, b, 0xEA;
fma.rn.bf16x2 a, a, k126, nzero; fma.rn.bf16x2 $1, a, $6, nzero;
shl.b32 a, t0, 2; shl.b32 b, t0, 8; and.b32 b, b, 0x80008000;
lop3.b32 a, a, 0x01C001C0, b, 0xEA;
fma.rn.bf16x2 a, a, k126, nzero; fma.rn.bf16x2 $2, a, $5, nzero;
shl.b32 a, t1, 2; shl.b32 b, t1, 8; and.b32 b, b, 0x80008000;
lop3.b32 a, a, 0x01C001C0, b, 0xEA;
fma.rn.bf16x2 a, a, k126, nzero; fma.rn.bf16x2 $3, a, $6, nzero;
}""")


@triton.jit
def _e2m1_exact(code, exponent, DTYPE: tl.constexpr):
    """Nibble codes [..] int32 (sign, 2 exponent bits, 1 mantissa bit) times 2^(exponent - 127)
    (exponent [..] int32 UE8M0), built as float32 bits (exact) and cast to DTYPE."""
    e = (code >> 1) & 3
    field = tl.where(e > 0, e - 1 + exponent, exponent - 1)  # 0.5 * 2^(s-127) = 2^(s-128)
    bits = ((code & 8) << 28) | (field << 23) | tl.where(e > 0, (code & 1) << 22, 0)
    bits = tl.where((code & 7) == 0, (code & 8) << 28, bits)  # +-0
    return bits.to(tl.float32, bitcast=True).to(DTYPE)


@triton.jit
def _dequant_nibbles(w, exponents, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """w [BN, BP] uint8 packed bytes, exponents [BN, BP] uint8 (each byte's UE8M0 scale) ->
    (low-nibble values, high-nibble values), each [BN, BP] DTYPE."""
    if USE_ASM:
        scales = (exponents.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)  # 2^(s - 127)
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_TO_BF16_ASM, "=r,=r,=r,=r,r,r,r", [w, scales],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        codes, s = w.to(tl.int32), exponents.to(tl.int32)
        lo, hi = _e2m1_exact(codes & 15, s, DTYPE), _e2m1_exact(codes >> 4, s, DTYPE)
    return lo, hi


@triton.jit
def _load_scales(s_ptrs, byte_step, half_k, BLOCK_K: tl.constexpr):
    """[BN, BK/32] UE8M0 bytes of the K step starting at byte byte_step (127, i.e. 1.0, past
    K: also for the step after the last one, which the loop prefetches)."""
    groups_in = tl.arange(0, BLOCK_K // 32) * 16 < half_k - byte_step
    return tl.load(s_ptrs + byte_step // 16, mask=groups_in[None, :], other=127)


@triton.jit
def _split_dot(acc, w_ptrs, s, a_even, a_odd, byte_step, k_in,
               DTYPE: tl.constexpr, USE_ASM: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc [BN, BM] += lo [BN, BK/2] @ a_even [BK/2, BM] + hi @ a_odd; s [BN, BK/32] the
    step's scales."""
    if EVEN_K:
        w = tl.load(w_ptrs + byte_step)  # [BN, BK/2] uint8
    else:  # masked bytes are zeros; the activations there are zeros too
        w = tl.load(w_ptrs + byte_step, mask=k_in[None, :], other=0)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)),
                   (BLOCK_N, BLOCK_K // 2))  # fmt: skip
    lo, hi = _dequant_nibbles(w, s, DTYPE, USE_ASM)
    acc = tl.dot(lo, a_even, acc)
    return tl.dot(hi, a_odd, acc)


@triton.jit
def expert_slot_tile(pid_m, sorted_slot_ids_ptr, block_expert_ids_ptr, num_slots,
                     SLOTS_PER_A_ROW: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Row tile pid_m's sorted slots [BM], which are real, their rows of a (int64) and the
    expert (int64) every slot of the tile goes to."""
    slots = tl.load(sorted_slot_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    is_real = slots < num_slots
    a_rows = (slots // SLOTS_PER_A_ROW).to(tl.int64)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    return slots, is_real, a_rows, expert


@triton.jit
def lane_major_rows(positions, N, LANES: tl.constexpr, FUSE_SILU: tl.constexpr):
    """[BN] weight rows of output positions. With FUSE_SILU (gate+up) position p holds column
    LANES (p mod N/LANES) + p div N/LANES, so act comes out lane-major for the down GEMM."""
    rows = positions
    if FUSE_SILU:
        lane_n = N // LANES
        rows = LANES * (positions % lane_n) + positions // lane_n
    return rows.to(tl.int64)


@triton.jit
def store_slot_tile(acc, acc_up, c_ptr, stride_cm, topk_weights_ptr, slots, is_real, pid_n, N,
                    FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, USE_LIMIT: tl.constexpr,
                    LIMIT: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """c[slot, position] from acc [BN, BM] (and acc_up: silu(gate) * up with FUSE_SILU; the
    router weight with MUL_WEIGHT)."""
    if FUSE_SILU:
        acc, acc_up = clamp_gate_up(acc, acc_up, USE_LIMIT, LIMIT)
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + slots, mask=is_real, other=0.0)[None, :]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + slots[None, :].to(tl.int64) * stride_cm + cols[:, None]  # [BN, BM]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=is_real[None, :] & (cols[:, None] < N))


@triton.jit
def _moe_mxfp4_split_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K, num_slots, up_offset, num_blocks_m,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    SLOTS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    USE_ASM: tl.constexpr, EVEN_K: tl.constexpr, USE_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Like _moe_mxfp4_gemm_kernel over de-interleaved activations a (row: K/2 even-k values,
    then K/2 odd-k ones); act comes out the same way (lane_major_rows)."""
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slots, is_real, a_rows, expert = expert_slot_tile(
        pid_m, sorted_slot_ids_ptr, block_expert_ids_ptr, num_slots, SLOTS_PER_A_ROW, BLOCK_M
    )
    positions = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # [BN] wrapped: no row masks
    rows = lane_major_rows(positions, N, 2, FUSE_SILU)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    half_k = K // 2
    a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_byte[:, None]  # [BK/2, BM] evens
    w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_byte[None, :]
    s_ptrs = s_ptr + expert * stride_se + rows[:, None] * stride_sn
    s_ptrs += tl.arange(0, BLOCK_K // 32)[None, :]  # [BN, BK/32]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    dtype = a_ptr.dtype.element_ty
    up_s_ptrs = s_ptrs + up_offset * stride_sn
    # The scale tiles ([BN, 4] bytes at BK=128) are too narrow for the pipeliner's async copies:
    # loaded one K step ahead by hand, so their latency hides behind a step's dots.
    s_next = _load_scales(s_ptrs, 0, half_k, BLOCK_K)
    up_s_next = s_next  # the down GEMM (no FUSE_SILU) has no up rows: their scales are unread
    if FUSE_SILU:
        up_s_next = _load_scales(up_s_ptrs, 0, half_k, BLOCK_K)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        byte_step = k_step * (BLOCK_K // 2)
        k_in = offs_byte < half_k - byte_step
        s, up_s = s_next, up_s_next
        s_next = _load_scales(s_ptrs, byte_step + BLOCK_K // 2, half_k, BLOCK_K)
        if FUSE_SILU:
            up_s_next = _load_scales(up_s_ptrs, byte_step + BLOCK_K // 2, half_k, BLOCK_K)
        if EVEN_K:
            a_even = tl.load(a_ptrs + byte_step, mask=is_real[None, :], other=0.0)
            a_odd = tl.load(a_ptrs + half_k + byte_step, mask=is_real[None, :], other=0.0)
        else:
            mask = is_real[None, :] & k_in[:, None]
            a_even = tl.load(a_ptrs + byte_step, mask=mask, other=0.0)
            a_odd = tl.load(a_ptrs + half_k + byte_step, mask=mask, other=0.0)
        acc = _split_dot(acc, w_ptrs, s, a_even, a_odd, byte_step, k_in, dtype, USE_ASM,
                         EVEN_K, BLOCK_N, BLOCK_K)  # fmt: skip
        if FUSE_SILU:
            acc_up = _split_dot(acc_up, w_ptrs + up_offset * stride_wn, up_s, a_even, a_odd,
                                byte_step, k_in, dtype, USE_ASM, EVEN_K, BLOCK_N,
                                BLOCK_K)  # fmt: skip
    store_slot_tile(acc, acc_up, c_ptr, stride_cm, topk_weights_ptr, slots, is_real, pid_n, N,
                    FUSE_SILU, MUL_WEIGHT, USE_LIMIT, LIMIT, BLOCK_N)  # fmt: skip
