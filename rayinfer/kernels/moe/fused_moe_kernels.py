"""The Triton kernels of fused_moe: the grouped GEMM over expert row tiles (`_moe_gemm_kernel`),
its chunked form with main and tail rows (`_moe_chunk_gemm_kernel` and its jit helpers), and the
top-k reduction (`_sum_topk_kernel`). Launched by fused_moe._launch_gemm and fused_moe.fused_moe.
"""

from __future__ import annotations

from rayinfer.kernels.elementwise.activation import clamp_gate_up
from rayinfer.kernels.fp8.fp8_quant import FP8_MAX, MIN_SCALE, _round_to_e4m3_grid
from rayinfer.kernels.tile_order import grouped_tile_ids
from rayinfer.kernels.triton_compat import tl, triton

QUANT_GROUP = 128  # channels per activation scale, as fp8_quant's default group
_QUANT_GROUP = tl.constexpr(QUANT_GROUP)
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


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
def _add_rescaled(acc, product, a_scale, b_scale_ptrs, ONE_B_SCALE: tl.constexpr):
    """acc [BM, BN] + product * a_scale [BM, 1] * b_scale: with ONE_B_SCALE b_scale_ptrs is
    one scale (folded into the row factor: one FMA per element), else [BN] of them."""
    if ONE_B_SCALE:  # one branch compiled (Triton 3.9 compiles code past an early return)
        acc = acc + product * (a_scale * tl.load(b_scale_ptrs))
    else:
        acc = acc + product * a_scale * tl.load(b_scale_ptrs)[None, :]
    return acc


@triton.jit
def _store_fp8_rows(values, rows, is_real, q_ptr, scale_ptr, first_col, N, stride_qm, stride_sm,
                    ROWS: tl.constexpr, COLS: tl.constexpr, ACT_DTYPE: tl.constexpr):  # fmt: skip
    """q[rows, first_col:+COLS] and scale[rows, first_col/128:+COLS/128] of values [ROWS, COLS]
    (float32), quantized as fp8_quant quantizes them once rounded to ACT_DTYPE ("bf16", "fp16"
    or "fp32", the activations' dtype without the fusion): the bytes and
    scales of writing them in ACT_DTYPE and quantizing that, without the second pass. COLS is a
    multiple of QUANT_GROUP and first_col starts a group (the launcher checks)."""
    groups: tl.constexpr = COLS // _QUANT_GROUP
    if ACT_DTYPE == "bf16":  # a name, not a dtype: sm_80's refusal of FP8 stays the only error
        values = values.to(tl.bfloat16).to(tl.float32)
    elif ACT_DTYPE == "fp16":
        values = values.to(tl.float16).to(tl.float32)
    x = tl.reshape(values, (ROWS, groups, _QUANT_GROUP))
    scale = tl.maximum(tl.max(tl.abs(x), 2) / _FP8_MAX, _MIN_SCALE)  # [ROWS, groups]
    q = _round_to_e4m3_grid(tl.clamp(x / scale[:, :, None], -_FP8_MAX, _FP8_MAX))
    q = tl.reshape(q, (ROWS, COLS))
    cols = first_col + tl.arange(0, COLS)
    row_offs = rows[:, None].to(tl.int64)
    tl.store(q_ptr + row_offs * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=is_real[:, None] & (cols[None, :] < N))  # fmt: skip
    group_cols = first_col // _QUANT_GROUP + tl.arange(0, groups)
    tl.store(scale_ptr + row_offs * stride_sm + group_cols[None, :], scale,
             mask=is_real[:, None] & (group_cols[None, :] < N // _QUANT_GROUP))  # fmt: skip


# Integer arguments that follow the step's token count: Triton would compile a kernel per value
# class (1, divisible by 16, other), each the first time a step met it, holding up that step and
# every request in flight (a fresh H100 compiled 8 such variants of these kernels for 7.3 s while
# serving: workers/kernel_compiles.py), so they are not specialized (do_not_specialize).
@triton.jit(do_not_specialize=["num_slots", "num_blocks_m"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, c_scale_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    N, K, num_slots, up_offset, num_blocks_m,
    stride_am, stride_be, stride_bn, stride_cm, stride_csm, stride_asm, stride_bse, stride_bsn,
    SLOTS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    USE_FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_LIMIT: tl.constexpr = False, LIMIT: tl.constexpr = 0.0, ONE_B_SCALE: tl.constexpr = False,
    QUANT_OUT: tl.constexpr = False, ACT_DTYPE: tl.constexpr = None,
):  # fmt: skip
    """c[slot, n] for one tile of sorted slots (one expert) and one tile of output columns.

    A row of a is slot // SLOTS_PER_A_ROW (x for gate+up, the slot's own act row for down).
    With FUSE_SILU, b rows n and up_offset + n are multiplied and combined as silu(gate) * up
    (with USE_LIMIT, gate clamped above and up both ways at LIMIT first: DeepSeek-V4).
    ONE_B_SCALE (FP8): the tile's gate rows, and its up rows, each lie in one weight-scale block
    (the launcher checks), so each K step's product is rescaled by one FMA per element with a
    per-row factor, not a multiply and an FMA (ncu, FP8 MoE at 4,096 tokens on an H100: FMUL
    was 17% of the gate+up kernel's instructions).
    QUANT_OUT (gate+up before FP8 experts): c is float8_e4m3fn and c_scale [slots, N/128] its
    scales, quantized per row and 128 columns here (_store_fp8_rows) instead of in a pass after.
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
        if ONE_B_SCALE:  # scalars: the tile's block row
            b_scale_ptrs = b_scale_ptr + expert * stride_bse
            b_scale_ptrs += (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn
            up_scale_ptrs = b_scale_ptrs + (up_offset // SCALE_BLOCK) * stride_bsn
        else:  # [BN]
            b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // SCALE_BLOCK) * stride_bsn
            up_scale_ptrs = b_scale_ptr + expert * stride_bse
            up_scale_ptrs += ((offs_n + up_offset) // SCALE_BLOCK) * stride_bsn
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
            acc = _add_rescaled(acc, tl.dot(a, b), a_scale, b_scale_ptrs + scale_col, ONE_B_SCALE)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if FUSE_SILU:
            up_offs = b_offs + up_offset * stride_bn
            up = _load_weight_tile(
                b_ptr, up_offs, b_row + up_offset, k_step, k_in, USE_TMA, EVEN_K, BLOCK_K
            )
            if USE_FP8:
                acc_up = _add_rescaled(acc_up, tl.dot(a, up), a_scale, up_scale_ptrs + scale_col,
                                       ONE_B_SCALE)  # fmt: skip
            else:
                acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
    _store_rows(acc, acc_up, slots, is_real, c_ptr, c_scale_ptr, topk_weights_ptr, pid_n, N,
                stride_cm, stride_csm, FUSE_SILU, MUL_WEIGHT, False, BLOCK_M, BLOCK_N,
                USE_LIMIT, LIMIT, QUANT_OUT, ACT_DTYPE)  # fmt: skip


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
    acc, acc_up, slots, is_real, c_ptr, c_scale_ptr, topk_weights_ptr, pid_n, N, stride_cm,
    stride_csm,
    FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, GATE_UP_ONE_DOT: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, USE_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    QUANT_OUT: tl.constexpr, ACT_DTYPE: tl.constexpr,
):  # fmt: skip
    """c[slot, cols] = silu(gate) * up (gate+up) or topk_weight[slot] * acc (down); with
    QUANT_OUT in FP8 with its scales (_store_fp8_rows).

    With GATE_UP_ONE_DOT, acc [R, BN] holds gate in its first BN/2 columns and up in the rest.
    """
    out_n: tl.constexpr = BLOCK_N // 2 if GATE_UP_ONE_DOT else BLOCK_N
    if GATE_UP_ONE_DOT:
        halves = tl.permute(tl.reshape(acc, (ROWS, 2, out_n)), (0, 2, 1))  # [R, BN/2, 2]
        acc, acc_up = tl.split(halves)  # gate, up [R, BN/2]
    if FUSE_SILU:
        acc, acc_up = clamp_gate_up(acc, acc_up, USE_LIMIT, LIMIT)
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + slots, mask=is_real, other=0.0)[:, None]
    if QUANT_OUT:
        _store_fp8_rows(acc, slots, is_real, c_ptr, c_scale_ptr, pid_n * out_n, N, stride_cm,
                        stride_csm, ROWS, out_n, ACT_DTYPE)  # fmt: skip
    else:
        cols = pid_n * out_n + tl.arange(0, out_n)
        c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
                 mask=is_real[:, None] & (cols[None, :] < N))  # fmt: skip


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


@triton.jit(do_not_specialize=["num_slots", "max_chunks"])  # as _moe_gemm_kernel
def _moe_chunk_gemm_kernel(
    a_ptr, b_ptr, c_ptr, c_scale_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
    sorted_slot_ids_ptr, block_expert_ids_ptr,
    chunk_first_tile_ptr, chunk_num_tiles_ptr, num_chunks_ptr,
    N, K, num_slots, up_offset, max_chunks,
    stride_am, stride_be, stride_bn, stride_cm, stride_csm, stride_asm, stride_bse, stride_bsn,
    SLOTS_PER_A_ROW: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    USE_FP8: tl.constexpr, SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GATE_UP_ONE_DOT: tl.constexpr, WITH_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, USE_LIMIT: tl.constexpr = False, LIMIT: tl.constexpr = 0.0,
    QUANT_OUT: tl.constexpr = False, ACT_DTYPE: tl.constexpr = None,
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
        _store_rows(tail, tail_up, tail_slots, tail_is_real, c_ptr, c_scale_ptr,
                    topk_weights_ptr, pid_n, N, stride_cm, stride_csm, FUSE_SILU, MUL_WEIGHT,
                    GATE_UP_ONE_DOT, TAIL_M, BLOCK_N, USE_LIMIT, LIMIT, QUANT_OUT,
                    ACT_DTYPE)  # fmt: skip
    _store_rows(acc, acc_up, slots, is_real, c_ptr, c_scale_ptr, topk_weights_ptr, pid_n, N,
                stride_cm, stride_csm, FUSE_SILU, MUL_WEIGHT, GATE_UP_ONE_DOT, BLOCK_M, BLOCK_N,
                USE_LIMIT, LIMIT, QUANT_OUT, ACT_DTYPE)  # fmt: skip


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
