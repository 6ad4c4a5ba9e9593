"""The W4A8 MXFP4 grouped GEMM: e2m1 weights made FP8 e4m3 in registers, times FP8 activations
on the FP8 tensor cores (sm_89 and later), one 128-wide K block a step.

Exact FP8 weights. Weight w[n, k] = e2m1 * 2^(s - 127), s the UE8M0 byte of its group of 32.
With smax the largest scale byte of row n, each group's values become e2m1 * 2^d, d = s - smax
+ 6 in [-5, 6]: every such value is an e4m3 normal (0.5 * 2^-5 = 2^-6 is e4m3's smallest
normal, 6 * 2^6 = 384 below its 448), so the cast is exact, and the row's scale 2^(smax - 133),
the same over K, multiplies the accumulator once at the end; each K block adds its dot times
the activations' block scale, one FMA an element as a block-scaled FP8 GEMM's. That needs a
row's scales within 11 binades of each other (`fits_w4a8` checks).

Octets. Eight values v0..v7 (K order) of a 32-bit word are stored with nibble i holding v_i's
magnitude (e1 e0 m) in its low 3 bits and, in bit 3, the sign of v_{4+i/2} for even i and of
v_{(i-1)/2} for odd i (`to_octets`): the lookup then takes its selectors from the word masked
once, and the signs of v0..v3 already sit at their bytes' top bits (those of v4..v7 one shift
away). K splits into two lanes, k mod 8 < 4 and >= 4 (`octet_lanes` for the activations), one
dot each; the output is the word's two registers of four e4m3 bytes, one per lane.

The lookup: an e4m3 table of the eight magnitudes at d = -5 (bytes 0x00 0x08 0x10 0x14 | 0x18
0x1C 0x20 0x24), each nonzero byte plus D = (d + 5) * 8 (at most 88: no byte carries), a
prmt each four values: 10 instructions per 8 values, against 14 for the bf16 lookup of the
four-lane kernel over swapped bit pairs.
"""

from __future__ import annotations

from rayinfer.kernels.elementwise.activation import clamp_gate_up
from rayinfer.kernels.moe.fused_moe_mxfp4_kernel import expert_slot_tile
from rayinfer.kernels.tile_order import grouped_tile_ids
from rayinfer.kernels.triton_compat import tl, triton

# $2: a word of packed octets; $3: D in each of its bytes -> $0, $1: e4m3 bytes of v0..v3, v4..v7
OCTET_TO_E4M3_ASM = tl.constexpr("""{
.reg .b32 sel, lo, hi, t_lo, t_hi, d_up, sgn;
and.b32 d_up, $3, 0xFFFFFF00;
add.u32 t_lo, d_up, 0x14100800;
add.u32 t_hi, $3, 0x24201C18;
and.b32 sel, $2, 0x77777777;
prmt.b32 lo, t_lo, t_hi, sel;
lop3.b32 $0, lo, $2, 0x80808080, 0xF8;
shr.b32 sel, sel, 16;
prmt.b32 hi, t_lo, t_hi, sel;
shl.b32 sgn, $2, 4;
lop3.b32 $1, hi, sgn, 0x80808080, 0xF8;
}""")
GROUPS_PER_BLOCK = tl.constexpr(4)  # UE8M0 groups of 32 in a 128-wide K block


@triton.jit
def _e4m3_byte(magnitude, sign, d_bytes):
    """int32 e4m3 bits of sign * e2m1(magnitude) * 2^(d) given D = (d + 5) * 8 (the asm's
    table, in integer arithmetic)."""
    e = magnitude >> 1
    base = tl.where(magnitude == 1, 0x08, ((e + 1) << 3) | ((magnitude & 1) << 2))
    return tl.where(magnitude == 0, 0, base + d_bytes) | (sign << 7)


@triton.jit
def _lane_bytes(words, d_bytes, LANE: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """Lane LANE's values (v0..v3 or v4..v7 of each word) as [BN, BK/2] e4m3."""
    v0 = _octet_value(words, d_bytes, LANE, 0)
    v1 = _octet_value(words, d_bytes, LANE, 1)
    v2 = _octet_value(words, d_bytes, LANE, 2)
    v3 = _octet_value(words, d_bytes, LANE, 3)
    pairs = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BN, BK/8, a, b]: v_2a+b
    return tl.reshape(pairs, (BLOCK_N, BLOCK_K // 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _octet_value(words, d_bytes, LANE: tl.constexpr, R: tl.constexpr):
    """int32 e4m3 bits of value 4 LANE + R of each word (its sign: nibble 2R + 1 for lane 0,
    2R for lane 1)."""
    magnitude = (words >> (4 * (4 * LANE + R))) & 7
    sign = (words >> (4 * (2 * R + 1 - LANE) + 3)) & 1
    return _e4m3_byte(magnitude, sign, d_bytes)


@triton.jit
def _row_exponents(s_ptrs, num_groups, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """The largest UE8M0 byte of each row [BN] int32 over its num_groups groups (GROUPS: their
    count rounded up to a power of two)."""
    offs = tl.arange(0, GROUPS)
    s = tl.load(s_ptrs + offs[None, :], mask=offs[None, :] < num_groups, other=0)
    return tl.max(s.to(tl.int32), axis=1)


@triton.jit
def _block_d(s_ptrs, k_step, row_max):
    """D [BN, 4] of the K block's groups: (d + 5) * 8, d = s - row_max + 6 (>= -5 where
    fits_w4a8 holds; clamped there else)."""
    s = tl.load(s_ptrs + k_step * GROUPS_PER_BLOCK + tl.arange(0, GROUPS_PER_BLOCK)[None, :])
    return tl.maximum(s.to(tl.int32) - row_max[:, None] + 11, 0) * 8


@triton.jit
def _dequant_block(w_rows, d_bytes, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):  # fmt: skip
    """One K block of weights from w_rows [BN] (each row's first byte of the block) -> lanes 0
    and 1, [BN, BK/2] e4m3 each; d_bytes [BN, 4] each group's D."""
    if USE_ASM:
        w = tl.load(w_rows[:, None] + tl.arange(0, BLOCK_K // 2)[None, :])  # [BN, BK/2] uint8
        d_spread = tl.reshape(tl.broadcast_to(d_bytes[:, :, None], (BLOCK_N, 4, BLOCK_K // 8)),
                              (BLOCK_N, BLOCK_K // 2)).to(tl.uint8)  # fmt: skip
        lane0, lane1 = tl.inline_asm_elementwise(
            OCTET_TO_E4M3_ASM, "=r,=r,r,r", [w, d_spread],
            dtype=(tl.int8, tl.int8), is_pure=True, pack=4,
        )  # fmt: skip
        lane0 = lane0.to(tl.float8e4nv, bitcast=True)
        lane1 = lane1.to(tl.float8e4nv, bitcast=True)
    else:
        lane0, lane1 = _exact_lanes(w_rows, d_bytes, BLOCK_N, BLOCK_K)
    return lane0, lane1


@triton.jit
def _exact_lanes(w_rows, d_bytes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The asm's bytes by integer arithmetic over the block's 32-bit words."""
    word_ptrs = w_rows[:, None] + 4 * tl.arange(0, BLOCK_K // 8)[None, :]
    words = tl.load(word_ptrs.to(tl.pointer_type(tl.int32)))  # [BN, BK/8]
    d_words = tl.reshape(tl.broadcast_to(d_bytes[:, :, None], (BLOCK_N, 4, BLOCK_K // 32)),
                         (BLOCK_N, BLOCK_K // 8))  # fmt: skip
    return (_lane_bytes(words, d_words, 0, BLOCK_N, BLOCK_K),
            _lane_bytes(words, d_words, 1, BLOCK_N, BLOCK_K))  # fmt: skip


@triton.jit
def moe_mxfp4_w4a8_kernel(
    a_ptr, a_scale_ptr, w_ptr, s_ptr, c_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K, num_slots, up_offset, num_blocks_m,
    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    SLOTS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    USE_ASM: tl.constexpr, USE_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """c[slot, n] for one tile of sorted slots (one expert) and one tile of output columns.

    a [rows, 2, K/2] float8_e4m3fn octet lanes (`octet_lanes`) with a_scale [rows, K/128]
    float32 (a[m, k] ~ q * scale[m, k // 128]); w [E, N_total, K/2] uint8 in octets
    (`to_octets`) and s [E, N_total, K/32] its UE8M0 bytes (strides in bytes; GROUPS: K/32
    rounded up to a power of two). BLOCK_K is 128: one activation scale block a step. With
    FUSE_SILU, weight rows n and up_offset + n make silu(gate) * up (USE_LIMIT: gate clamped
    above and up both ways at LIMIT first); with MUL_WEIGHT the slot's router weight scales
    its row.
    """
    tl.static_assert(BLOCK_K == 128, "one 128-wide scale block a K step")
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slots, is_real, a_rows, expert = expert_slot_tile(
        pid_m, sorted_slot_ids_ptr, block_expert_ids_ptr, num_slots, SLOTS_PER_A_ROW, BLOCK_M
    )
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (cols % N).to(tl.int64)  # [BN] wrapped: no row masks
    half_k = K // 2
    offs_half = tl.arange(0, BLOCK_K // 2)
    a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_half[:, None]  # [BK/2, BM] lane 0
    a_scale_ptrs = a_scale_ptr + a_rows * stride_asm  # [BM]
    w_rows = w_ptr + expert * stride_we + rows * stride_wn  # [BN]
    s_ptrs = s_ptr + expert * stride_se + rows[:, None] * stride_sn  # [BN, 1]
    up_s_ptrs = s_ptrs + up_offset * stride_sn
    row_max = _row_exponents(s_ptrs, K // 32, BLOCK_N, GROUPS)
    up_max = row_max
    if FUSE_SILU:
        up_max = _row_exponents(up_s_ptrs, K // 32, BLOCK_N, GROUPS)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    real = is_real[None, :]
    for k_step in range(0, K // BLOCK_K):
        step = k_step * (BLOCK_K // 2)
        a0 = tl.load(a_ptrs + step, mask=real, other=0.0)
        a1 = tl.load(a_ptrs + half_k + step, mask=real, other=0.0)
        a_scale = tl.load(a_scale_ptrs + k_step, mask=is_real, other=0.0)[None, :]  # [1, BM]
        lane0, lane1 = _dequant_block(w_rows + step, _block_d(s_ptrs, k_step, row_max),
                                      USE_ASM, BLOCK_N, BLOCK_K)  # fmt: skip
        acc += tl.dot(lane1, a1, tl.dot(lane0, a0)) * a_scale  # one FMA an element a block
        if FUSE_SILU:
            up0, up1 = _dequant_block(w_rows + up_offset * stride_wn + step,
                                      _block_d(up_s_ptrs, k_step, up_max), USE_ASM, BLOCK_N,
                                      BLOCK_K)  # fmt: skip
            acc_up += tl.dot(up1, a1, tl.dot(up0, a0)) * a_scale
    # each row's scale 2^(row_max - 133), the same over K: applied once
    acc *= tl.exp2((row_max - 133).to(tl.float32))[:, None]
    if FUSE_SILU:
        acc_up *= tl.exp2((up_max - 133).to(tl.float32))[:, None]
    if FUSE_SILU:
        acc, acc_up = clamp_gate_up(acc, acc_up, USE_LIMIT, LIMIT)
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + slots, mask=is_real, other=0.0)[None, :]
    c_ptrs = c_ptr + slots[None, :].to(tl.int64) * stride_cm + cols[:, None]  # [BN, BM]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real & (cols[:, None] < N))
