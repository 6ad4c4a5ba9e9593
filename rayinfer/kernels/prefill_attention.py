"""Causal flash attention over packed variable-length sequences (prefill and chunked prefill).

Sequence b owns queries `cu_seqlens_q[b]:cu_seqlens_q[b+1]`: the last q tokens of its s-token
context (causal mask aligned bottom-right, as flash-attn's varlen: query j sits at position
s - q + j). Its keys/values come from one of two places:
- contiguous: `key`/`value` rows `cu_seqlens_k[b]:cu_seqlens_k[b+1]` (plain prefill, MLA's
  expanded form);
- paged: the layer cache `[num_blocks, block_size, 2, Hkv, D]` through `block_tables[b]`, with
  `seq_lens[b]` tokens (chunked prefill over a cached prefix: the new tokens are already written).
GQA: query head h reads kv head h // (Hq / Hkv). The query/key head dim may differ from the value
head dim (MLA: 192 = 128 nope + 64 rope, value 128); a non-power-of-two qk dim is split into a
power-of-two part and a remainder so no FLOPs go to padding.

Launch options beyond the tile sizes (keys of configs/prefill_attention.json, off when absent):
- USE_TMA: contiguous Q/K/V/O through per-(sequence, head) TMA descriptors (Hopper+, 16-byte
  aligned rows); their bounds zero-fill the rows past a sequence, so no row masks or pointer math;
- PIPELINE_QK: software pipelining by one key tile: the P.V product of tile j-1 is issued
  (asynchronously) before the softmax of tile j, so the tensor cores have work while it runs;
- HEADS_FASTEST: heads vary fastest in the grid: a wave holds the heaviest query tiles of every
  head (longest first over the whole grid), and a GQA group's heads run side by side on one K/V;
- WARP_SPECIALIZE: `tl.range(..., warp_specialize=True)` on the unmasked loop when it is not
  PIPELINE_QK's, with USE_TMA only (the paged and unaligned pointer paths run without it); an
  sm_90a compile (triton 3.9) gets no warp partitions from it on Hopper: same code as without;
- "paged" (a dict of the above and tiles): overrides for paged_prefill_attention, whose K/V
  always load through pointers (an sm_90a compile of 128x64/8 pointer tiles spills registers);
- CONDITIONAL_RESCALE: the running max moves only when some row of the tile grew by more than
  RESCALE_THRESHOLD (8, log2 units): otherwise the tile's probabilities are taken against the old
  max (each <= 2**8, exact after the final division by the sum, which carries the same factor)
  and the [BLOCK_M, BLOCK_DV] rescale of the accumulator is skipped by a scalar branch (FA3's
  trick; past the first few key tiles the max rarely moves that much).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from rayinfer.kernels.paged_attention import (
    causal_attention,
    dot_precision,
    launch_params,
    paged_decode_attention,
)
from rayinfer.kernels.triton_compat import tl, triton

LAUNCH_OPTIONS = dict(USE_TMA=False, PIPELINE_QK=False, HEADS_FASTEST=False, WARP_SPECIALIZE=False,
                      CONDITIONAL_RESCALE=False)  # fmt: skip
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


@triton.jit
def _program_coordinates(HEADS_FASTEST: tl.constexpr):
    """(query tile, sequence, head) of this program. Query tiles run heaviest (last, under the
    causal mask) first: less tail imbalance."""
    if HEADS_FASTEST:
        head = tl.program_id(0)
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
        seq = tl.program_id(2)
    else:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
    return tile, seq, head


@triton.jit
def _load_query(q_ptr, first_row, q_len, stride_qt, qk_scale, NUM_COLS: tl.constexpr,
                BLOCK_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                USE_TMA: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_COLS] query rows first_row.. of the sequence's head (q_ptr: its first
    row and column), scaled by qk_scale."""
    if USE_TMA:
        source = _rows_source(q_ptr, q_len, stride_qt, NUM_COLS, BLOCK_M, BLOCK_COLS, True)
        q = source.load([first_row, 0])
    else:
        offs_m = first_row + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_COLS)
        q = _load_rows(q_ptr, offs_m.to(tl.int64), offs_d, stride_qt, NUM_COLS, offs_m < q_len,
                       NUM_COLS != BLOCK_COLS, True)  # fmt: skip
    return (q * qk_scale).to(q_ptr.dtype.element_ty)


@triton.jit
def _store_output(out_head_ptr, out, first_row, q_len, stride_ot,
                  HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                  USE_TMA: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_DV] out -> rows first_row.. of the sequence's output, in bounds only."""
    out = out.to(out_head_ptr.dtype.element_ty)
    if USE_TMA:
        target = _rows_source(out_head_ptr, q_len, stride_ot, HEAD_DIM_V, BLOCK_M, BLOCK_DV, True)
        target.store([first_row, 0], out)
    else:
        offs_m = first_row + tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        ptrs = out_head_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_dv[None, :]
        tl.store(ptrs, out, mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, kv_lens_ptr,
    scale, num_queries_per_kv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_block_table,
    HEAD_DIM0: tl.constexpr, HEAD_DIM1: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_PAGED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, PIPELINE_QK: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, CONDITIONAL_RESCALE: tl.constexpr,
):  # fmt: skip
    tile, seq, head = _program_coordinates(HEADS_FASTEST)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    kv_head = head // num_queries_per_kv
    k_head_ptr = k_ptr + kv_head * stride_kh  # paged: rows are slots of the whole cache
    v_head_ptr = v_ptr + kv_head * stride_vh
    if IS_PAGED:
        kv_len = tl.load(kv_lens_ptr + seq)
    else:
        k_start = tl.load(kv_lens_ptr + seq)
        kv_len = tl.load(kv_lens_ptr + seq + 1) - k_start
        k_head_ptr += k_start.to(tl.int64) * stride_kt  # contiguous: rows are positions
        v_head_ptr += k_start.to(tl.int64) * stride_vt
    first_row = tile * BLOCK_M  # of this tile, in the sequence's queries
    offs_m_pos = kv_len - q_len + first_row + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions
    q_head_ptr = q_ptr + q_start.to(tl.int64) * stride_qt + head * stride_qh
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 instead of exp
    q0 = _load_query(q_head_ptr, first_row, q_len, stride_qt, qk_scale, HEAD_DIM0, BLOCK_D0,
                     BLOCK_M, USE_TMA)  # fmt: skip
    q1 = q0
    k_source0 = _rows_source(k_head_ptr, kv_len, stride_kt, HEAD_DIM0, BLOCK_N, BLOCK_D0, USE_TMA)
    k_source1 = k_source0
    if HEAD_DIM1 > 0:
        q1 = _load_query(q_head_ptr + HEAD_DIM0, first_row, q_len, stride_qt, qk_scale,
                         HEAD_DIM1, BLOCK_D1, BLOCK_M, USE_TMA)  # fmt: skip
        k_source1 = _rows_source(k_head_ptr + HEAD_DIM0, kv_len, stride_kt, HEAD_DIM1, BLOCK_N,
                                 BLOCK_D1, USE_TMA)  # fmt: skip
    v_source = _rows_source(v_head_ptr, kv_len, stride_vt, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if IS_CAUSAL:
        first_pos = kv_len - q_len + first_row
        unmasked_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        masked_end = tl.minimum(kv_len, first_pos + BLOCK_M)
    else:
        unmasked_end = (kv_len // BLOCK_N) * BLOCK_N
        masked_end = kv_len
    table_ptr = block_tables_ptr + seq * stride_block_table
    if PIPELINE_QK:
        acc, m_i, l_i = _attend_tiles_pipelined(
            acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, table_ptr, offs_m_pos,
            0, unmasked_end, kv_len, stride_kt, stride_vt, HEAD_DIM0, HEAD_DIM1, HEAD_DIM_V,
            BLOCK_D0, BLOCK_D1, BLOCK_DV, BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA, False,
            IS_CAUSAL, DOT_PRECISION, CONDITIONAL_RESCALE,
        )  # fmt: skip
    else:
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, table_ptr, offs_m_pos,
            0, unmasked_end, kv_len, stride_kt, stride_vt, HEAD_DIM0, HEAD_DIM1, HEAD_DIM_V,
            BLOCK_D0, BLOCK_D1, BLOCK_DV, BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA, False,
            IS_CAUSAL, WARP_SPECIALIZE, DOT_PRECISION, CONDITIONAL_RESCALE,
        )  # fmt: skip
    # The diagonal (and the ragged end): the only tiles that need the mask.
    if PIPELINE_QK:
        acc, m_i, l_i = _attend_tiles_pipelined(
            acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, table_ptr, offs_m_pos,
            unmasked_end, masked_end, kv_len, stride_kt, stride_vt, HEAD_DIM0, HEAD_DIM1,
            HEAD_DIM_V, BLOCK_D0, BLOCK_D1, BLOCK_DV, BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA,
            True, IS_CAUSAL, DOT_PRECISION, CONDITIONAL_RESCALE,
        )  # fmt: skip
    else:
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q0, q1, k_source0, k_source1, v_source, table_ptr, offs_m_pos,
            unmasked_end, masked_end, kv_len, stride_kt, stride_vt, HEAD_DIM0, HEAD_DIM1,
            HEAD_DIM_V, BLOCK_D0, BLOCK_D1, BLOCK_DV, BLOCK_N, BLOCK_SIZE, IS_PAGED, USE_TMA,
            True, IS_CAUSAL, False, DOT_PRECISION, CONDITIONAL_RESCALE,
        )  # fmt: skip
    out_head_ptr = out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh
    _store_output(out_head_ptr, acc / l_i[:, None], first_row, q_len, stride_ot, HEAD_DIM_V,
                  BLOCK_DV, BLOCK_M, USE_TMA)  # fmt: skip


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """qk head dim -> (power-of-two part, remainder): 128 -> (128, 0), 192 -> (128, 64)."""
    main = 1 << (head_dim.bit_length() - 1)
    return (head_dim, 0) if main == head_dim else (main, head_dim - main)


def _check(query, key, value, cu_seqlens_q, kv_lens):
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"query {query.shape}, key {key.shape}, value {value.shape} must be 3-D")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} not a multiple of kv heads {key.shape[1]}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query head dim {query.shape[-1]} != key head dim {key.shape[-1]}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; call .contiguous()")
    if cu_seqlens_q.dtype != torch.int32 or kv_lens.dtype != torch.int32:
        raise ValueError("cu_seqlens_q / seq lens must be int32 (AttentionMetadata's dtype)")


def _tma_fits(tensors: tuple[torch.Tensor, ...], column_offsets: tuple[int, ...]) -> bool:
    """TMA descriptors need 16-byte aligned bases, row and head strides (and split columns);
    Hopper or newer on CUDA (the interpreter accepts them on CPU)."""
    device = tensors[0].device
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    for t in tensors:
        size = t.element_size()
        byte_offsets = (t.data_ptr(), t.stride(0) * size, t.stride(1) * size)
        if any(offset % 16 for offset in byte_offsets + tuple(c * size for c in column_offsets)):
            return False
    return True


def _tma_scratch_allocator(device: torch.device):
    """Global scratch for the descriptors a kernel builds on device (128 bytes per program)."""
    return lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)


def _launch_options(params: dict, tensors, column_offsets, is_paged: bool) -> dict:
    """The config's launch options (LAUNCH_OPTIONS's defaults where absent); TMA only where it
    can run: contiguous K/V with aligned rows, and warp specialization only with TMA."""
    options = {name: bool(params.get(name, default)) for name, default in LAUNCH_OPTIONS.items()}
    options["USE_TMA"] = options["USE_TMA"] and not is_paged and _tma_fits(tensors, column_offsets)
    # Warp specialization was only ever compiled and timed over TMA loads: off on pointer paths.
    options["WARP_SPECIALIZE"] = options["WARP_SPECIALIZE"] and options["USE_TMA"]
    if options["USE_TMA"] and tensors[0].device.type == "cuda":
        triton.set_allocator(_tma_scratch_allocator(tensors[0].device))  # per thread: set here
    return options


def _grid(num_tiles: int, num_seqs: int, num_heads: int, heads_fastest: bool) -> tuple:
    return (num_heads, num_tiles, num_seqs) if heads_fastest else (num_tiles, num_seqs, num_heads)


def _launch(query, key, value, out, block_tables, cu_seqlens_q, kv_lens, scale, is_paged,
            block_size, max_query_len, is_causal):  # fmt: skip
    num_seqs, num_heads = cu_seqlens_q.shape[0] - 1, query.shape[1]
    dim0, dim1 = split_head_dim(query.shape[-1])
    # Buckets by qk head dim: MLA's 192/128 tiles need less shared memory than 128/128's.
    params = launch_params("prefill_attention", query.device, query.shape[-1])
    if is_paged:  # K/V through block tables and pointers: the entry's "paged" tiles, if it has any
        params = {**params, **(params.get("paged") or {})}
    block_m, block_n = params["BLOCK_M"], params["BLOCK_N"]
    options = _launch_options(params, (query, key, value, out), (dim0,), is_paged)
    num_tiles = triton.cdiv(max(max_query_len, 1), block_m)
    grid = _grid(num_tiles, num_seqs, num_heads, options["HEADS_FASTEST"])
    _prefill_attention_kernel[grid](
        query, key, value, out, block_tables, cu_seqlens_q, kv_lens,
        scale, num_heads // key.shape[1],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        HEAD_DIM0=dim0, HEAD_DIM1=dim1, HEAD_DIM_V=value.shape[-1],
        BLOCK_D0=triton.next_power_of_2(dim0), BLOCK_D1=max(16, triton.next_power_of_2(dim1)),
        BLOCK_DV=triton.next_power_of_2(value.shape[-1]),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        IS_PAGED=is_paged, IS_CAUSAL=is_causal, DOT_PRECISION=dot_precision(query.dtype),
        **options, num_warps=params["num_warps"], num_stages=params["num_stages"],
    )  # fmt: skip
    return out


def prefill_attention(
    query: torch.Tensor,  # [T, Hq, Dqk]: packed queries of all sequences
    key: torch.Tensor,  # [S, Hkv, Dqk]: packed keys of all sequences' contexts
    value: torch.Tensor,  # [S, Hkv, Dv]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32: query rows of each sequence
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32: key rows of each sequence (q_len <= kv_len)
    max_query_len: int,
    scale: float,
    is_causal: bool = True,
) -> torch.Tensor:  # [T, Hq, Dv]
    """Varlen flash attention over contiguous K/V; the queries are each context's last tokens."""
    _check(query, key, value, cu_seqlens_q, cu_seqlens_k)
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    no_table = cu_seqlens_q  # unused when not paged; any int32 tensor
    return _launch(query, key, value, out, no_table[None], cu_seqlens_q, cu_seqlens_k, scale,
                   False, 1, max_query_len, is_causal)  # fmt: skip


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]: new tokens already written
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor,  # [B] int32: context length after this step
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new tokens over its whole paged context."""
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [blocks, bs, 2, Hkv, D]")
    slots = kv_cache.flatten(0, 1)  # [num_slots, 2, Hkv, D]
    key, value = slots[:, 0], slots[:, 1]  # [num_slots, Hkv, D] views, slot stride 2*Hkv*D
    _check(query, key, value, query_start_loc, seq_lens)
    out = torch.empty_like(query)
    return _launch(query, key, value, out, block_tables, query_start_loc, seq_lens, scale, True,
                   kv_cache.shape[1], max_query_len, True)  # fmt: skip


def prefill_attention_reference(query, key, value, cu_seqlens_q, cu_seqlens_k, max_query_len,
                                scale, is_causal=True):  # fmt: skip
    """Per-sequence SDPA: same contract as `prefill_attention`."""
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for seq in range(len(q_starts) - 1):
        rows = slice(q_starts[seq], q_starts[seq + 1])
        keys = slice(k_starts[seq], k_starts[seq + 1])
        if is_causal:
            out[rows] = causal_attention(query[rows], key[keys], value[keys], scale)
        else:
            q, k, v = (t.transpose(0, 1) for t in (query[rows], key[keys], value[keys]))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            gqa = q.shape[0] != k.shape[0]
            out[rows] = sdpa(q, k, v, scale=scale, enable_gqa=gqa).transpose(0, 1)
    return out


def paged_mixed_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]: new tokens already written
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    query_lens: list[int],  # [B] on the host
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """A scheduler batch: its decodes (one query) through the split-K decode kernel, which reads
    each kv head once for its whole query group and splits long contexts over programs; its
    prefill chunks through the varlen kernel. Either kernel alone when the batch is pure."""
    chunk_seqs = [i for i, n in enumerate(query_lens) if n > 1]
    if not chunk_seqs:
        return paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale)
    if len(chunk_seqs) == len(query_lens):
        return paged_prefill_attention(query, kv_cache, block_tables, seq_lens, query_start_loc,
                                       max(query_lens), scale)  # fmt: skip
    starts = list(accumulate(query_lens, initial=0))
    decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
    chunk_lens = [query_lens[i] for i in chunk_seqs]
    chunk_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chunk_seqs])
    device = query.device
    decode_idx, chunk_idx = (torch.tensor(s, device=device) for s in (decode_seqs, chunk_seqs))
    decode_rows = torch.tensor([starts[i] for i in decode_seqs], device=device)
    chunk_rows = chunk_rows.to(device, non_blocking=True)
    cu_seqlens = torch.tensor([0, *accumulate(chunk_lens)], dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    out[decode_rows] = paged_decode_attention(
        query[decode_rows], kv_cache, block_tables[decode_idx], seq_lens[decode_idx], scale
    )
    out[chunk_rows] = paged_prefill_attention(
        query[chunk_rows], kv_cache, block_tables[chunk_idx], seq_lens[chunk_idx], cu_seqlens,
        max(chunk_lens), scale,
    )  # fmt: skip
    return out
