"""Jit building blocks of the prefill attention kernel: key/value tile loads (pointers through
block tables, or TMA descriptors), the scores of a key tile, the online softmax, and the loops
over key tiles (plain, warp-specialized, or software-pipelined by one tile). See prefill_attention
for the launch options they implement.
"""

from __future__ import annotations

from rayinfer.kernels.triton_compat import tl, triton

# CONDITIONAL_RESCALE's bound on how far (log2 units) the running max may lag a row's true max.
RESCALE_THRESHOLD = tl.constexpr(8.0)


@triton.jit
def _load_rows(ptr, rows, offs_d, stride_row, HEAD_DIM: tl.constexpr, row_mask,
               IS_DIM_PADDED: tl.constexpr, IS_ROW_MASKED: tl.constexpr):  # fmt: skip
    """[BLOCK_N] row ids -> [BLOCK_N, BLOCK_D] tile. Masks only where asked: a column mask on
    an unpadded head dim would cost the loads their vector width."""
    ptrs = ptr + rows[:, None] * stride_row + offs_d[None, :]
    if IS_DIM_PADDED:
        tile = tl.load(ptrs, mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif IS_ROW_MASKED:
        tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _key_rows(block_table_ptr, offs_n, IS_PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Context positions [BLOCK_N] -> row (slot) ids, relative to the sequence's first row."""
    if IS_PAGED:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
        rows = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    else:
        rows = offs_n.to(tl.int64)
    return rows


@triton.jit
def _rows_source(ptr, num_rows, stride_row, NUM_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_COLS: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    """The [num_rows, NUM_COLS] row-major slice at `ptr`: a TMA descriptor (reads past its
    bounds give zeros, writes past them are dropped), or `ptr` itself for pointer loads."""
    if USE_TMA:
        source = tl.make_tensor_descriptor(ptr, shape=[num_rows, NUM_COLS],
                                           strides=[stride_row, 1],
                                           block_shape=[BLOCK_ROWS, BLOCK_COLS])  # fmt: skip
    else:
        source = ptr
    return source


@triton.jit
def _kv_tile(source, block_table_ptr, start_n, kv_len, stride_row, NUM_COLS: tl.constexpr,
             BLOCK_COLS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             IS_PAGED: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_COLS] key/value rows at context positions start_n.. of `source` (a
    descriptor, or a pointer to the head's first column); rows past kv_len (only in MASKED tiles)
    and padded columns read as zeros."""
    if USE_TMA:
        tile = source.load([start_n, 0])
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        in_bounds = offs_n < kv_len
        if MASKED:
            offs_n = tl.where(in_bounds, offs_n, 0)  # never read the block table past its end
        rows = _key_rows(block_table_ptr, offs_n, IS_PAGED, BLOCK_SIZE)
        offs_d = tl.arange(0, BLOCK_COLS)
        tile = _load_rows(source, rows, offs_d, stride_row, NUM_COLS, in_bounds,
                          NUM_COLS != BLOCK_COLS, MASKED)  # fmt: skip
    return tile


@triton.jit
def _scores(q0, q1, k_source0, k_source1, block_table_ptr, start_n, kv_len, stride_kt,
            HEAD_DIM0: tl.constexpr, HEAD_DIM1: tl.constexpr, BLOCK_D0: tl.constexpr,
            BLOCK_D1: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            IS_PAGED: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr,
            DOT_PRECISION: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_N] logits (log2 units: q is pre-scaled) of key tile start_n.."""
    k0 = _kv_tile(k_source0, block_table_ptr, start_n, kv_len, stride_kt, HEAD_DIM0, BLOCK_D0,
                  BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA, MASKED)  # fmt: skip
    qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
    if HEAD_DIM1 > 0:
        k1 = _kv_tile(k_source1, block_table_ptr, start_n, kv_len, stride_kt, HEAD_DIM1,
                      BLOCK_D1, BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA, MASKED)  # fmt: skip
        qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def _softmax_probs(qk, m_i, l_i, start_n, offs_m_pos, kv_len, BLOCK_N: tl.constexpr,
                   MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   CONDITIONAL_RESCALE: tl.constexpr):  # fmt: skip
    """Online softmax of one [BLOCK_M, BLOCK_N] logit tile: its probabilities p (relative to the
    new running max), the factor alpha [BLOCK_M] that rescales what was accumulated before, the
    new running max and sum [BLOCK_M], and whether acc needs alpha (a scalar; always with
    CONDITIONAL_RESCALE off)."""
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = offs_n[None, :] < kv_len
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
    if CONDITIONAL_RESCALE:
        # Keep the old max unless some row's grew by more than RESCALE_THRESHOLD (log2 units):
        # p stays <= 2**RESCALE_THRESHOLD, and alpha is exactly 1 (acc's rescale is skipped).
        # One block-wide reduction per tile (the row maxima above stay within a warp).
        grew = tl.max((m_new > m_i + RESCALE_THRESHOLD).to(tl.int32), 0) > 0
        m_new = tl.where(grew, m_new, m_i)
    else:
        grew = tl.full((), 1, tl.int32) > 0
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i, grew


@triton.jit
def _rescaled(acc, alpha, grew, CONDITIONAL_RESCALE: tl.constexpr):
    """acc * alpha per row; with CONDITIONAL_RESCALE only when the max moved (`grew`, a scalar
    branch): the common case skips the [BLOCK_M, BLOCK_DV] multiply."""
    if CONDITIONAL_RESCALE:
        if grew:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    return acc


@triton.jit
def _softmax_step(acc, m_i, l_i, qk, v, start_n, offs_m_pos, kv_len, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, CONDITIONAL_RESCALE: tl.constexpr):  # fmt: skip
    """Fold one [BLOCK_M, BLOCK_N] logit tile and its [BLOCK_N, BLOCK_DV] values into acc
    [BLOCK_M, BLOCK_DV] and the running max m_i and sum l_i [BLOCK_M]."""
    p, alpha, m_i, l_i, grew = _softmax_probs(qk, m_i, l_i, start_n, offs_m_pos, kv_len,
                                              BLOCK_N, MASKED, IS_CAUSAL,
                                              CONDITIONAL_RESCALE)  # fmt: skip
    acc = _rescaled(acc, alpha, grew, CONDITIONAL_RESCALE)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, block_table_ptr, offs_m_pos,
    start_n, kv_len, stride_kt, stride_vt,
    HEAD_DIM0: tl.constexpr, HEAD_DIM1: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_PAGED: tl.constexpr,
    USE_TMA: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CONDITIONAL_RESCALE: tl.constexpr,
):  # fmt: skip
    """Key tile start_n..: scores, values, online softmax."""
    qk = _scores(q0, q1, k_source0, k_source1, block_table_ptr, start_n, kv_len, stride_kt,
                 HEAD_DIM0, HEAD_DIM1, BLOCK_D0, BLOCK_D1, BLOCK_N, BLOCK_SIZE, IS_PAGED,
                 USE_TMA, MASKED, DOT_PRECISION)  # fmt: skip
    v = _kv_tile(v_source, block_table_ptr, start_n, kv_len, stride_vt, HEAD_DIM_V, BLOCK_DV,
                 BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA, MASKED)  # fmt: skip
    return _softmax_step(acc, m_i, l_i, qk, v, start_n, offs_m_pos, kv_len, BLOCK_N, MASKED,
                         IS_CAUSAL, DOT_PRECISION, CONDITIONAL_RESCALE)  # fmt: skip


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, block_table_ptr, offs_m_pos,
    lo, hi, kv_len, stride_kt, stride_vt,
    HEAD_DIM0: tl.constexpr, HEAD_DIM1: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_PAGED: tl.constexpr,
    USE_TMA: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CONDITIONAL_RESCALE: tl.constexpr,
):  # fmt: skip
    """Key tiles [lo, hi) one after the other (`tl.range`'s warp specialization only when asked:
    a plain loop otherwise)."""
    if WARP_SPECIALIZE:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, block_table_ptr,
                offs_m_pos, start_n, kv_len, stride_kt, stride_vt, HEAD_DIM0, HEAD_DIM1,
                HEAD_DIM_V, BLOCK_D0, BLOCK_D1, BLOCK_DV, BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA,
                MASKED, IS_CAUSAL, DOT_PRECISION, CONDITIONAL_RESCALE,
            )  # fmt: skip
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, block_table_ptr,
                offs_m_pos, start_n, kv_len, stride_kt, stride_vt, HEAD_DIM0, HEAD_DIM1,
                HEAD_DIM_V, BLOCK_D0, BLOCK_D1, BLOCK_DV, BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA,
                MASKED, IS_CAUSAL, DOT_PRECISION, CONDITIONAL_RESCALE,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _attend_tiles_pipelined(
    acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, block_table_ptr, offs_m_pos,
    lo, hi, kv_len, stride_kt, stride_vt,
    HEAD_DIM0: tl.constexpr, HEAD_DIM1: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_PAGED: tl.constexpr,
    USE_TMA: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CONDITIONAL_RESCALE: tl.constexpr,
):  # fmt: skip
    """Key tiles [lo, hi), software-pipelined by one tile: iteration j issues the scores of tile
    j, then the P.V product of tile j-1 (asynchronous: it chains on acc), then runs the softmax
    of tile j while the tensor cores work on that product. The diagonal goes through this loop
    too (MASKED): a plain loop after it made ptxas serialize every wgmma of the kernel."""
    if lo < hi:
        qk = _scores(q0, q1, k_source0, k_source1, block_table_ptr, lo, kv_len, stride_kt,
                     HEAD_DIM0, HEAD_DIM1, BLOCK_D0, BLOCK_D1, BLOCK_N, BLOCK_SIZE, IS_PAGED,
                     USE_TMA, MASKED, DOT_PRECISION)  # fmt: skip
        p, alpha, m_i, l_i, grew = _softmax_probs(qk, m_i, l_i, lo, offs_m_pos, kv_len,
                                                  BLOCK_N, MASKED, IS_CAUSAL,
                                                  CONDITIONAL_RESCALE)  # fmt: skip
        for start_n in range(lo + BLOCK_N, hi, BLOCK_N):
            qk = _scores(q0, q1, k_source0, k_source1, block_table_ptr, start_n, kv_len,
                         stride_kt, HEAD_DIM0, HEAD_DIM1, BLOCK_D0, BLOCK_D1, BLOCK_N,
                         BLOCK_SIZE, IS_PAGED, USE_TMA, MASKED, DOT_PRECISION)  # fmt: skip
            v = _kv_tile(v_source, block_table_ptr, start_n - BLOCK_N, kv_len, stride_vt,
                         HEAD_DIM_V, BLOCK_DV, BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA,
                         MASKED)  # fmt: skip
            acc = _rescaled(acc, alpha, grew, CONDITIONAL_RESCALE)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            p, alpha, m_i, l_i, grew = _softmax_probs(qk, m_i, l_i, start_n, offs_m_pos,
                                                      kv_len, BLOCK_N, MASKED, IS_CAUSAL,
                                                      CONDITIONAL_RESCALE)  # fmt: skip
        last_n = lo + ((hi - lo - 1) // BLOCK_N) * BLOCK_N  # hi - lo: any length (the diagonal)
        v = _kv_tile(v_source, block_table_ptr, last_n, kv_len, stride_vt, HEAD_DIM_V, BLOCK_DV,
                     BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA, MASKED)  # fmt: skip
        acc = _rescaled(acc, alpha, grew, CONDITIONAL_RESCALE)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i
