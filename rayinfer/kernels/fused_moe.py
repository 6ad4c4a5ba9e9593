"""Routed experts: every token runs through its top-k experts' SwiGLU MLPs, weighted and summed.

The Triton path is a grouped GEMM over tokens sorted and padded per expert tile (moe_align):
  1. gate+up: act[slot] = silu(x[token] @ w13[e, :I].T) * (x[token] @ w13[e, I:].T)   [T*K, I]
  2. down:    out_slot[slot] = topk_weight[slot] * act[slot] @ w2[e].T               [T*K, H]
  3. top-k reduction: out[t] = sum_k out_slot[t*K + k] over slots routed to a held expert.
FP8 weights (DeepSeek-V3: float8_e4m3fn with one float32 scale per 128x128 block) multiply
activations quantized per token and per 128 channels (fp8_quant) and rescale every K step.

Row tiles: by default a program multiplies one BLOCK_M tile of one expert's rows. A tile config
with TAIL_M instead pads each expert's rows to TAIL_M and gives a program a chunk of up to
BLOCK_M + TAIL_M of them (two accumulators): at ~1.5 tiles of rows per expert (4,096 V3 tokens,
~128 rows each), each weight tile is read once per K step and 192 rows are multiplied instead of
2 x 128. GATE_UP_ONE_DOT (w13, chunked) makes gate and up one [rows, BLOCK_N] product whose
columns are BLOCK_N/2 gate then BLOCK_N/2 up outputs, which keeps the accumulators in registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayinfer.kernels.activation import silu_and_mul_reference
from rayinfer.kernels.fp8_quant import fp8_dequant_reference, fp8_quant, fp8_quant_reference
from rayinfer.kernels.moe_align import MoeAlignment, moe_align
from rayinfer.kernels.tile_configs import pick_tile_config
from rayinfer.kernels.tile_order import grouped_tile_ids
from rayinfer.kernels.triton_compat import TensorDescriptor, tl, triton

SCALE_BLOCK = 128
# Tile keys that choose a code path rather than a kernel argument of the same name.
LAUNCH_OPTIONS = ("USE_TMA", "GATE_UP_ONE_DOT")
DEFAULT_CONFIG = {
    "w13": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 3},
    "w2": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
           "num_stages": 3},
}  # fmt: skip


@triton.jit
def _load_weight_tile(
    b_ptr, b_offs, row, k_step, k_in,
    USE_TMA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """[BK, BN] of an expert's weight rows; with USE_TMA, b_ptr is a descriptor over [E*N, K]."""
    if USE_TMA:
        tile = b_ptr.load([row, k_step * BLOCK_K]).T
    elif EVEN_K:  # no K mask: keeps the loads 16 bytes wide
        tile = tl.load(b_ptr + b_offs + k_step * BLOCK_K)
    else:
        tile = tl.load(b_ptr + b_offs + k_step * BLOCK_K, mask=k_in[:, None], other=0.0)
    return tile


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K, num_slots, up_offset, num_blocks_m,
    stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn,
    SLOTS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    USE_FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """c[slot, n] for one tile of sorted slots (one expert) and one tile of output columns.

    A row of a is slot // SLOTS_PER_A_ROW (x for gate+up, the slot's own act row for down).
    With FUSE_SILU, b rows n and up_offset + n are multiplied and combined as silu(gate) * up.
    """
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_blocks_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slots = tl.load(sorted_slot_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    is_real = slots < num_slots
    a_rows = (slots // SLOTS_PER_A_ROW).to(tl.int64)
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    b_offs = expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    b_row = (expert * (stride_be // stride_bn) + pid_n * BLOCK_N).to(tl.int32)  # TMA row
    if USE_FP8:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm  # [BM]
        b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // SCALE_BLOCK) * stride_bsn
        up_scale_ptrs = b_scale_ptr + expert * stride_bse
        up_scale_ptrs += ((offs_n + up_offset) // SCALE_BLOCK) * stride_bsn  # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        k_in = offs_k < K - k_step * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=is_real[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=is_real[:, None] & k_in[None, :], other=0.0)
        b = _load_weight_tile(b_ptr, b_offs, b_row, k_step, k_in, USE_TMA, EVEN_K, BLOCK_K)
        if USE_FP8:
            scale_col = k_step * BLOCK_K // SCALE_BLOCK
            a_scale = tl.load(a_scale_ptrs + scale_col, mask=is_real, other=0.0)[:, None]
            acc += tl.dot(a, b) * a_scale * tl.load(b_scale_ptrs + scale_col)[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if FUSE_SILU:
            up_offs = b_offs + up_offset * stride_bn
            up = _load_weight_tile(
                b_ptr, up_offs, b_row + up_offset, k_step, k_in, USE_TMA, EVEN_K, BLOCK_K
            )
            if USE_FP8:
                acc_up += tl.dot(a, up) * a_scale * tl.load(up_scale_ptrs + scale_col)[None, :]
            else:
                acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
    if FUSE_SILU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + slots, mask=is_real, other=0.0)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=is_real[:, None] & (cols[None, :] < N))


@triton.jit
def _expert_chunks_kernel(
    block_expert_ids_ptr, run_first_ptr, run_last_ptr,
    chunk_first_tile_ptr, chunk_num_tiles_ptr, num_chunks_ptr,
    num_tiles, long_list_offset,
    TILES_PER_CHUNK: tl.constexpr, TILES_IN_MAIN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: cut each expert's run of n row tiles into ceil(n / TILES_PER_CHUNK) chunks of
    balanced size (4 tiles -> 2 + 2, not 3 + 1: a 1-tile chunk would pay a whole main tile).

    Pass 1 writes each run's first and last tile; pass 2 the chunks (first tile, tile count),
    compacted in two lists: chunks that fit the main rows (at 0), and chunks with tail rows (at
    long_list_offset), and the two counts.
    """
    for block_start in range(0, num_tiles, BLOCK):
        tiles = block_start + tl.arange(0, BLOCK)  # [B]
        experts = tl.load(block_expert_ids_ptr + tiles, mask=tiles < num_tiles, other=-1)
        before = tl.load(block_expert_ids_ptr + tiles - 1, mask=tiles >= 1, other=-1)
        after = tl.load(block_expert_ids_ptr + tiles + 1, mask=tiles + 1 < num_tiles, other=-1)
        held = experts >= 0
        tl.store(run_first_ptr + experts, tiles, mask=held & (before != experts))
        tl.store(run_last_ptr + experts, tiles, mask=held & (after != experts))
    tl.debug_barrier()  # pass 2 reads what other threads stored
    num_short, num_long = 0, 0
    for block_start in range(0, num_tiles, BLOCK):
        tiles = block_start + tl.arange(0, BLOCK)  # [B]
        experts = tl.load(block_expert_ids_ptr + tiles, mask=tiles < num_tiles, other=-1)
        held = experts >= 0
        first = tl.load(run_first_ptr + experts, mask=held, other=0)
        run_tiles = tl.load(run_last_ptr + experts, mask=held, other=0) - first + 1  # [B] n
        run_tiles = tl.where(held, run_tiles, 1)
        chunks_in_run = (run_tiles + TILES_PER_CHUNK - 1) // TILES_PER_CHUNK
        base = run_tiles // chunks_in_run  # the first `extra` chunks hold base + 1 tiles
        extra = run_tiles % chunks_in_run
        rel = tiles - first
        in_long = extra * (base + 1)
        chunk = tl.where(rel < in_long, rel // (base + 1), extra + (rel - in_long) // base)
        starts = held & (rel == chunk * base + tl.minimum(chunk, extra))
        size = base + (chunk < extra).to(tl.int32)  # [B] tiles in the chunk starting here
        short = (starts & (size <= TILES_IN_MAIN)).to(tl.int32)
        long = (starts & (size > TILES_IN_MAIN)).to(tl.int32)
        slot = tl.where(
            short != 0,
            num_short + tl.cumsum(short, 0) - 1,
            long_list_offset + num_long + tl.cumsum(long, 0) - 1,
        )  # [B]
        tl.store(chunk_first_tile_ptr + slot, tiles, mask=starts)
        tl.store(chunk_num_tiles_ptr + slot, size, mask=starts)
        num_short += tl.sum(short, 0)
        num_long += tl.sum(long, 0)
    tl.store(num_chunks_ptr, num_short)
    tl.store(num_chunks_ptr + 1, num_long)


@triton.jit
def _dot_acc(acc, a, b, a_scale, b_scale, USE_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [R, BN] += a [R, BK] @ b [BK, BN], rescaled per row and column for FP8."""
    if USE_FP8:
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _column_scales(scale_ptrs, scale_col, USE_FP8: tl.constexpr):
    """[BN] weight-block scales of K block scale_col for FP8; 1.0 otherwise."""
    scale = 1.0
    if USE_FP8:
        scale = tl.load(scale_ptrs + scale_col)
    return scale


@triton.jit
def _load_rows(a_ptrs, a_scale_ptrs, is_real, k_step, k_in, scale_col,
               USE_FP8: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The K block k_step of gathered activation rows [R, BK] and their scales [R] (FP8)."""
    if EVEN_K:
        a = tl.load(a_ptrs + k_step * BLOCK_K, mask=is_real[:, None], other=0.0)
    else:
        mask = is_real[:, None] & k_in[None, :]
        a = tl.load(a_ptrs + k_step * BLOCK_K, mask=mask, other=0.0)
    a_scale = 1.0
    if USE_FP8:
        a_scale = tl.load(a_scale_ptrs + scale_col, mask=is_real, other=0.0)
    return a, a_scale


@triton.jit
def _chunk_k_loop(
    a_ptrs, tail_a_ptrs, a_scale_ptrs, tail_a_scale_ptrs, is_real, tail_is_real,
    b_ptr, b_offs, b_row, expert, b_scale_ptrs, up_scale_ptrs, K, up_offset, stride_bn,
    WITH_TAIL: tl.constexpr, SEPARATE_UP: tl.constexpr, GATE_UP_BOX: tl.constexpr,
    USE_FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Every K block's weight tile is loaded once and multiplies the main rows and the tail rows.

    Returns (main [BM, BN], main_up, tail [TM, BN], tail_up); the up products only with
    SEPARATE_UP. With GATE_UP_BOX, b_ptr is a TMA descriptor over w13 as [E, 2, I, H] and one
    [BN, BK] tile holds BN/2 gate rows then the BN/2 matching up rows.
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tail = tl.zeros((TAIL_M, BLOCK_N), dtype=tl.float32)
    tail_up = tl.zeros((TAIL_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        k_in = offs_k < K - k_step * BLOCK_K
        scale_col = k_step * BLOCK_K // SCALE_BLOCK
        b_scale = _column_scales(b_scale_ptrs, scale_col, USE_FP8)
        if GATE_UP_BOX:
            box = b_ptr.load([expert, 0, b_row, k_step * BLOCK_K])  # [1, 2, BN/2, BK]
            b = box.reshape(BLOCK_N, BLOCK_K).T
        else:
            b = _load_weight_tile(b_ptr, b_offs, b_row, k_step, k_in, USE_TMA, EVEN_K, BLOCK_K)
        a, a_scale = _load_rows(
            a_ptrs, a_scale_ptrs, is_real, k_step, k_in, scale_col, USE_FP8, EVEN_K, BLOCK_K
        )
        acc = _dot_acc(acc, a, b, a_scale, b_scale, USE_FP8, DOT_PRECISION)
        if WITH_TAIL:
            tail_a, tail_scale = _load_rows(
                tail_a_ptrs, tail_a_scale_ptrs, tail_is_real, k_step, k_in, scale_col,
                USE_FP8, EVEN_K, BLOCK_K,
            )  # fmt: skip
            tail = _dot_acc(tail, tail_a, b, tail_scale, b_scale, USE_FP8, DOT_PRECISION)
        if SEPARATE_UP:
            up = _load_weight_tile(
                b_ptr, b_offs + up_offset * stride_bn, b_row + up_offset, k_step, k_in,
                USE_TMA, EVEN_K, BLOCK_K,
            )  # fmt: skip
            up_scale = _column_scales(up_scale_ptrs, scale_col, USE_FP8)
            acc_up = _dot_acc(acc_up, a, up, a_scale, up_scale, USE_FP8, DOT_PRECISION)
            if WITH_TAIL:
                tail_up = _dot_acc(
                    tail_up, tail_a, up, tail_scale, up_scale, USE_FP8, DOT_PRECISION
                )  # fmt: skip
    return acc, acc_up, tail, tail_up


@triton.jit
def _store_rows(
    acc, acc_up, slots, is_real, c_ptr, topk_weights_ptr, pid_n, N, stride_cm,
    FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, GATE_UP_ONE_DOT: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """c[slot, cols] = silu(gate) * up (gate+up) or topk_weight[slot] * acc (down).

    With GATE_UP_ONE_DOT, acc [R, BN] holds gate in its first BN/2 columns and up in the rest.
    """
    out_n: tl.constexpr = BLOCK_N // 2 if GATE_UP_ONE_DOT else BLOCK_N
    if GATE_UP_ONE_DOT:
        halves = tl.permute(tl.reshape(acc, (ROWS, 2, out_n)), (0, 2, 1))  # [R, BN/2, 2]
        acc, acc_up = tl.split(halves)  # gate, up [R, BN/2]
    if FUSE_SILU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + slots, mask=is_real, other=0.0)[:, None]
    cols = pid_n * out_n + tl.arange(0, out_n)
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=is_real[:, None] & (cols[None, :] < N))


@triton.jit
def _weight_rows(pid_n, N, up_offset, GATE_UP_ONE_DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BN] weight rows of output tile pid_n, wrapped into [0, N); with GATE_UP_ONE_DOT, BN/2
    gate rows then the BN/2 up rows of the same output columns (one dot makes both)."""
    if GATE_UP_ONE_DOT:
        half: tl.constexpr = BLOCK_N // 2
        offs = tl.arange(0, BLOCK_N)
        rows = (pid_n * half + offs % half) % N + (offs // half) * up_offset
    else:
        rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    return rows


@triton.jit
def _moe_chunk_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr,
    chunk_first_tile_ptr, chunk_num_tiles_ptr, num_chunks_ptr,
    N, K, num_slots, up_offset, max_chunks,
    stride_am, stride_be, stride_bn, stride_cm, stride_asm, stride_bse, stride_bsn,
    SLOTS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    USE_FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GATE_UP_ONE_DOT: tl.constexpr, WITH_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """Like _moe_gemm_kernel, for one chunk of an expert's rows: BLOCK_M main rows plus up to
    TAIL_M tail rows (row tiles of TAIL_M), so an expert with 1.5 tiles' worth of rows reads each
    weight tile once and multiplies 1.5 tiles, not 2. Chunks with tail rows (WITH_TAIL) and
    without are separate launches over separate lists: one K loop per kernel (ptxas serializes
    every wgmma of a kernel with a second loop)."""
    out_n: tl.constexpr = BLOCK_N // 2 if GATE_UP_ONE_DOT else BLOCK_N  # output columns per tile
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), max_chunks, tl.cdiv(N, out_n), GROUP_M)
    if pid_m >= tl.load(num_chunks_ptr):
        return
    first_row = tl.load(chunk_first_tile_ptr + pid_m) * TAIL_M
    num_rows = tl.load(chunk_num_tiles_ptr + pid_m) * TAIL_M  # padded rows of this chunk
    expert = tl.load(block_expert_ids_ptr + first_row // TAIL_M).to(tl.int64)
    main = tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slot_ids_ptr + first_row + main, mask=main < num_rows, other=num_slots)
    tail_rows = BLOCK_M + tl.arange(0, TAIL_M)
    tail_slots = tl.load(
        sorted_slot_ids_ptr + first_row + tail_rows, mask=tail_rows < num_rows, other=num_slots
    )  # [TM]
    is_real, tail_is_real = slots < num_slots, tail_slots < num_slots
    a_rows = (slots // SLOTS_PER_A_ROW).to(tl.int64)  # [BM]
    tail_a_rows = (tail_slots // SLOTS_PER_A_ROW).to(tl.int64)  # [TM]
    offs_n = _weight_rows(pid_n, N, up_offset, GATE_UP_ONE_DOT, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    tail_a_ptrs = a_ptr + tail_a_rows[:, None] * stride_am + offs_k[None, :]  # [TM, BK]
    b_offs = expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    b_row = (expert * (stride_be // stride_bn) + pid_n * BLOCK_N).to(tl.int32)  # TMA row
    if GATE_UP_ONE_DOT:  # the row inside the [E, 2, I, H] descriptor
        b_row = pid_n * out_n
    b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // SCALE_BLOCK) * stride_bsn
    up_scale_ptrs = b_scale_ptr + expert * stride_bse
    up_scale_ptrs += ((offs_n + up_offset) // SCALE_BLOCK) * stride_bsn  # [BN]
    tma_expert = expert.to(tl.int32)
    separate_up: tl.constexpr = FUSE_SILU and not GATE_UP_ONE_DOT
    gate_up_box: tl.constexpr = GATE_UP_ONE_DOT and USE_TMA
    a_scale_ptrs = a_scale_ptr + a_rows * stride_asm  # [BM]
    tail_a_scale_ptrs = a_scale_ptr + tail_a_rows * stride_asm  # [TM]
    acc, acc_up, tail, tail_up = _chunk_k_loop(
        a_ptrs, tail_a_ptrs, a_scale_ptrs, tail_a_scale_ptrs, is_real, tail_is_real,
        b_ptr, b_offs, b_row, tma_expert, b_scale_ptrs, up_scale_ptrs, K, up_offset, stride_bn,
        WITH_TAIL, separate_up, gate_up_box, USE_FP8, SCALE_BLOCK, EVEN_K, USE_TMA, DOT_PRECISION,
        BLOCK_M, TAIL_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if WITH_TAIL:
        _store_rows(tail, tail_up, tail_slots, tail_is_real, c_ptr, topk_weights_ptr, pid_n, N,
                    stride_cm, FUSE_SILU, MUL_WEIGHT, GATE_UP_ONE_DOT, TAIL_M, BLOCK_N)  # fmt: skip
    _store_rows(acc, acc_up, slots, is_real, c_ptr, topk_weights_ptr, pid_n, N, stride_cm,
                FUSE_SILU, MUL_WEIGHT, GATE_UP_ONE_DOT, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _sum_topk_kernel(
    slot_out_ptr, topk_ids_ptr, out_ptr,
    H, num_experts,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out[t] = sum over k of slot_out[t*K + k], skipping slots routed to experts not held."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(TOP_K):
        expert = tl.load(topk_ids_ptr + token * TOP_K + k)
        num_cols_held = tl.where((expert >= 0) & (expert < num_experts), H, 0)
        row = slot_out_ptr + (token * TOP_K + k) * H
        acc += tl.load(row + cols, mask=cols < num_cols_held, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale):
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)} [T, H], w13 {tuple(w13.shape)} [E, 2I, H], "
            f"w2 {tuple(w2.shape)} [E, H, I]"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={x.shape[0]}, K]"
        )
    if x.stride(1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x needs contiguous rows and w13, w2 must be contiguous")
    is_fp8 = w13.dtype == torch.float8_e4m3fn
    if is_fp8 != (w13_scale is not None) or is_fp8 != (w2_scale is not None):
        raise ValueError("float8_e4m3fn w13/w2 need w13_scale and w2_scale, and only they do")
    if is_fp8:
        for name, w, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
            want = (num_experts, *(triton.cdiv(d, SCALE_BLOCK) for d in w.shape[1:]))
            if tuple(scale.shape) != want or scale.dtype != torch.float32:
                raise ValueError(f"{name}_scale must be float32 {want}, got {tuple(scale.shape)}")
    elif x.dtype != w13.dtype or w13.dtype != w2.dtype:
        raise ValueError(f"x, w13, w2 dtypes differ: {x.dtype}, {w13.dtype}, {w2.dtype}")


def _pick_config(x, w13, num_slots):
    if x.dtype == torch.float32:
        # Tuned tiles are for 2-byte inputs; in float32 they need up to 288 KiB of shared memory
        # (H200 has 227 KiB). The default tiles fit: float32 is for parity checks, not speed.
        return DEFAULT_CONFIG
    device_name = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
    kind = "fp8" if w13.dtype == torch.float8_e4m3fn else "bf16"
    shape_key = f"{kind},E={w13.shape[0]},I={w13.shape[1] // 2},H={w13.shape[2]}"
    config = pick_tile_config("fused_moe", device_name, shape_key, x.shape[0])
    if config is None:
        config = pick_tile_config("fused_moe", device_name, kind, x.shape[0])
    return config or DEFAULT_CONFIG


class ExpertChunks(NamedTuple):
    """Runs of up to `tiles_per_chunk` row tiles of one expert, compacted in two lists: row 0
    chunks that fit the main rows, row 1 chunks with tail rows (see fused_moe)."""

    first_tile: torch.Tensor  # [2, C_max] int32: the chunk's first row tile in the sorted layout
    num_tiles: torch.Tensor  # [2, C_max] int32: its row tiles, 1..tiles_per_chunk
    num_chunks: torch.Tensor  # [2] int32: chunks in use in each list
    max_chunks: tuple[int, int]  # bounds on each list's count, known without a host sync


def expert_chunks(alignment: MoeAlignment, num_slots: int, num_experts: int, tile: dict):
    """Chunks of BLOCK_M + TAIL_M rows over an alignment made with block_m = TAIL_M."""
    tail_m, block_m = tile["TAIL_M"], tile["BLOCK_M"]
    tiles_per_chunk = (block_m + tail_m) // tail_m
    num_tiles = alignment.block_expert_ids.numel()
    # An expert with n slots has at most n / chunk rows + 1 chunks; a chunk with tail rows holds
    # more than BLOCK_M slots. Bounds without a host sync:
    max_short = min(
        num_tiles, num_slots // (tiles_per_chunk * tail_m) + min(num_experts, num_slots)
    )
    max_long = min(max_short, num_slots // (block_m + 1))
    device = alignment.block_expert_ids.device
    first_tile = torch.empty(2, max(max_short, 1), dtype=torch.int32, device=device)
    chunk_tiles = torch.empty_like(first_tile)
    num_chunks = torch.empty(2, dtype=torch.int32, device=device)
    runs = torch.empty(2, max(num_experts, 1), dtype=torch.int32, device=device)  # first, last
    _expert_chunks_kernel[(1,)](
        alignment.block_expert_ids, runs[0], runs[1], first_tile, chunk_tiles, num_chunks,
        num_tiles, first_tile.stride(0),
        TILES_PER_CHUNK=tiles_per_chunk, TILES_IN_MAIN=block_m // tail_m, BLOCK=1024,
    )  # fmt: skip
    return ExpertChunks(first_tile, chunk_tiles, num_chunks, (max_short, max_long))


def _check_chunk_tile(tile: dict) -> None:
    tail_m, block_m = tile["TAIL_M"], tile["BLOCK_M"]
    if block_m % tail_m or tail_m & (tail_m - 1):
        raise ValueError(f"TAIL_M={tail_m} must be a power of two dividing BLOCK_M={block_m}")


def row_granule(config: dict) -> int:
    """Rows each expert's run is padded to: TAIL_M for chunked tiles, else BLOCK_M."""
    tile = config["w13"]
    granules = {stage_tile.get("TAIL_M") or stage_tile["BLOCK_M"] for stage_tile in config.values()}
    if len(granules) != 1:
        raise ValueError(
            f"w13 and w2 tiles need the same row granule (TAIL_M or BLOCK_M): {config}"
        )
    return tile.get("TAIL_M") or tile["BLOCK_M"]


def _launch_gemm(a, b, c, a_scale, b_scale, topk_weights, alignment, stage, config, top_k,
                 chunks: ExpertChunks | None = None):  # fmt: skip
    """One grouped GEMM; stage "w13" (gate+up with SiLU) or "w2" (down with top-k weights).

    A tile with TAIL_M runs one program per chunk of an expert's rows (alignment made with
    block_m = TAIL_M); chunks are built here when not given.
    """
    tile = {key: value for key, value in config[stage].items() if key not in LAUNCH_OPTIONS}
    is_w13 = stage == "w13"
    n_out, k = c.shape[1], a.shape[1]
    use_fp8 = b_scale is not None
    use_tma = bool(config[stage].get("USE_TMA")) and k * b.element_size() % 16 == 0
    one_dot = is_w13 and "TAIL_M" in tile and bool(config[stage].get("GATE_UP_ONE_DOT"))
    weights = b
    if use_tma and one_dot:  # w13 as [E, 2, I, H]: a box holds BN/2 gate and BN/2 up rows
        box = [1, 2, tile["BLOCK_N"] // 2, tile["BLOCK_K"]]
        weights = TensorDescriptor.from_tensor(b.view(b.shape[0], 2, n_out, k), box)
    elif use_tma:  # the experts' rows as one [E*N, K] matrix, read in [BN, BK] boxes
        box = [tile["BLOCK_N"], tile["BLOCK_K"]]
        weights = TensorDescriptor.from_tensor(b.view(-1, k), box)
    common = dict(
        SLOTS_PER_A_ROW=top_k if is_w13 else 1, FUSE_SILU=is_w13, MUL_WEIGHT=not is_w13,
        USE_FP8=use_fp8, SCALE_BLOCK=SCALE_BLOCK, EVEN_K=k % tile["BLOCK_K"] == 0,
        USE_TMA=use_tma, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **tile,
    )  # fmt: skip
    operands = (a, weights, c, a_scale if use_fp8 else a, b_scale if use_fp8 else b, topk_weights)
    strides = (
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), a_scale.stride(0) if use_fp8 else 0,
        b_scale.stride(0) if use_fp8 else 0, b_scale.stride(1) if use_fp8 else 0,
    )  # fmt: skip
    num_pid_n = triton.cdiv(n_out, tile["BLOCK_N"] // 2 if one_dot else tile["BLOCK_N"])
    if "TAIL_M" in tile:
        _check_chunk_tile(tile)
        if chunks is None:
            chunks = expert_chunks(alignment, topk_weights.numel(), b.shape[0], tile)
        for with_tail in (False, True):  # two launches: one K loop per kernel
            row, max_chunks = int(with_tail), chunks.max_chunks[int(with_tail)]
            if max_chunks == 0:
                continue
            _moe_chunk_gemm_kernel[(max_chunks * num_pid_n,)](
                *operands, alignment.sorted_slot_ids, alignment.block_expert_ids,
                chunks.first_tile[row], chunks.num_tiles[row], chunks.num_chunks[row:],
                n_out, k, topk_weights.numel(), n_out, max_chunks, *strides,
                GATE_UP_ONE_DOT=one_dot, WITH_TAIL=with_tail, **common,
            )  # fmt: skip
        return
    num_blocks_m = alignment.block_expert_ids.numel()
    _moe_gemm_kernel[(num_blocks_m * num_pid_n,)](
        *operands, *alignment, n_out, k, topk_weights.numel(), n_out, num_blocks_m, *strides,
        **common,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, H] bfloat16/float16/float32
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows; x.dtype or float8_e4m3fn
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int: ids outside [0, E) are experts this rank does not hold
    w13_scale: torch.Tensor | None = None,  # [E, 2I/128, H/128] float32 for FP8 weights
    w2_scale: torch.Tensor | None = None,  # [E, H/128, I/128] float32 for FP8 weights
    config: dict | None = None,  # {"w13": tile, "w2": tile}; same TAIL_M or BLOCK_M in both
) -> torch.Tensor:  # [T, H] x.dtype
    _check_inputs(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    config = config or _pick_config(x, w13, num_tokens * top_k)
    alignment = moe_align(topk_ids, num_experts, row_granule(config))
    chunks = None
    if "TAIL_M" in config["w13"]:  # one program per chunk of an expert's rows, in both GEMMs
        _check_chunk_tile(config["w13"])
        chunks = expert_chunks(alignment, num_tokens * top_k, num_experts, config["w13"])
    weights = topk_weights.float().contiguous()
    act = torch.empty(num_tokens * top_k, two_i // 2, dtype=x.dtype, device=x.device)  # [T*K, I]
    slot_out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)  # [T*K, H]
    x_in, x_scale = fp8_quant(x) if w13_scale is not None else (x, None)
    stage_args = (weights, alignment)
    _launch_gemm(x_in, w13, act, x_scale, w13_scale, *stage_args, "w13", config, top_k, chunks)
    act_in, act_scale = fp8_quant(act) if w2_scale is not None else (act, None)
    w2_chunks = chunks if config["w2"].get("BLOCK_M") == config["w13"]["BLOCK_M"] else None
    _launch_gemm(act_in, w2, slot_out, act_scale, w2_scale, *stage_args, "w2", config, 1, w2_chunks)
    _sum_topk_kernel[(num_tokens, triton.cdiv(hidden, 1024))](
        slot_out, topk_ids.contiguous(), out, hidden, num_experts, TOP_K=top_k, BLOCK_H=1024
    )
    return out


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows of each expert
    w2: torch.Tensor,  # [E, H, I]: down projection of each expert
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64: expert of each (token, slot); E_local ids
) -> torch.Tensor:  # [T, H]
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    # Slots routed to an expert this rank does not hold (id < 0 or >= E) sort last and are dropped.
    held = (flat_ids >= 0) & (flat_ids < num_experts)  # [T*K]
    order = torch.where(held, flat_ids, num_experts).argsort(stable=True)[: int(held.sum())]
    counts = torch.bincount(flat_ids[order], minlength=num_experts).tolist()  # [E]
    tokens = order // top_k  # [S] token of each held slot, grouped by expert
    slot_out = torch.empty(order.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            hidden = silu_and_mul_reference(x[tokens[rows]] @ w13[expert].t())  # [n, I]
            slot_out[rows] = (hidden @ w2[expert].t()).float()  # [n, H]
            start += count
    weights = topk_weights.reshape(-1)[order].float()  # [S]
    out = torch.zeros_like(x, dtype=torch.float32)
    out.index_add_(0, tokens, slot_out * weights[:, None])
    return out.to(x.dtype)


def dequantize_experts_reference(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, N, K] float8_e4m3fn with [E, N/128, K/128] block scales -> [E, N, K] float32."""
    rows = scale.repeat_interleave(SCALE_BLOCK, 1)[:, : w.shape[1]]  # [E, N, K/128]
    return w.float() * rows.repeat_interleave(SCALE_BLOCK, 2)[:, :, : w.shape[2]]


def fused_moe_fp8_reference(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale):
    """The FP8 path in float32: activations quantized per token per 128 channels like the kernel."""
    x_q = fp8_dequant_reference(*fp8_quant_reference(x))  # [T, H] float32
    w13_full = dequantize_experts_reference(w13, w13_scale)  # [E, 2I, H]
    w2_full = dequantize_experts_reference(w2, w2_scale)  # [E, H, I]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for token, (ids, weights) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        for expert, weight in zip(ids, weights):
            if 0 <= expert < w13.shape[0]:
                act = silu_and_mul_reference(x_q[token : token + 1] @ w13_full[expert].t())
                act = fp8_dequant_reference(*fp8_quant_reference(act))  # [1, I]
                out[token] += weight * (act @ w2_full[expert].t())[0]
    return out.to(x.dtype)
