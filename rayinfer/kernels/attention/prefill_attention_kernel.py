"""The prefill attention kernel: one program per (query tile, sequence, head) runs the unmasked
key tiles, then the diagonal, and stores its output rows (and, with STORE_LSE, their softmax
log-sum-exp, so that attention over parts of a context can be merged). Launched by
prefill_attention._launch.
"""

from __future__ import annotations

from rayinfer.kernels.attention.prefill_attention_tiles import (
    _attend_tiles,
    _attend_tiles_pipelined,
    _load_rows,
    _rows_source,
)
from rayinfer.kernels.triton_compat import tl, triton


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
def _store_lse(lse_head_ptr, m_i, l_i, first_row, q_len, stride_lse_t, BLOCK_M: tl.constexpr):
    """Rows first_row.. of the sequence's log-sum-exp [BLOCK_M] float32, natural log of the
    scaled scores: m_i and l_i are the running max (log2 units) and sum."""
    offs_m = first_row + tl.arange(0, BLOCK_M)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 -> natural log
    tl.store(lse_head_ptr + offs_m.to(tl.int64) * stride_lse_t, lse, mask=offs_m < q_len)


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, block_tables_ptr, cu_seqlens_q_ptr, kv_lens_ptr,
    scale, num_queries_per_kv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_lse_t, stride_lse_h, stride_block_table,
    HEAD_DIM0: tl.constexpr, HEAD_DIM1: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_PAGED: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, PIPELINE_QK: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, CONDITIONAL_RESCALE: tl.constexpr, STORE_LSE: tl.constexpr,
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
    if STORE_LSE:
        lse_head_ptr = lse_ptr + q_start.to(tl.int64) * stride_lse_t + head * stride_lse_h
        _store_lse(lse_head_ptr, m_i, l_i, first_row, q_len, stride_lse_t, BLOCK_M)
