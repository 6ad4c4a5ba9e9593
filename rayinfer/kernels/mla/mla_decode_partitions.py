"""The warp partitions of the Gluon MLA decode split kernel (mla_decode_hopper, which has the
kernel, its launch and the design notes): the TMA producer warp, the two heads-major consumer
warpgroups (scores once in the first, p handed to the second) and the one tokens-major consumer,
with the tile geometry they share. Each takes the kernel's ctx tuple (descriptors, shared memory,
barriers, rows, block table, tile count, outputs, scalars), its warpgroup index and SPARSE.

The consumers also serve the sparse MLA decode (dsa/sparse_mla_hopper, its own gathering
producer): with SPARSE a tile's 64 columns are entries of a query's slot list (table[0] points
at the list, first_token / split_end are list positions) and a -1 entry weighs 0 like a
position past the split's end. The consumers read the tile geometry from the shared memory, not
from the descriptors, which only the TMA producer uses.
"""

from __future__ import annotations

from rayinfer.kernels.gluon_compat import (
    HAS_GLUON,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    thread_barrier,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LATENT_RANK = 512
HALF_L = 256  # latent columns per consumer
ROPE_DIM = 64
BLOCK_SIZE = 16  # tokens per cache block
TILE_BLOCKS = 4  # cache blocks per tile: 64 tokens, so the queries are re-read once per 64
HEAD_ROWS = 64  # query rows per program: wgmma's M
LAUNCH_REGISTERS = 168
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40

if HAS_GLUON:
    STAGES = gl.constexpr(2)  # 2 x 72 KiB of cache rows + 72 KiB of queries
    TILE_BLOCKS_C = gl.constexpr(TILE_BLOCKS)

    @gluon.jit
    def producer(ctx, WG: gl.constexpr, SPARSE: gl.constexpr):
        """One warp: the queries once, then every cache block of the split into the ring."""
        descs, smem, bars, rows, table, n_tiles, outs, scalars = ctx
        ql_desc, qp_desc, kc_desc, kp_desc = descs
        ql_smem, qp_smem, kc_smem, kp_smem, _, _ = smem
        q_bar, ready, empty, _, _ = bars
        q_row, _ = rows
        table_ptr, first_block, last_block = table
        half: gl.constexpr = kc_desc.block_type.shape[1]
        block: gl.constexpr = kc_desc.block_type.shape[0]
        nbytes: gl.constexpr = 2 * kc_desc.block_type.nbytes + kp_desc.block_type.nbytes
        mbarrier.expect(q_bar, 2 * ql_desc.block_type.nbytes + qp_desc.block_type.nbytes)
        tma_load(ql_desc, [q_row, 0], q_bar, ql_smem.index(0))
        tma_load(ql_desc, [q_row, half], q_bar, ql_smem.index(1))
        tma_load(qp_desc, [q_row, 0], q_bar, qp_smem)
        # Each tile's four block ids are loaded while the tile before it is issued.
        ids = _tile_block_ids(table_ptr, first_block, last_block)
        for j in range(n_tiles):
            tile_ids = ids
            ids = _tile_block_ids(table_ptr, first_block + (j + 1) * TILE_BLOCKS_C, last_block)
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # fresh: phase 1 done
            mbarrier.expect(ready.index(slot), TILE_BLOCKS_C * nbytes)
            for part in gl.static_range(TILE_BLOCKS_C):
                row = tile_ids[part] * block
                tma_load(kc_desc, [row, 0], ready.index(slot),
                         kc_smem.index(2 * slot).slice(part * block, block))  # fmt: skip
                tma_load(kc_desc, [row, half], ready.index(slot),
                         kc_smem.index(2 * slot + 1).slice(part * block, block))  # fmt: skip
                tma_load(kp_desc, [row, 2 * half], ready.index(slot),
                         kp_smem.index(slot).slice(part * block, block))  # fmt: skip

    @gluon.jit
    def handoff_state(TOKENS_MAJOR: gl.constexpr, head_rows: gl.constexpr, tile: gl.constexpr,
                      dtype: gl.constexpr):  # fmt: skip
        """The barriers and hand-off buffers both kernels' consumers share: the queries' q_bar,
        the ring's ready / empty per stage, and p (with, heads-major, the row vector and the
        p_ready / p_free barriers from warpgroup 0 to warpgroup 1) ->
        ((p_smem, row_smem), (q_bar, ready, empty, p_ready, p_free))."""
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        if TOKENS_MAJOR:  # one consumer; p^T [64, H] through shared memory
            p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([tile, head_rows],
                                                                           dtype)  # fmt: skip
            p_smem = gl.allocate_shared_memory(dtype, [tile, head_rows], p_layout)
            row_smem = p_smem  # unused
            p_ready = q_bar  # unused
            p_free = q_bar  # unused
            consumers: gl.constexpr = 1
        else:  # two consumers, each releasing every slot; p [64, 64] and a row vector handed
            # from the first to the second
            p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([head_rows, tile],
                                                                           dtype)  # fmt: skip
            p_smem = gl.allocate_shared_memory(dtype, [head_rows, tile], p_layout)
            row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            row_smem = gl.allocate_shared_memory(gl.float32, [head_rows], row_layout)
            p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(p_ready, count=1)
            mbarrier.init(p_free, count=1)
            consumers: gl.constexpr = 2
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=consumers)
        return (p_smem, row_smem), (q_bar, ready, empty, p_ready, p_free)

    @gluon.jit
    def _tile_block_ids(table_ptr, first, last):
        """The cache block ids of one tile (TILE_BLOCKS = 4 entries from `first`); entries at or
        past `last` (the split's end) read as block 0, whose rows the consumers mask."""
        return (
            gl.load(table_ptr + first, mask=first < last, other=0),
            gl.load(table_ptr + first + 1, mask=first + 1 < last, other=0),
            gl.load(table_ptr + first + 2, mask=first + 2 < last, other=0),
            gl.load(table_ptr + first + 3, mask=first + 3 < last, other=0),
        )

    @gluon.jit
    def _counted(table, tokens, split_end, SPARSE: gl.constexpr):
        """Which of a tile's columns count: positions before the split's end, and with SPARSE
        only listed slots (table[0] is the query's slot list; -1 entries do not count)."""
        counted = tokens < split_end
        if SPARSE:
            listed = gl.load(table[0] + tokens, mask=counted, other=-1)
            counted = counted & (listed >= 0)
        return counted

    @gluon.jit
    def _finite_max(m_new, SPARSE: gl.constexpr):
        """The running max to subtract: 0 where nothing counted yet (a sparse tile of only -1
        entries; p = 0 then, not NaN). A dense tile always counts a token: m_new itself (the
        select cost the heads-major form 8 spill instructions on sm_90)."""
        if SPARSE:
            m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new

    @gluon.jit
    def _store_half(o, l_i, ctx, WG: gl.constexpr):
        """A consumer's 256 latent columns of the output, divided by the softmax sums; rows of
        real heads only (an empty split stores zeros)."""
        descs, smem, bars, rows, table, n_tiles, outs, scalars = ctx
        _, head_start = rows
        out_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lse = outs
        seq, split, num_heads, first_token, split_end, qk_scale = scalars
        head_rows: gl.constexpr = o.type.shape[0]
        half: gl.constexpr = o.type.shape[1]
        o_layout: gl.constexpr = o.type.layout
        l_safe = gl.where(l_i > 0, l_i, 1.0)
        o = o / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
        heads = head_start + gl.arange(0, head_rows, layout=gl.SliceLayout(1, o_layout))
        dims = WG * half + gl.arange(0, half, layout=gl.SliceLayout(0, o_layout))
        offsets = (seq.to(gl.int64) * stride_ob + split * stride_os
                   + heads.to(gl.int64)[:, None] * stride_oh + dims[None, :])  # fmt: skip
        gl.store(out_ptr + offsets, o.to(out_ptr.dtype.element_ty),
                 mask=(heads < num_heads)[:, None])  # fmt: skip

    @gluon.jit
    def scores_consumer(ctx, WG: gl.constexpr, SPARSE: gl.constexpr):
        """Warpgroup 0 of the heads-major form: every tile's scores and softmax, p handed to
        warpgroup 1 through shared memory, then PV on latent columns 0..255 (p from registers).
        The scores are computed once (not by both consumers): the 128-head case is
        compute-bound."""
        descs, smem, bars, rows, table, n_tiles, outs, scalars = ctx
        ql_desc, qp_desc, kc_desc, kp_desc = descs
        ql_smem, qp_smem, kc_smem, kp_smem, p_smem, row_smem = smem
        q_bar, ready, empty, p_ready, p_free = bars
        _, head_start = rows
        out_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lse = outs
        seq, split, num_heads, first_token, split_end, qk_scale = scalars
        head_rows: gl.constexpr = ql_smem.type.shape[1]
        half: gl.constexpr = kc_smem.type.shape[2]
        tile: gl.constexpr = kc_smem.type.shape[1]  # tokens per tile
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, tile, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, half, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        cols = gl.arange(0, tile, layout=gl.SliceLayout(0, s_layout))  # [64]
        m_i = gl.full([head_rows], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([head_rows], gl.float32, layout=row_layout)
        o = gl.zeros([head_rows, half], gl.float32, layout=o_layout)
        s_zero = gl.zeros([head_rows, tile], gl.float32, layout=s_layout)
        mbarrier.wait(q_bar, 0)
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            latent0 = kc_smem.index(2 * slot)
            s = warpgroup_mma(ql_smem.index(0), latent0.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
            s = warpgroup_mma(ql_smem.index(1), kc_smem.index(2 * slot + 1).permute((1, 0)), s,
                              is_async=True)  # fmt: skip
            s = warpgroup_mma(qp_smem, kp_smem.index(slot).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            tokens = first_token + j * tile + cols  # [64] positions in the sequence (list)
            s = gl.where(_counted(table, tokens, split_end, SPARSE)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            m_safe = _finite_max(m_new, SPARSE)
            p = gl.exp2(s * qk_scale - m_safe[:, None])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p = p.to(gl.bfloat16)
            # Hand p and alpha over once warpgroup 1 is done with the previous tile's.
            mbarrier.wait(p_free, (j & 1) ^ 1)  # a fresh barrier's phase 1 counts as done
            p_smem.store(p)
            row_smem.store(alpha)
            fence_async_shared()
            thread_barrier()  # the whole warpgroup's stores before the one arrival
            mbarrier.arrive(p_ready, count=1)
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            o = warpgroup_mma(gl.convert_layout(p, p_layout), latent0, o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            mbarrier.arrive(empty.index(slot), count=1)

        # The softmax sums for warpgroup 1's normalization, after its last tile.
        mbarrier.wait(p_free, (n_tiles & 1) ^ 1)
        row_smem.store(l_i)
        thread_barrier()
        mbarrier.arrive(p_ready, count=1)
        _store_half(o, l_i, ctx, 0)
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        lse_heads = head_start + gl.arange(0, head_rows, layout=row_layout)  # [64] log2
        gl.store(lse_ptr + (seq * num_heads + lse_heads) * stride_lse + split, lse,
                 mask=lse_heads < num_heads)  # fmt: skip

    @gluon.jit
    def values_consumer(ctx, WG: gl.constexpr, SPARSE: gl.constexpr):
        """Warpgroup 1 of the heads-major form: PV on latent columns 256..511 with the p and
        alpha warpgroup 0 hands over each tile."""
        descs, smem, bars, rows, table, n_tiles, outs, scalars = ctx
        ql_desc, qp_desc, kc_desc, kp_desc = descs
        ql_smem, qp_smem, kc_smem, kp_smem, p_smem, row_smem = smem
        q_bar, ready, empty, p_ready, p_free = bars
        head_rows: gl.constexpr = ql_smem.type.shape[1]
        half: gl.constexpr = kc_smem.type.shape[2]
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, half, 16]
        )
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        o = gl.zeros([head_rows, half], gl.float32, layout=o_layout)
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            mbarrier.wait(p_ready, j & 1)
            o = o * row_smem.load(o_rows)[:, None]
            o = warpgroup_mma(p_smem, kc_smem.index(2 * slot + 1), o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            thread_barrier()  # every thread's reads of p and alpha before the one arrival
            mbarrier.arrive(p_free, count=1)
            mbarrier.arrive(empty.index(slot), count=1)
        mbarrier.wait(p_ready, n_tiles & 1)
        l_i = row_smem.load(o_rows)
        _store_half(o, l_i, ctx, 1)

    @gluon.jit
    def tokens_major_consumer(ctx, WG: gl.constexpr, SPARSE: gl.constexpr):
        """The one consumer warpgroup of the tokens-major form (few heads): a tile's 64 tokens
        are wgmma's rows, the heads its columns, so no row is padding.

        scores^T [64, H] = c_kv [64, 512] @ q_latent^T + k_pe [64, 64] @ q_pe^T, the softmax over
        the tokens (axis 0), p^T [64, H] stored to shared memory, then out^T [512, H] +=
        c_kv^T @ p^T in two 256-row halves: both products read the cached tile straight from
        shared memory (the Triton kernel reloads it into registers for mma.sync)."""
        descs, smem, bars, rows, table, n_tiles, outs, scalars = ctx
        ql_desc, qp_desc, kc_desc, kp_desc = descs
        ql_smem, qp_smem, kc_smem, kp_smem, p_smem, _ = smem
        q_bar, ready, empty, _, _ = bars
        _, head_start = rows
        out_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lse = outs
        seq, split, num_heads, first_token, split_end, qk_scale = scalars
        heads_n: gl.constexpr = ql_smem.type.shape[1]
        half: gl.constexpr = kc_smem.type.shape[2]
        tile: gl.constexpr = kc_smem.type.shape[1]  # tokens per tile
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, heads_n, 16]
        )
        head_layout: gl.constexpr = gl.SliceLayout(0, layout)
        rows_in_tile = gl.arange(0, tile, layout=gl.SliceLayout(1, layout))  # [64]
        m_i = gl.full([heads_n], float("-inf"), gl.float32, layout=head_layout)
        l_i = gl.zeros([heads_n], gl.float32, layout=head_layout)
        o0 = gl.zeros([half, heads_n], gl.float32, layout=layout)  # out^T, latent 0..255
        o1 = gl.zeros([half, heads_n], gl.float32, layout=layout)  # out^T, latent 256..511
        s_zero = gl.zeros([tile, heads_n], gl.float32, layout=layout)
        mbarrier.wait(q_bar, 0)
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            latent0 = kc_smem.index(2 * slot)
            latent1 = kc_smem.index(2 * slot + 1)
            s = warpgroup_mma(latent0, ql_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
            s = warpgroup_mma(latent1, ql_smem.index(1).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(kp_smem.index(slot), qp_smem.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            tokens = first_token + j * tile + rows_in_tile  # [64] positions in the sequence
            counted = _counted(table, tokens, split_end, SPARSE)
            s = gl.where(counted[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            m_safe = _finite_max(m_new, SPARSE)
            p = gl.exp2(s - m_safe[None, :])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            p_smem.store(p.to(p_smem.dtype))
            fence_async_shared()
            o0 = warpgroup_mma(latent0.permute((1, 0)), p_smem, o0 * alpha[None, :],
                               is_async=True)  # fmt: skip
            o1 = warpgroup_mma(latent1.permute((1, 0)), p_smem, o1 * alpha[None, :],
                               is_async=True)  # fmt: skip
            o0, o1 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1))
            mbarrier.arrive(empty.index(slot), count=1)

        # Columns of real heads only; an empty split (no tokens) stores zeros and lse -inf.
        l_safe = gl.where(l_i > 0, l_i, 1.0)
        heads = head_start + gl.arange(0, heads_n, layout=head_layout)
        is_head = (heads < num_heads)[None, :]
        dims = gl.arange(0, half, layout=gl.SliceLayout(1, layout))
        base = (seq.to(gl.int64) * stride_ob + split * stride_os
                + heads.to(gl.int64)[None, :] * stride_oh)  # fmt: skip
        out_ty: gl.constexpr = out_ptr.dtype.element_ty
        gl.store(out_ptr + base + dims[:, None], (o0 / l_safe[None, :]).to(out_ty), mask=is_head)
        gl.store(out_ptr + base + half + dims[:, None], (o1 / l_safe[None, :]).to(out_ty),
                 mask=is_head)  # fmt: skip
        lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))  # [H] log2
        gl.store(lse_ptr + (seq * num_heads + heads) * stride_lse + split, lse,
                 mask=heads < num_heads)  # fmt: skip
