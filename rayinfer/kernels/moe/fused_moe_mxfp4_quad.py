"""The quad-lane MXFP4 grouped GEMM: the packed weights read as 16-bit words (4 values each),
K split into four interleaved lanes k = 4i + r, one dot per lane.

Why words: a 16-bit element is what tensor-core fragments hold, so a pair of words reaches each
thread as one 32-bit register (ldmatrix), which the dequantization takes as it is. The byte
tiles of the split kernel (fused_moe_mxfp4_kernel.py) reach it a byte at a time and are packed
again before their inline PTX runs: eight PRMT per four bytes, more than the lookup itself
(`python benchmarks/compile_moe_kernels.py` counts each main loop's SASS).

Word i of a row holds values 4i..4i+3: its first byte 4i (low nibble) and 4i+1 (high), its
second byte 4i+2 and 4i+3. Four bf16 tiles come out of one word tile, one per lane:
    lane 0: low nibble of the first byte    lane 1: high nibble of the first byte
    lane 2: low nibble of the second byte   lane 3: high nibble of the second byte
and the activations come lane-major ([k = 4i | 4i + 1 | 4i + 2 | 4i + 3] along K, see
`fused_moe_mxfp4.deinterleave`); the gate+up GEMM writes act in that order for the down GEMM.
"""

from __future__ import annotations

from rayinfer.kernels.moe.fused_moe_mxfp4_kernel import (
    _e2m1_exact,
    expert_slot_tile,
    lane_major_rows,
    store_slot_tile,
)
from rayinfer.kernels.tile_order import grouped_tile_ids
from rayinfer.kernels.triton_compat import tl, triton

LANES = tl.constexpr(4)
WORDS_PER_GROUP = tl.constexpr(8)  # 32 values share a UE8M0 scale

# Two words (bytes b0 b1 | b2 b3) and the bf16 scales of each -> the lanes' bf16x2 pairs:
# $0 (lo b0, lo b2), $1 (lo b1, lo b3), $2 (hi b0, hi b2), $3 (hi b1, hi b3). A bf16 holding
# nibble (s, e1, e0, m) times 2^-126 has the bytes high = s e1 at bits 15 and 8, low = e0 m at
# bits 7 and 6, each one of four: one prmt looks a pair up in an 8-byte table (0-3: low bytes
# by (e0, m); 4-7: high bytes by (s, e1)) once its selector nibbles hold those two bits (and
# 1 << 2 for a high byte). prmt 0x3120 orders the bytes b0 b2 b1 b3 (each lane's pair side by
# side); swapping each byte's bit pairs 2-3 and 4-5 puts the low nibble's (s, e1) above its
# (e0, m), the high nibble's sitting two bits up. $5 scales 2^(s - 1) with FOLD (scale bytes at
# most 128: one fma a pair), else 2^(min(s, 128) - 1) and $6 2^(max(s, 128) - 128): exact.
_LOOKUP_REGS = ".reg .b32 v, t, u, y, z, zh, q, lo_tab, hi_tab, nzero;"
_LUT_IMMEDIATE = "mov.b32 lo_tab, 0xC0804000;"
# The same table, from a value ptxas cannot fold: %lanemask_lt & %lanemask_gt is 0 in every
# lane (bits below a lane and bits above it). With the immediate, ptxas keeps the table in a
# uniform register and copies it into a regular one before each prmt (IMAD.U32 R, RZ, RZ, UR:
# one instruction per prmt, 12% of the sm_90 loop); a per-thread value stays in a register.
_LUT_IN_REGISTER = """.reg .b32 lt, gt;
mov.b32 lt, %lanemask_lt;
mov.b32 gt, %lanemask_gt;
lop3.b32 lo_tab, lt, gt, 0xC0804000, 0xEA;"""
_ORDER_BYTES = """
mov.b32 hi_tab, 0x81800100;
mov.b32 nzero, 0x80008000;
prmt.b32 v, $4, 0, 0x3120;
"""
_SWAP_BIT_PAIRS = """shl.b32 t, v, 2;
shr.b32 u, v, 2;
lop3.b32 t, t, u, 0x30303030, 0xE4;
lop3.b32 y, v, t, 0xC3C3C3C3, 0xE4;
"""
_SWAPPED_ALREADY = "mov.b32 y, v;\n"
_LOOKUP = """lop3.b32 z, y, 0x33333333, 0x40404040, 0xEA;
shr.b32 q, y, 2;
lop3.b32 zh, q, 0x33333333, 0x40404040, 0xEA;
prmt.b32 $0, lo_tab, hi_tab, z;
prmt.b32 $2, lo_tab, hi_tab, zh;
shr.b32 q, z, 16;
prmt.b32 $1, lo_tab, hi_tab, q;
shr.b32 q, zh, 16;
prmt.b32 $3, lo_tab, hi_tab, q;
fma.rn.bf16x2 $0, $0, $5, nzero;
fma.rn.bf16x2 $1, $1, $5, nzero;
fma.rn.bf16x2 $2, $2, $5, nzero;
fma.rn.bf16x2 $3, $3, $5, nzero;
"""
_SECOND_FACTOR = """
fma.rn.bf16x2 $0, $0, $6, nzero;
fma.rn.bf16x2 $1, $1, $6, nzero;
fma.rn.bf16x2 $2, $2, $6, nzero;
fma.rn.bf16x2 $3, $3, $6, nzero;
"""


def lookup_asm(fold: bool, lut_in_register: bool, swapped: bool = False) -> str:
    """The lookup block: one scale factor with fold, else two; the low table by the lanemask
    identity with lut_in_register (fewer instructions, same bits), else an immediate; swapped:
    the bytes come with their bit pairs 2-3 and 4-5 swapped already (`swap_bit_pairs`)."""
    table = _LUT_IN_REGISTER if lut_in_register else _LUT_IMMEDIATE
    swap = _SWAPPED_ALREADY if swapped else _SWAP_BIT_PAIRS
    body = _ORDER_BYTES + swap + _LOOKUP + ("" if fold else _SECOND_FACTOR)
    return "{\n" + _LOOKUP_REGS + "\n" + table + body + "}"


WORD_LOOKUP_FOLD_ASM = tl.constexpr(lookup_asm(True, False))
WORD_LOOKUP_ASM = tl.constexpr(lookup_asm(False, False))
WORD_LOOKUP_FOLD_REG_ASM = tl.constexpr(lookup_asm(True, True))
WORD_LOOKUP_REG_ASM = tl.constexpr(lookup_asm(False, True))
SWAPPED_LOOKUP_FOLD_REG_ASM = tl.constexpr(lookup_asm(True, True, True))
SWAPPED_LOOKUP_REG_ASM = tl.constexpr(lookup_asm(False, True, True))


@triton.jit
def _bf16_factors(s, FOLD: tl.constexpr):
    """s [BN, G] uint8 UE8M0 -> bf16 [BN, G] factors whose product times 2^-126 is the scale:
    2^(min(s, 128) - 1) and 2^(max(s, 128) - 128); with FOLD (s at most 128) the first alone
    (returned twice). Made on the narrow tile: spread over the words first, each word would
    convert again."""
    # int16 again before the bitcast: Triton 3.6 widens int16 arithmetic with a literal to int32
    s16 = s.to(tl.int16)
    if FOLD:
        folded = ((s16 + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return folded, folded
    first = ((tl.minimum(s16, 128) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return first, ((tl.maximum(s16, 128) - 1) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _spread(t, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BN, BK/32] -> [BN, BK/4]: each scale group's value for its 8 words."""
    return tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_N, BLOCK_K // 32, WORDS_PER_GROUP)),
                      (BLOCK_N, BLOCK_K // 4))  # fmt: skip


@triton.jit
def _unswap_bit_pairs(word):
    """int32 holding a 16-bit word whose bytes have bits 2-3 and 4-5 swapped -> as shipped."""
    return (word & 0xC3C3) | ((word << 2) & 0x3030) | ((word >> 2) & 0x0C0C)


@triton.jit
def _dequant_words(w, s, DTYPE: tl.constexpr, USE_ASM: tl.constexpr, FOLD: tl.constexpr,
                   LUT_REG: tl.constexpr, SWAPPED: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):  # fmt: skip
    """w [BN, BK/4] int16 words, s [BN, BK/32] uint8 UE8M0 scales -> the four lanes' values,
    each [BN, BK/4] DTYPE (bf16 by the lookup with USE_ASM, its table in a register with
    LUT_REG or SWAPPED; exact float32 bits else). SWAPPED: each byte's bit pairs 2-3 and 4-5
    come swapped (`swap_bit_pairs`), which spares the lookup four instructions a word pair."""
    if USE_ASM:
        first, second = _bf16_factors(s, FOLD)
        if FOLD:
            lane0, lane2, lane1, lane3 = tl.inline_asm_elementwise(
                SWAPPED_LOOKUP_FOLD_REG_ASM if SWAPPED else
                (WORD_LOOKUP_FOLD_REG_ASM if LUT_REG else WORD_LOOKUP_FOLD_ASM),
                "=r,=r,=r,=r,r,r", [w, _spread(first, BLOCK_N, BLOCK_K)],
                dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2,
            )  # fmt: skip
        else:
            lane0, lane2, lane1, lane3 = tl.inline_asm_elementwise(
                SWAPPED_LOOKUP_REG_ASM if SWAPPED else
                (WORD_LOOKUP_REG_ASM if LUT_REG else WORD_LOOKUP_ASM), "=r,=r,=r,=r,r,r,r",
                [w, _spread(first, BLOCK_N, BLOCK_K), _spread(second, BLOCK_N, BLOCK_K)],
                dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2,
            )  # fmt: skip
    else:
        word = w.to(tl.int32) & 0xFFFF
        if SWAPPED:
            word = _unswap_bit_pairs(word)
        exponent = _spread(s, BLOCK_N, BLOCK_K).to(tl.int32)
        lane0 = _e2m1_exact(word & 15, exponent, DTYPE)
        lane1 = _e2m1_exact((word >> 4) & 15, exponent, DTYPE)
        lane2 = _e2m1_exact((word >> 8) & 15, exponent, DTYPE)
        lane3 = _e2m1_exact(word >> 12, exponent, DTYPE)
    return lane0, lane1, lane2, lane3


@triton.jit
def _load_word_scales(s_ptrs, word_step, quarter_k, BLOCK_K: tl.constexpr):
    """[BN, BK/32] UE8M0 bytes of the K step starting at word word_step (127, i.e. 1.0, past K:
    also for the step after the last one, which the loop prefetches)."""
    groups_in = tl.arange(0, BLOCK_K // 32) * WORDS_PER_GROUP < quarter_k - word_step
    return tl.load(s_ptrs + word_step // WORDS_PER_GROUP, mask=groups_in[None, :], other=127)


@triton.jit
def _quad_dot(acc, w_ptrs, s, a0, a1, a2, a3, word_step, words_in,
              DTYPE: tl.constexpr, USE_ASM: tl.constexpr, FOLD: tl.constexpr,
              LUT_REG: tl.constexpr, SWAPPED: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    """acc [BN, BM] += sum over lanes r of lane_r [BN, BK/4] @ a_r [BK/4, BM]; s [BN, BK/32] the
    step's scales."""
    if EVEN_K:
        w = tl.load(w_ptrs + word_step)  # [BN, BK/4] int16
    else:  # masked words are zeros; the activations there are zeros too
        w = tl.load(w_ptrs + word_step, mask=words_in[None, :], other=0)
    lane0, lane1, lane2, lane3 = _dequant_words(w, s, DTYPE, USE_ASM, FOLD, LUT_REG, SWAPPED,
                                                BLOCK_N, BLOCK_K)  # fmt: skip
    acc = tl.dot(lane0, a0, acc)
    acc = tl.dot(lane1, a1, acc)
    acc = tl.dot(lane2, a2, acc)
    return tl.dot(lane3, a3, acc)


@triton.jit
def _load_lanes(a_ptrs, word_step, quarter_k, mask):
    """The four lanes' activation tiles [BK/4, BM] of this K step."""
    a0 = tl.load(a_ptrs + word_step, mask=mask, other=0.0)
    a1 = tl.load(a_ptrs + quarter_k + word_step, mask=mask, other=0.0)
    a2 = tl.load(a_ptrs + 2 * quarter_k + word_step, mask=mask, other=0.0)
    a3 = tl.load(a_ptrs + 3 * quarter_k + word_step, mask=mask, other=0.0)
    return a0, a1, a2, a3


@triton.jit
def moe_mxfp4_quad_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K, num_slots, up_offset, num_blocks_m,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    SLOTS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    USE_ASM: tl.constexpr, FOLD: tl.constexpr, LUT_REG: tl.constexpr, SWAPPED: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_LIMIT: tl.constexpr,
    LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """c[slot, position] for one tile of sorted slots (one expert) and one tile of positions.

    a [rows, K] lane-major activations (a row of a is slot // SLOTS_PER_A_ROW); w [E, N_total,
    K/4] int16 words and s [E, N_total, K/32] uint8 (UE8M0) the expert weights (strides in
    words and bytes). With FUSE_SILU, weight rows n and up_offset + n make silu(gate) * up
    (USE_LIMIT: gate clamped above and up both ways at LIMIT first) and act comes out lane-major
    (lane_major_rows); with MUL_WEIGHT the slot's router weight scales its row.
    """
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slots, is_real, a_rows, expert = expert_slot_tile(
        pid_m, sorted_slot_ids_ptr, block_expert_ids_ptr, num_slots, SLOTS_PER_A_ROW, BLOCK_M
    )
    positions = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # [BN] wrapped: no row masks
    rows = lane_major_rows(positions, N, LANES, FUSE_SILU)
    offs_word = tl.arange(0, BLOCK_K // 4)
    quarter_k = K // LANES
    a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_word[:, None]  # [BK/4, BM] lane 0
    w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_word[None, :]
    s_ptrs = s_ptr + expert * stride_se + rows[:, None] * stride_sn
    s_ptrs += tl.arange(0, BLOCK_K // 32)[None, :]  # [BN, BK/32]
    up_s_ptrs = s_ptrs + up_offset * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    dtype = a_ptr.dtype.element_ty
    # The scale tiles are too narrow for the pipeliner's async copies: loaded a K step ahead
    s_next = _load_word_scales(s_ptrs, 0, quarter_k, BLOCK_K)
    up_s_next = s_next  # the down GEMM (no FUSE_SILU) has no up rows: their scales are unread
    if FUSE_SILU:
        up_s_next = _load_word_scales(up_s_ptrs, 0, quarter_k, BLOCK_K)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        word_step = k_step * (BLOCK_K // 4)
        words_in = offs_word < quarter_k - word_step
        s, up_s = s_next, up_s_next
        s_next = _load_word_scales(s_ptrs, word_step + BLOCK_K // 4, quarter_k, BLOCK_K)
        if FUSE_SILU:
            up_s_next = _load_word_scales(up_s_ptrs, word_step + BLOCK_K // 4, quarter_k, BLOCK_K)
        mask = is_real[None, :]
        if not EVEN_K:
            mask = mask & words_in[:, None]
        a0, a1, a2, a3 = _load_lanes(a_ptrs, word_step, quarter_k, mask)
        acc = _quad_dot(acc, w_ptrs, s, a0, a1, a2, a3, word_step, words_in, dtype, USE_ASM,
                        FOLD, LUT_REG, SWAPPED, EVEN_K, BLOCK_N, BLOCK_K)  # fmt: skip
        if FUSE_SILU:
            acc_up = _quad_dot(acc_up, w_ptrs + up_offset * stride_wn, up_s, a0, a1, a2, a3,
                               word_step, words_in, dtype, USE_ASM, FOLD, LUT_REG, SWAPPED, EVEN_K,
                               BLOCK_N, BLOCK_K)  # fmt: skip
    store_slot_tile(acc, acc_up, c_ptr, stride_cm, topk_weights_ptr, slots, is_real, pid_n, N,
                    FUSE_SILU, MUL_WEIGHT, USE_LIMIT, LIMIT, BLOCK_N)  # fmt: skip
