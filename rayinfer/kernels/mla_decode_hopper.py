"""Absorbed-MLA split-K decode for Hopper (sm_90), warp-specialized in Gluon: the split kernel
of mla_decode's split + combine, writing the same partial outputs [B, N, S, L] (float32) and
log2-sum-exp [B, N, S] that `_combine_splits` reduces (or `out` itself when one split covers
the context).

The Triton split kernel reads the cache at 69-72% of HBM at 16 heads (benchmarks/RESULTS.md): 16
heads are below wgmma's 64 rows, so its products run on mma.sync from registers that every tile
refills from shared memory twice. Here a producer warp streams the split's cache blocks by TMA
(four 16-token blocks per 64-token tile, each as its latent halves [16, 256] and rope part
[16, 64]) into a ring of STAGES slots, with the next tile's block ids loaded while a tile is
issued, and the products read the tile from shared memory by wgmma. Two forms:
- heads-major (layout "gluon_ws", many heads): two consumer warpgroups share a 64-row query tile
  (a program's heads; rows past the model's heads are computed and dropped) and each takes half
  of the 512 latent columns for the PV product (64 x 256 float32 accumulators). Warpgroup 0
  computes the tile's scores and softmax once and hands p [64, 64] and the rescale factors to
  warpgroup 1 through shared memory (p_ready / p_free mbarriers): at 128 heads decode is
  compute-bound, and scores computed in both warpgroups cost 1.37x the time.
- tokens-major (layout "gluon_ws_tokens", 16 or 32 heads): one consumer warpgroup computes the
  transposed problem, the tile's 64 tokens as wgmma's rows and the heads as its columns, so no
  row is padding: scores^T [64, H], the softmax down the tokens, p^T through shared memory, and
  out^T [512, H] in two 256-row halves.

Layout contract: kv_cache [blocks, 16, 512 + 64] bf16 contiguous; q_latent [B, N, 512] and q_pe
[B, N, 64] with rows of 16-byte aligned strides that step uniformly over (sequence, head).

Status (benchmarks/RESULTS.md, MLA rounds 9-12): both forms pass the float32 checks on an H200
and the engine's parity with transformers. Timed from CUDA graphs with one program per SM in
whole waves (168 / 225 KiB of shared memory): tokens-major at 16 heads reads the cache at
90-100% of HBM at full contexts (the Triton kernel 69-72%), heads-major at 128 heads is 2.1-2.9x
the Triton kernel (43-50% of HBM: compute-bound there). `configs/mla_attention.json` routes the
H200's buckets here.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.gluon_compat import (
    HAS_GLUON,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    rows_descriptor,
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
LOG2E = 1.4426950408889634

if HAS_GLUON:
    STAGES = gl.constexpr(2)  # 2 x 72 KiB of cache rows + 72 KiB of queries
    TILE_BLOCKS_C = gl.constexpr(TILE_BLOCKS)
    CONSUMER_REGISTERS_C = gl.constexpr(CONSUMER_REGISTERS)
    PRODUCER_REGISTERS_C = gl.constexpr(PRODUCER_REGISTERS)

    @gluon.jit
    def _producer(ctx, WG: gl.constexpr):
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
        offsets = (seq * stride_ob + split * stride_os + heads.to(gl.int64)[:, None] * stride_oh
                   + dims[None, :])  # fmt: skip
        gl.store(out_ptr + offsets, o.to(out_ptr.dtype.element_ty),
                 mask=(heads < num_heads)[:, None])  # fmt: skip

    @gluon.jit
    def _scores_consumer(ctx, WG: gl.constexpr):
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
        head_rows: gl.constexpr = ql_desc.block_type.shape[0]
        half: gl.constexpr = kc_desc.block_type.shape[1]
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
            tokens = first_token + j * tile + cols  # [64] positions in the sequence
            s = gl.where((tokens < split_end)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
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
    def _values_consumer(ctx, WG: gl.constexpr):
        """Warpgroup 1 of the heads-major form: PV on latent columns 256..511 with the p and
        alpha warpgroup 0 hands over each tile."""
        descs, smem, bars, rows, table, n_tiles, outs, scalars = ctx
        ql_desc, qp_desc, kc_desc, kp_desc = descs
        ql_smem, qp_smem, kc_smem, kp_smem, p_smem, row_smem = smem
        q_bar, ready, empty, p_ready, p_free = bars
        head_rows: gl.constexpr = ql_desc.block_type.shape[0]
        half: gl.constexpr = kc_desc.block_type.shape[1]
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
    def _tokens_major_consumer(ctx, WG: gl.constexpr):
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
        heads_n: gl.constexpr = ql_desc.block_type.shape[0]
        half: gl.constexpr = kc_desc.block_type.shape[1]
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
            s = gl.where((tokens < split_end)[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            p = gl.exp2(s - m_new[None, :])
            alpha = gl.exp2(m_i - m_new)
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
        base = seq * stride_ob + split * stride_os + heads.to(gl.int64)[None, :] * stride_oh
        out_ty: gl.constexpr = out_ptr.dtype.element_ty
        gl.store(out_ptr + base + dims[:, None], (o0 / l_safe[None, :]).to(out_ty), mask=is_head)
        gl.store(out_ptr + base + half + dims[:, None], (o1 / l_safe[None, :]).to(out_ty),
                 mask=is_head)  # fmt: skip
        lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))  # [H] log2
        gl.store(lse_ptr + (seq * num_heads + heads) * stride_lse + split, lse,
                 mask=heads < num_heads)  # fmt: skip

    @gluon.jit
    def _mla_decode_ws_kernel(ql_desc, qp_desc, kc_desc, kp_desc, out_ptr, lse_ptr,
                              block_tables_ptr, seq_lens_ptr, qk_scale, num_heads,
                              tokens_per_split, stride_table, stride_ob, stride_oh, stride_os,
                              IS_ONLY_SPLIT: gl.constexpr,
                              TOKENS_MAJOR: gl.constexpr):  # fmt: skip
        head_rows: gl.constexpr = ql_desc.block_type.shape[0]
        half: gl.constexpr = kc_desc.block_type.shape[1]
        block: gl.constexpr = kc_desc.block_type.shape[0]
        head_start = gl.program_id(0) * head_rows
        seq = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + seq)
        first_token = split * tokens_per_split
        if not IS_ONLY_SPLIT and split > 0 and first_token >= seq_len:
            return  # past the context: the combine reads only the splits that hold tokens
        split_end = gl.minimum(first_token + tokens_per_split, seq_len)
        tile: gl.constexpr = TILE_BLOCKS_C * block
        n_tiles = gl.cdiv(gl.maximum(split_end - first_token, 0), tile)

        dtype: gl.constexpr = kc_desc.dtype
        rope: gl.constexpr = kp_desc.block_type.shape[1]
        ql_smem = gl.allocate_shared_memory(dtype, [2, head_rows, half], ql_desc.layout)
        qp_smem = gl.allocate_shared_memory(dtype, qp_desc.block_type.shape, qp_desc.layout)
        kc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([tile, half], dtype)
        kp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([tile, rope], dtype)
        kc_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, tile, half], kc_layout)
        kp_smem = gl.allocate_shared_memory(dtype, [STAGES, tile, rope], kp_layout)
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

        num_splits = gl.num_programs(2)
        ctx = (
            (ql_desc, qp_desc, kc_desc, kp_desc),
            (ql_smem, qp_smem, kc_smem, kp_smem, p_smem, row_smem),
            (q_bar, ready, empty, p_ready, p_free),
            (seq * num_heads + head_start, head_start),
            (
                block_tables_ptr + seq * stride_table,
                first_token // block,
                gl.cdiv(split_end, block),
            ),
            n_tiles,
            (out_ptr, lse_ptr, stride_ob, stride_oh, stride_os, num_splits),
            (seq, split, num_heads, first_token, split_end, qk_scale),
        )
        if TOKENS_MAJOR:
            gl.warp_specialize(
                [(_tokens_major_consumer, (ctx, 0)), (_producer, (ctx, 1))],
                [1],
                [PRODUCER_REGISTERS_C],
            )
        else:
            gl.warp_specialize(
                [(_scores_consumer, (ctx, 0)), (_values_consumer, (ctx, 1)), (_producer, (ctx, 2))],
                [4, 1],
                [CONSUMER_REGISTERS_C, PRODUCER_REGISTERS_C],
            )


def supports(q_latent, q_pe, slots, block_size: int, tokens_per_split: int) -> bool:
    """Whether this kernel serves these operands: sm_90 exactly, bf16, latent 512 + rope 64,
    16-token cache blocks, splits of whole 64-token tiles, query rows that step uniformly over
    (sequence, head)."""
    if not HAS_GLUON or not q_latent.is_cuda or block_size != BLOCK_SIZE:
        return False
    if torch.cuda.get_device_capability(q_latent.device) != (9, 0):
        return False
    if tokens_per_split % (BLOCK_SIZE * TILE_BLOCKS):
        return False
    if q_latent.shape[-1] != LATENT_RANK or q_pe.shape[-1] != ROPE_DIM:
        return False
    for t in (q_latent, q_pe):
        if t.dtype != torch.bfloat16 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if not rows_step_uniformly(t) or (t.stride(1) * 2) % 16:
            return False
    return slots.dtype == torch.bfloat16 and slots.is_contiguous() and slots.data_ptr() % 16 == 0


def rows_step_uniformly(t: torch.Tensor) -> bool:
    """Whether q [B, N, D]'s (sequence, head) rows are B * N rows one stride apart (a TMA
    descriptor's 2-D view); the engine's q_latent, a batched matmul's [N, B, L] output seen as
    [B, N, L], is not, and the caller copies it (`with_uniform_rows`)."""
    return t.shape[0] <= 1 or t.stride(0) == t.shape[1] * t.stride(1)


def with_uniform_rows(t: torch.Tensor) -> torch.Tensor:
    """q itself where its rows step uniformly, else a contiguous copy (B x N x 1 KiB: ~1 us)."""
    return t if rows_step_uniformly(t) else t.contiguous()


def _head_rows(t: torch.Tensor, block_rows: int, block_cols: int):
    """q [B, N, D] as B * N rows of D (supports checks they step uniformly)."""
    return rows_descriptor(t, t.shape[0] * t.shape[1], t.shape[-1], t.stride(1), block_rows,
                           block_cols)  # fmt: skip


def _cache_rows(slots: torch.Tensor, block_cols: int):
    """The flat cache [num_slots, L + R] in 16-row (one cache block) boxes."""
    return rows_descriptor(slots, slots.shape[0], slots.shape[1], slots.stride(0), BLOCK_SIZE,
                           block_cols)  # fmt: skip


def mla_decode_ws_launch(q_latent, q_pe, slots, block_tables, seq_lens, scale, mid_out, mid_lse,
                         tokens_per_split: int, num_splits: int, is_only_split: bool,
                         tokens_major: bool = False, block_h: int = HEAD_ROWS):  # fmt: skip
    """The split kernel's launch on mla_decode's buffers: mid_out [B, N, S, L] float32 (or the
    output [B, N, 1, L]) and mid_lse [B, N, S]; the caller checks `supports` first.
    tokens_major: the one-consumer form over block_h heads a program (16, 32 or 64), else the
    heads-major form over 64-row query tiles."""
    num_seqs, num_heads = q_latent.shape[:2]
    head_rows = block_h if tokens_major else HEAD_ROWS
    grid = (-(-num_heads // head_rows), num_seqs, num_splits)
    _mla_decode_ws_kernel[grid](
        _head_rows(q_latent, head_rows, HALF_L), _head_rows(q_pe, head_rows, ROPE_DIM),
        _cache_rows(slots, HALF_L), _cache_rows(slots, ROPE_DIM),
        mid_out, mid_lse, block_tables, seq_lens, scale * LOG2E, num_heads, tokens_per_split,
        block_tables.stride(0), mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        IS_ONLY_SPLIT=is_only_split, TOKENS_MAJOR=tokens_major, num_warps=4,
        maxnreg=LAUNCH_REGISTERS,
    )  # fmt: skip
