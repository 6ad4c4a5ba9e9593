"""Absorbed-MLA split-K decode for Hopper (sm_90), warp-specialized in Gluon: the split kernel
of mla_decode's split + combine, writing the same partial outputs [B, N, S, L] (float32) and
log2-sum-exp [B, N, S] that `_combine_splits` reduces (or `out` itself when one split covers
the context).

The Triton split kernel reads the cache at 69-72% of HBM at 16 heads (sweep_mla_decode.py): 16
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

The warps' code is in mla_decode_partitions; this module has the kernel (shared memory, barriers,
the partitions' launch), its checks and its host launch.

Layout contract: kv_cache [blocks, 16, 512 + 64] bf16 contiguous; q_latent [B, N, 512] and q_pe
[B, N, 64] with rows of 16-byte aligned strides that step uniformly over (sequence, head).

Status (benchmarks/RESULTS.md, kernels): both forms pass the float32 checks on an H200
and the engine's parity with transformers. Timed from CUDA graphs with one program per SM in
whole waves (168 / 225 KiB of shared memory): tokens-major at 16 heads reads the cache at
90-100% of HBM at full contexts (the Triton kernel 69-72%), heads-major at 128 heads is 2.1-2.9x
the Triton kernel (43-50% of HBM: compute-bound there). `configs/mla_attention.json` routes the
H200's buckets here.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.gluon_compat import HAS_GLUON, gl, gluon, rows_descriptor
from rayinfer.kernels.mla.mla_decode_partitions import (  # noqa: F401 (geometry re-exported)
    BLOCK_SIZE,
    CONSUMER_REGISTERS,
    HALF_L,
    HEAD_ROWS,
    LATENT_RANK,
    LAUNCH_REGISTERS,
    PRODUCER_REGISTERS,
    ROPE_DIM,
    TILE_BLOCKS,
)
from rayinfer.kernels.triton_compat import tma_rows_fit

LOG2E = 1.4426950408889634

if HAS_GLUON:
    from rayinfer.kernels.mla.mla_decode_partitions import (
        STAGES,
        TILE_BLOCKS_C,
        handoff_state,
        producer,
        scores_consumer,
        tokens_major_consumer,
        values_consumer,
    )

    CONSUMER_REGISTERS_C = gl.constexpr(CONSUMER_REGISTERS)
    PRODUCER_REGISTERS_C = gl.constexpr(PRODUCER_REGISTERS)

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
        handoff, bars = handoff_state(TOKENS_MAJOR, head_rows, tile, dtype)
        p_smem, row_smem = handoff

        num_splits = gl.num_programs(2)
        ctx = (
            (ql_desc, qp_desc, kc_desc, kp_desc),
            (ql_smem, qp_smem, kc_smem, kp_smem, p_smem, row_smem),
            bars,
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
                [(tokens_major_consumer, (ctx, 0, False)), (producer, (ctx, 1, False))],
                [1],
                [PRODUCER_REGISTERS_C],
            )
        else:
            gl.warp_specialize(
                [
                    (scores_consumer, (ctx, 0, False)),
                    (values_consumer, (ctx, 1, False)),
                    (producer, (ctx, 2, False)),
                ],
                [4, 1],
                [CONSUMER_REGISTERS_C, PRODUCER_REGISTERS_C],
            )


def supports(q_latent, q_pe, slots, block_size: int, tokens_per_split: int) -> bool:
    """Whether this kernel serves these operands: sm_90 exactly, bf16, latent 512 + rope 64,
    16-token cache blocks, splits of whole 64-token tiles, query rows that step uniformly over
    (sequence, head), a cache of fewer than 2**31 slots (the TMA rows are int32)."""
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
    if not tma_rows_fit(slots.shape[0], slots.stride(0) * 2):  # block ids x 16: int32 rows
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
