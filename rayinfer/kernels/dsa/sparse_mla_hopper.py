"""Sparse MLA attention (absorbed form) for Hopper (sm_90), warp-specialized in Gluon: the split
kernel of sparse_mla's split + combine, writing the same partial outputs [T, N, S, L] (float32)
and log2-sum-exp [T, N, S] that its combine reduces (or `out` itself when one split covers the
list).

The Triton kernel reads the listed rows at 27-31% of HBM at GLM-5's 64 heads (bench kernels
dsa): at 64 heads a gathered row feeds 2 x 64 x (576 + 512) FLOP, so the kernel is bound by its
products, which Triton issues from registers that every tile refills from shared memory. This
kernel is the dense Gluon MLA decode (mla/mla_decode_hopper) with another producer: the same
consumer warpgroups (mla_decode_partitions, SPARSE) read each 64-entry tile of the slot list
from shared memory by wgmma, and a producer warpgroup gathers the tile's rows into the ring
with cp.async (Hopper's TMA has no row gather): per tile, 64 rows of c_kv (two [64, 256] latent
halves) and k_pe ([64, 64]) in four 16-row chunks, -1 entries and positions past the split's
end zero-filled (the consumers give them no weight). A tile's copies are signalled one tile
later (each thread waits for its own copies, fences them for the async proxy that wgmma reads
through, then one arrival), so two tiles are in flight. The queries come the same way, once.

Forms as in the dense kernel: heads-major (layout "gluon_ws": two consumers, 64 query rows a
program) and tokens-major ("gluon_ws_tokens": one consumer, 16-64 heads a program).

Status (benchmarks/RESULTS.md): correct on an H100 (tests/gpu/test_dsa_kernels.py, DSA
parity) and 1.26x / 1.43x the Triton kernel at 16 / 64 decodes over 128k (34% / 53% of the copy
figure); issue and compute still take turns (docs/kernels.md, DSA).

Layout contract: the cache's rows [num_slots, W >= 576] bf16 with 16-byte aligned rows (c_kv
at [0, 512), k_pe at [512, 576)); q_latent [T, N, 512] and q_pe [T, N, 64] bf16 with rows that
step uniformly over (query, head); slots [T, K] int32 contiguous.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.gluon_compat import (
    HAS_GLUON,
    async_commit_group,
    async_load,
    async_wait_group,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    thread_barrier,
)
from rayinfer.kernels.mla.mla_decode_hopper import (  # noqa: F401 (with_uniform_rows re-exported)
    LOG2E,
    rows_step_uniformly,
    with_uniform_rows,
)
from rayinfer.kernels.mla.mla_decode_partitions import (
    CONSUMER_REGISTERS,
    HALF_L,
    HEAD_ROWS,
    LATENT_RANK,
    ROPE_DIM,
)

TILE = 64  # list entries per tile (wgmma's N for the scores)
CHUNK_ROWS = 16  # rows a producer gather covers: [16, 256] is 4 16-byte copies a thread
GATHER_WARPS = 4
GATHER_REGISTERS = 40  # 2 x 128 x 232 + 128 x 40 + the default partition's within 64K
LAUNCH_REGISTERS = 168  # 384 threads x 168 <= 64K

if HAS_GLUON:
    from rayinfer.kernels.mla.mla_decode_partitions import (
        STAGES,
        handoff_state,
        scores_consumer,
        tokens_major_consumer,
        values_consumer,
    )

    CONSUMER_REGISTERS_C = gl.constexpr(CONSUMER_REGISTERS)
    GATHER_REGISTERS_C = gl.constexpr(GATHER_REGISTERS)
    GATHER_WARPS_C = gl.constexpr(GATHER_WARPS)
    CHUNK_ROWS_C = gl.constexpr(CHUNK_ROWS)
    TILE_C = gl.constexpr(TILE)
    HALF_L_C = gl.constexpr(HALF_L)
    ROPE_DIM_C = gl.constexpr(ROPE_DIM)

    @gluon.jit
    def _gather_chunk(smem, base_ptr, rows, is_row, stride, col0, COLS: gl.constexpr):
        """cp.async of CHUNK_ROWS rows (row indices `rows`, int64) x COLS columns from col0 of
        rows `stride` elements apart into smem [CHUNK_ROWS, COLS]; rows not is_row read as 0."""
        threads_n: gl.constexpr = 32 if COLS >= 256 else COLS // 8
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // threads_n, threads_n],
                                                [GATHER_WARPS_C, 1], [1, 0])  # fmt: skip
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        rows = gl.convert_layout(rows, row_layout)
        is_row = gl.convert_layout(is_row, row_layout)
        pointers = base_ptr + rows[:, None] * stride + cols[None, :]
        async_load(smem, pointers, mask=is_row[:, None])

    @gluon.jit
    def _gather_rows(latent0, latent1, rope, chunk: gl.constexpr, rows, is_row, latent_ptr,
                     latent_stride, rope_ptr, rope_stride, rope_col):  # fmt: skip
        """One chunk's rows into the three buffers of a tile (or of the queries): the latent
        halves [tile, 256] each from latent_ptr, the rope part [tile, 64] from rope_ptr."""
        half: gl.constexpr = latent0.type.shape[1]
        rope_dim: gl.constexpr = rope.type.shape[1]
        start: gl.constexpr = chunk * CHUNK_ROWS_C
        _gather_chunk(latent0.slice(start, CHUNK_ROWS_C), latent_ptr, rows, is_row,
                      latent_stride, 0, half)  # fmt: skip
        _gather_chunk(latent1.slice(start, CHUNK_ROWS_C), latent_ptr, rows, is_row,
                      latent_stride, half, half)  # fmt: skip
        _gather_chunk(rope.slice(start, CHUNK_ROWS_C), rope_ptr, rows, is_row, rope_stride,
                      rope_col, rope_dim)  # fmt: skip

    @gluon.jit
    def _signal(bar):
        """This thread's copies of the group before the last have landed: fence them for the
        async proxy (wgmma), wait for the whole warpgroup, one arrival."""
        async_wait_group(1)
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def gather_producer(ctx, WG: gl.constexpr, SPARSE: gl.constexpr):
        """The producer warpgroup: the program's query rows, then each tile's listed rows."""
        descs, smem, bars, rows, table, n_tiles, outs, scalars = ctx
        q_ptrs, q_strides, cache_ptr, stride_row = descs
        ql_smem, qp_smem, kc_smem, kp_smem, _, _ = smem
        q_bar, ready, empty, _, _ = bars
        q_row, _ = rows
        list_ptr, _, _ = table
        seq, split, num_heads, first_token, split_end, qk_scale = scalars
        stride_ql, stride_qp, num_q_rows = q_strides
        tile: gl.constexpr = kc_smem.type.shape[1]
        half: gl.constexpr = kc_smem.type.shape[2]
        head_rows: gl.constexpr = ql_smem.type.shape[1]
        index_layout: gl.constexpr = gl.BlockedLayout([1], [32], [GATHER_WARPS_C], [0])
        in_chunk = gl.arange(0, CHUNK_ROWS_C, layout=index_layout)
        for chunk in gl.static_range(head_rows // CHUNK_ROWS_C):
            q_rows = q_row + chunk * CHUNK_ROWS_C + in_chunk  # past the last query: zeros
            _gather_rows(
                ql_smem.index(0),
                ql_smem.index(1),
                qp_smem,
                chunk,
                q_rows.to(gl.int64),
                q_rows < num_q_rows,
                q_ptrs[0],
                stride_ql,
                q_ptrs[1],
                stride_qp,
                0,
            )
        async_commit_group()
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # fresh: phase 1 done
            for chunk in gl.static_range(tile // CHUNK_ROWS_C):
                position = first_token + j * tile + chunk * CHUNK_ROWS_C + in_chunk
                listed = gl.load(list_ptr + position, mask=position < split_end, other=-1)
                _gather_rows(kc_smem.index(2 * slot), kc_smem.index(2 * slot + 1),
                             kp_smem.index(slot), chunk, listed.to(gl.int64), listed >= 0,
                             cache_ptr, stride_row, cache_ptr, stride_row, 2 * half)  # fmt: skip
            async_commit_group()
            if j == 0:  # the queries' group before the first tile's
                _signal(q_bar)
            else:
                _signal(ready.index((j - 1) % STAGES))
        async_wait_group(0)
        fence_async_shared()
        thread_barrier()
        if n_tiles == 0:
            mbarrier.arrive(q_bar, count=1)
        else:
            mbarrier.arrive(ready.index((n_tiles - 1) % STAGES), count=1)

    @gluon.jit
    def _sparse_mla_ws_kernel(q_latent_ptr, q_pe_ptr, cache_ptr, slots_ptr, out_ptr, lse_ptr,
                              qk_scale, num_heads, num_q_rows, num_listed, slots_per_split,
                              stride_ql, stride_qp, stride_row, stride_slots, stride_ot,
                              stride_oh, stride_os, HEAD_ROWS_C: gl.constexpr,
                              IS_ONLY_SPLIT: gl.constexpr, TOKENS_MAJOR: gl.constexpr):  # fmt: skip
        """One (head group, query, split of the list): the query rows q_row.. of q_latent and
        q_pe seen as [T * N, 512] / [T * N, 64] rows stride_ql / stride_qp apart."""
        head_start = gl.program_id(0) * HEAD_ROWS_C
        query = gl.program_id(1)
        split = gl.program_id(2)
        first = split * slots_per_split
        split_end = gl.minimum(first + slots_per_split, num_listed)
        tile: gl.constexpr = TILE_C
        n_tiles = gl.cdiv(gl.maximum(split_end - first, 0), tile)
        dtype: gl.constexpr = gl.bfloat16
        half: gl.constexpr = HALF_L_C
        rope: gl.constexpr = ROPE_DIM_C
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_ROWS_C, half], dtype)
        qp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_ROWS_C, rope],
                                                                        dtype)  # fmt: skip
        ql_smem = gl.allocate_shared_memory(dtype, [2, HEAD_ROWS_C, half], q_layout)
        qp_smem = gl.allocate_shared_memory(dtype, [HEAD_ROWS_C, rope], qp_layout)
        kc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([tile, half], dtype)
        kp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([tile, rope], dtype)
        kc_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, tile, half], kc_layout)
        kp_smem = gl.allocate_shared_memory(dtype, [STAGES, tile, rope], kp_layout)
        handoff, bars = handoff_state(TOKENS_MAJOR, HEAD_ROWS_C, tile, dtype)
        p_smem, row_smem = handoff

        num_splits = gl.num_programs(2)
        q_row = query * num_heads + head_start
        ctx = (
            ((q_latent_ptr, q_pe_ptr), (stride_ql, stride_qp, num_q_rows), cache_ptr, stride_row),
            (ql_smem, qp_smem, kc_smem, kp_smem, p_smem, row_smem),
            bars,
            (q_row, head_start),
            (slots_ptr + query.to(gl.int64) * stride_slots, 0, 0),
            n_tiles,
            (out_ptr, lse_ptr, stride_ot, stride_oh, stride_os, num_splits),
            (query, split, num_heads, first, split_end, qk_scale),
        )
        if TOKENS_MAJOR:
            gl.warp_specialize(
                [(tokens_major_consumer, (ctx, 0, True)), (gather_producer, (ctx, 1, True))],
                [GATHER_WARPS_C],
                [GATHER_REGISTERS_C],
            )
        else:
            gl.warp_specialize(
                [(scores_consumer, (ctx, 0, True)), (values_consumer, (ctx, 1, True)),
                 (gather_producer, (ctx, 2, True))],
                [4, GATHER_WARPS_C],
                [CONSUMER_REGISTERS_C, GATHER_REGISTERS_C],
            )  # fmt: skip


def supports(q_latent, q_pe, kv_cache, slots, slots_per_split: int) -> bool:
    """Whether this kernel serves these operands: sm_90 exactly, bf16, latent 512 + rope 64,
    query rows that step uniformly over (query, head), 16-byte aligned cache rows, splits of
    whole 64-entry tiles, at most 65,535 queries (grid axis 1)."""
    if not HAS_GLUON or not q_latent.is_cuda or slots_per_split % TILE:
        return False
    if torch.cuda.get_device_capability(q_latent.device) != (9, 0):
        return False
    if q_latent.shape[-1] != LATENT_RANK or q_pe.shape[-1] != ROPE_DIM:
        return False
    if q_latent.shape[0] > 65535 or kv_cache.dtype != torch.bfloat16:
        return False
    for t in (q_latent, q_pe):
        if t.dtype != torch.bfloat16 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if not rows_step_uniformly(t) or (t.stride(1) * 2) % 16:
            return False
    row_bytes = kv_cache.stride(1) * kv_cache.element_size()
    return kv_cache.data_ptr() % 16 == 0 and row_bytes % 16 == 0 and slots.is_contiguous()


def sparse_mla_ws_launch(q_latent, q_pe, kv_cache, slots, scale, mid_out, mid_lse,
                         slots_per_split: int, num_splits: int, is_only_split: bool,
                         tokens_major: bool = False, block_h: int = HEAD_ROWS):  # fmt: skip
    """The split kernel's launch on sparse_mla's buffers: mid_out [T, N, S, L] float32 (or the
    output [T, N, 1, L]) and mid_lse [T, N, S]; the caller checks `supports` first."""
    num_queries, num_heads = q_latent.shape[:2]
    head_rows = block_h if tokens_major else HEAD_ROWS
    grid = (-(-num_heads // head_rows), num_queries, num_splits)
    _sparse_mla_ws_kernel[grid](
        q_latent, q_pe, kv_cache, slots, mid_out, mid_lse, scale * LOG2E, num_heads,
        num_queries * num_heads, slots.shape[1], slots_per_split, q_latent.stride(1),
        q_pe.stride(1), kv_cache.stride(1), slots.stride(0), mid_out.stride(0), mid_out.stride(1),
        mid_out.stride(2), HEAD_ROWS_C=head_rows, IS_ONLY_SPLIT=is_only_split,
        TOKENS_MAJOR=tokens_major, num_warps=4, maxnreg=LAUNCH_REGISTERS,
    )  # fmt: skip
