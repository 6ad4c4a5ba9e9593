"""Causal varlen prefill attention for Hopper (sm_90), warp-specialized in Gluon.

The Triton kernel (prefill_attention_kernel) stops at ~0.8x of cuDNN on an H200: its loop waits
for every wgmma, then a CTA-wide barrier, so the softmax of a tile never overlaps a matrix product
(`benchmarks/sweep_prefill_attention.py`). Here the roles are split, as in FlashAttention-3:
- a producer warp streams K and V tiles by TMA into a ring of STAGES slots (mbarriers: "ready"
  when a slot's bytes landed, "empty" when both consumers are done with it);
- two consumer warpgroups, each with 64 of the program's 128 query rows, take turns on the
  tensor cores (two `turn` mbarriers): a consumer issues its QK^T for tile j and its PV for tile
  j-1, hands the turn over, then runs the softmax of tile j while its own PV and the other
  consumer's products run.

One program per (head, 128-query tile, sequence), heads fastest and heaviest tiles first, as
the Triton kernel. Q/K/V are [tokens, heads, dim] views whose rows are 16-byte aligned (a value
split off a wider projection works: each is read through a 2-D TMA descriptor over its rows,
[tokens, row stride], at column head * head stride). A tile that runs past its sequence reads
the next one's rows (or TMA's zeros past the tensor), which the mask hides. The value head dim
is 128; the query/key head dim 128, or 192 = 128 + 64 (DeepSeek's MLA prefill: the 64 rope
columns run as a second product into the same scores). bf16, causal, contiguous K/V (no block
tables): what the config's `"backend": "gluon_ws"` sends here (prefill_attention._launch).
"""

from __future__ import annotations

import torch

from rayinfer.kernels.gluon_compat import (
    HAS_GLUON,
    gl,
    gluon,
    mbarrier,
    rows_descriptor,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from rayinfer.kernels.triton_compat import tma_rows_fit, triton

HEAD_DIM = 128  # the value's head dim, and the first (or only) block of the query/key's
ROPE_DIM = 64  # MLA's extra query/key columns
BLOCK_M = 128  # query rows per program: two consumers of HALF_M rows
HALF_M = 64
BLOCK_N = 128  # keys per tile
LOG2E = 1.4426950408889634
# Registers per thread: launched at 168 x 12 warps (a full register file), the consumers grow to
# 240 and the producer shrinks to 24 (`setmaxnreg`).
LAUNCH_REGISTERS = 168
CONSUMER_REGISTERS = 240
PRODUCER_REGISTERS = 24

if HAS_GLUON:
    # K/V ring slots. Shared memory: 160 KiB at head dim 128, 208 KiB at MLA's 192.
    STAGES = gl.constexpr(2)
    CONSUMER_REGISTERS_C = gl.constexpr(CONSUMER_REGISTERS)
    PRODUCER_REGISTERS_C = gl.constexpr(PRODUCER_REGISTERS)

    @gluon.jit
    def _producer(ctx, WG: gl.constexpr):
        """One warp: Q once (both halves), then K and V of every tile into the ring."""
        descs, smem, bars, rows0, lens, cols, first_row, n_tiles, out, qk_scale = ctx
        q_desc, q1_desc, k_desc, k1_desc, v_desc = descs
        q_smem, q1_smem, k_smem, k1_smem, v_smem = smem
        q_bar, k_ready, k_empty, v_ready, v_empty, turns = bars
        q_row0, k_row0 = rows0
        q_col, q1_col, k_col, k1_col, v_col = cols
        half: gl.constexpr = q_desc.block_type.shape[0]
        block_n: gl.constexpr = k_desc.block_type.shape[0]
        has_rope: gl.constexpr = q1_desc.block_type.shape[1] != q_desc.block_type.shape[1]
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + has_rope * q1_desc.block_type.nbytes
        k_bytes: gl.constexpr = k_desc.block_type.nbytes + has_rope * k1_desc.block_type.nbytes
        mbarrier.expect(q_bar, 2 * q_bytes)
        for i in gl.static_range(2):
            row = q_row0 + first_row + i * half
            tma_load(q_desc, [row, q_col], q_bar, q_smem.index(i))
            if has_rope:
                tma_load(q1_desc, [row, q1_col], q_bar, q1_smem.index(i))
        for j in range(n_tiles):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            row = k_row0 + j * block_n
            mbarrier.wait(k_empty.index(slot), phase ^ 1)  # fresh barriers: phase 1 is done
            mbarrier.expect(k_ready.index(slot), k_bytes)
            tma_load(k_desc, [row, k_col], k_ready.index(slot), k_smem.index(slot))
            if has_rope:
                tma_load(k1_desc, [row, k1_col], k_ready.index(slot), k1_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma_load(v_desc, [row, v_col], v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _scores(q, q1, k, k1, s_zero, has_rope: gl.constexpr):
        """Q K^T of one tile, issued asynchronously ([64, BLOCK_N]; with the rope columns, a
        second product accumulates into the first)."""
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if has_rope:
            s = warpgroup_mma(q1, k1.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _online_softmax(s, m_i, l_i, start_n, positions, cols, kv_len, first_position, qk_scale,
                        p_layout: gl.constexpr):  # fmt: skip
        """One [64, BLOCK_N] score tile -> its probabilities (as the PV product's register
        operand), the factor alpha [64] for what was accumulated before, the new running max
        and sum [64]. Only tiles reaching past the consumer's first row or the context mask."""
        block_n: gl.constexpr = s.type.shape[1]
        if (start_n + block_n - 1 > first_position) | (start_n + block_n > kv_len):
            keys = start_n + cols  # [BLOCK_N]
            visible = (keys[None, :] <= positions[:, None]) & (keys[None, :] < kv_len)
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return gl.convert_layout(p.to(gl.bfloat16), p_layout), alpha, m_new, l_i

    @gluon.jit
    def _consumer(ctx, WG: gl.constexpr):
        """A warpgroup: rows WG*64.. of the program's query tile, over every key tile."""
        descs, smem, bars, rows0, lens, cols, first_row, n_tiles, out, qk_scale = ctx
        q_desc, q1_desc, k_desc, k1_desc, v_desc = descs
        q_smem, q1_smem, k_smem, k1_smem, v_smem = smem
        q_bar, k_ready, k_empty, v_ready, v_empty, turns = bars
        q_row0, k_row0 = rows0
        q_len, kv_len = lens
        out_ptr, stride_ot, out_col = out
        half: gl.constexpr = q_desc.block_type.shape[0]
        block_n: gl.constexpr = k_desc.block_type.shape[0]
        head_dim: gl.constexpr = v_desc.block_type.shape[1]
        has_rope: gl.constexpr = q1_desc.block_type.shape[1] != q_desc.block_type.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, head_dim, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        my_turn = turns.index(WG)
        other_turn = turns.index(1 - WG)
        turn_phase = 1 - WG  # the first consumer starts: a fresh barrier's phase 1 is done
        first_position = kv_len - q_len + first_row + WG * half  # of this consumer's first row
        positions = first_position + gl.arange(0, half, layout=row_layout)  # [64]
        key_cols = gl.arange(0, block_n, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N]
        m_i = gl.full([half], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([half], gl.float32, layout=row_layout)
        o = gl.zeros([half, head_dim], gl.float32, layout=o_layout)
        s_zero = gl.zeros([half, block_n], gl.float32, layout=s_layout)
        q = q_smem.index(WG)
        q1 = q1_smem.index(WG)
        mbarrier.wait(q_bar, 0)

        # Tile 0: its scores only (no PV product is pending yet).
        mbarrier.wait(k_ready.index(0), 0)
        mbarrier.wait(my_turn, turn_phase)
        turn_phase ^= 1
        s = _scores(q, q1, k_smem.index(0), k1_smem.index(0), s_zero, has_rope)
        mbarrier.arrive(other_turn, count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, 0, positions, key_cols, kv_len,
                                             first_position, qk_scale, p_layout)  # fmt: skip
        for j in range(1, n_tiles):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            mbarrier.wait(my_turn, turn_phase)
            turn_phase ^= 1
            s = _scores(q, q1, k_smem.index(slot), k1_smem.index(slot), s_zero, has_rope)
            o = o * alpha[:, None]
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            o = warpgroup_mma(p, v_smem.index(prev), o, is_async=True)
            mbarrier.arrive(other_turn, count=1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # QK^T done, PV may run on
            mbarrier.arrive(k_empty.index(slot), count=1)
            # p stays alive (a PV operand in registers) until its product is waited for below.
            p_next, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, j * block_n, positions,
                                                      key_cols, kv_len, first_position,
                                                      qk_scale, p_layout)  # fmt: skip
            o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
            mbarrier.arrive(v_empty.index(prev), count=1)
            p = p_next

        last = (n_tiles - 1) % STAGES
        o = o * alpha[:, None]
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
        o = warpgroup_mma(p, v_smem.index(last), o, is_async=True)
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
        mbarrier.arrive(v_empty.index(last), count=1)

        o = o / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        rows = first_row + WG * half + gl.arange(0, half, layout=gl.SliceLayout(1, o_layout))
        dims = gl.arange(0, head_dim, layout=gl.SliceLayout(0, o_layout))
        offsets = (q_row0 + rows).to(gl.int64)[:, None] * stride_ot + out_col + dims[None, :]
        gl.store(out_ptr + offsets, o.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])

    @gluon.jit
    def _prefill_attention_ws_kernel(q_desc, q1_desc, k_desc, k1_desc, v_desc, out_ptr,
                                     cu_seqlens_q_ptr, cu_seqlens_k_ptr, qk_scale,
                                     num_queries_per_kv, q_head_stride, k_head_stride,
                                     v_head_stride, q1_col0, q1_head_stride, k1_col0,
                                     k1_head_stride, stride_ot, stride_oh,
                                     HAS_ROPE: gl.constexpr):  # fmt: skip
        """One (head, query tile, sequence). The rope columns' descriptors (q1, k1) start at
        column q1_col0 + head * q1_head_stride (k1: of the kv head; a stride of 0 for a key
        rope shared by every head)."""
        half: gl.constexpr = q_desc.block_type.shape[0]
        block_n: gl.constexpr = k_desc.block_type.shape[0]
        head = gl.program_id(0)
        tile = gl.num_programs(1) - 1 - gl.program_id(1)  # heaviest (last) query tiles first
        seq = gl.program_id(2)
        q_row0 = gl.load(cu_seqlens_q_ptr + seq)
        q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_row0
        first_row = tile * (2 * half)
        if first_row >= q_len:
            return
        k_row0 = gl.load(cu_seqlens_k_ptr + seq)
        kv_len = gl.load(cu_seqlens_k_ptr + seq + 1) - k_row0
        last_key = gl.minimum(kv_len, kv_len - q_len + first_row + 2 * half)  # exclusive
        n_tiles = gl.cdiv(last_key, block_n)
        kv_head = head // num_queries_per_kv

        dtype: gl.constexpr = q_desc.dtype
        head_dim: gl.constexpr = q_desc.block_type.shape[1]
        q_smem = gl.allocate_shared_memory(dtype, [2, half, head_dim], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, block_n, head_dim], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, block_n, head_dim], v_desc.layout)
        if HAS_ROPE:  # the query/key's last 64 columns, their own buffers
            rope: gl.constexpr = q1_desc.block_type.shape[1]
            q1_smem = gl.allocate_shared_memory(dtype, [2, half, rope], q1_desc.layout)
            k1_smem = gl.allocate_shared_memory(dtype, [STAGES, block_n, rope], k1_desc.layout)
        else:  # stand-ins, never read
            q1_smem = q_smem
            k1_smem = k_smem
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turns.index(i), count=1)

        ctx = (
            (q_desc, q1_desc, k_desc, k1_desc, v_desc),
            (q_smem, q1_smem, k_smem, k1_smem, v_smem),
            (q_bar, k_ready, k_empty, v_ready, v_empty, turns),
            (q_row0, k_row0),
            (q_len, kv_len),
            (
                head * q_head_stride,
                q1_col0 + head * q1_head_stride,
                kv_head * k_head_stride,
                k1_col0 + kv_head * k1_head_stride,
                kv_head * v_head_stride,
            ),
            first_row,
            n_tiles,
            (out_ptr, stride_ot, head * stride_oh),
            qk_scale,
        )
        gl.warp_specialize(
            [(_consumer, (ctx, 0)), (_consumer, (ctx, 1)), (_producer, (ctx, 2))],
            [4, 1],
            [CONSUMER_REGISTERS_C, PRODUCER_REGISTERS_C],
        )


def _aligned(t: torch.Tensor) -> bool:
    """bf16 [tokens, heads, dim] with 16-byte aligned start, rows and heads (TMA's need), and
    rows the descriptors' int32 coordinates reach (else the Triton kernel's int64 pointers)."""
    return (
        t.dtype == torch.bfloat16
        and tma_rows_fit(t.shape[0], t.stride(0) * 2)
        and t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * 2) % 16 == 0
        and (t.stride(1) * 2) % 16 == 0
    )


def supports(query, key, value, is_causal: bool = True, query_rope=None, key_rope=None) -> bool:
    """Whether this kernel serves these operands: Hopper (sm_90 exactly), bf16, causal, value
    head dim 128, query/key head dim 128 or 192, [tokens, heads, dim] views with 16-byte aligned
    rows and head strides. With query_rope [T, Hq, 64] and key_rope [S, 1 or Hkv, 64] (MLA's
    rope columns kept apart), query and key hold the 128 other columns."""
    if not HAS_GLUON or not query.is_cuda or not is_causal:
        return False
    if torch.cuda.get_device_capability(query.device) != (9, 0):
        return False
    if value.shape[-1] != HEAD_DIM or query.shape[-1] not in (HEAD_DIM, HEAD_DIM + ROPE_DIM):
        return False
    if (query_rope is None) != (key_rope is None):
        return False
    if query_rope is not None:
        if query.shape[-1] != HEAD_DIM or query_rope.shape[:2] != query.shape[:2]:
            return False
        if query_rope.shape[-1] != ROPE_DIM or key_rope.shape[-1] != ROPE_DIM:
            return False
        if key_rope.shape[0] != key.shape[0] or key_rope.shape[1] not in (1, key.shape[1]):
            return False
    operands = (query, key, value) + ((query_rope, key_rope) if query_rope is not None else ())
    return all(_aligned(t) for t in operands)


def _rows_descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    """t [tokens, heads, dim] as [tokens, row stride] rows (a head at column head * stride(1))."""
    return rows_descriptor(t, t.shape[0], t.stride(0), t.stride(0), block_rows, block_cols)


def _rope_operands(query, key, query_rope, key_rope) -> tuple:
    """(q1 and k1 descriptors, q1 column, q1 head stride, k1 column, k1 head stride): the rope
    columns kept apart, or read from query/key's columns 128.. (qk 192); without rope, unused
    stand-ins of the main columns' width."""
    if query_rope is not None:
        shared = key_rope.shape[1] == 1  # one rope key for every head: head stride 0
        return (_rows_descriptor(query_rope, HALF_M, ROPE_DIM),
                _rows_descriptor(key_rope, BLOCK_N, ROPE_DIM), 0, query_rope.stride(1), 0,
                0 if shared else key_rope.stride(1))  # fmt: skip
    extra = ROPE_DIM if query.shape[-1] == HEAD_DIM + ROPE_DIM else HEAD_DIM
    return (_rows_descriptor(query, HALF_M, extra), _rows_descriptor(key, BLOCK_N, extra),
            HEAD_DIM, query.stride(1), HEAD_DIM, key.stride(1))  # fmt: skip


def prefill_attention_ws(
    query: torch.Tensor,  # [T, Hq, Dqk] bf16: Dqk 128, or 192 (128 + MLA's 64 rope columns)
    key: torch.Tensor,  # [S, Hkv, Dqk] bf16
    value: torch.Tensor,  # [S, Hkv, 128] bf16
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32 (q_len <= kv_len per sequence)
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, 128], rows 16-byte aligned: written in place
    query_rope: torch.Tensor | None = None,  # [T, Hq, 64]: MLA's rope columns kept apart
    key_rope: torch.Tensor | None = None,  # [S, 1 or Hkv, 64]
) -> torch.Tensor:  # [T, Hq, 128]
    """Causal varlen attention (each sequence's queries are its context's last tokens), the
    contract of prefill_attention.prefill_attention, on the warp-specialized kernel; the caller
    checks `supports` first. With query_rope and key_rope the scores are query . key +
    query_rope . key_rope, read where they lie (no joined copies)."""
    num_seqs, num_heads = cu_seqlens_q.shape[0] - 1, query.shape[1]
    if out is None:
        out = query.new_empty(query.shape[0], num_heads, HEAD_DIM)
    q1_desc, k1_desc, *rope_columns = _rope_operands(query, key, query_rope, key_rope)
    has_rope = query_rope is not None or query.shape[-1] == HEAD_DIM + ROPE_DIM
    grid = (num_heads, triton.cdiv(max(max_query_len, 1), BLOCK_M), num_seqs)
    _prefill_attention_ws_kernel[grid](
        _rows_descriptor(query, HALF_M, HEAD_DIM), q1_desc,
        _rows_descriptor(key, BLOCK_N, HEAD_DIM), k1_desc,
        _rows_descriptor(value, BLOCK_N, HEAD_DIM), out, cu_seqlens_q, cu_seqlens_k,
        scale * LOG2E, num_heads // key.shape[1], query.stride(1), key.stride(1),
        value.stride(1), *rope_columns, out.stride(0), out.stride(1), HAS_ROPE=has_rope,
        num_warps=4, maxnreg=LAUNCH_REGISTERS,
    )  # fmt: skip
    return out
