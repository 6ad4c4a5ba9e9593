"""The Triton kernels of fp8_gemm: c = (a * a_scale) @ (b * b_scale).T with 128x128 block scales.

- `_fp8_block_gemm_kernel`: pointer loads (any K; K_UNROLL 2 overlaps a product with a rescale;
  SPLIT_K splits K over programs for few rows, `_sum_splits_kernel` adding their partials);
- `_fp8_block_gemm_tma_kernel`: the same product through TMA descriptors, one program per tile;
- `_fp8_block_gemm_persistent_kernel`: the TMA product with a few programs per SM looping over
  the tiles.
Launched by fp8_gemm.fp8_gemm, which picks the kernel and tiles from configs/fp8_gemm.json.
"""

from __future__ import annotations

from rayinfer.kernels.tile_order import grouped_tile_ids
from rayinfer.kernels.triton_compat import tl, triton


@triton.jit
def _k_block_scales(
    a_scale_ptrs, b_scale_ptr, b_scale_ptrs, k_step, num_scale_cols, stride_ask,
    SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Scales of one K block: ([BM] per row, [BN] per column or one scalar for the whole tile).

    Past the last K block (the odd half of an unrolled pair) both are 0, so it adds nothing.
    """
    scale_col = k_step * BLOCK_K // SCALE_BLOCK
    in_k = scale_col < num_scale_cols
    scale_col = tl.minimum(scale_col, num_scale_cols - 1)  # in bounds; zeroed below when past K
    a_scale = tl.load(a_scale_ptrs + scale_col * stride_ask)  # [BM]
    a_scale = tl.where(in_k, a_scale, 0.0)
    if SCALE_BLOCK % BLOCK_N == 0:  # the tile sits inside one 128-row weight block
        b_scale = tl.load(b_scale_ptr + scale_col)  # scalar
    else:
        b_scale = tl.load(b_scale_ptrs + scale_col)[None, :]  # [1, BN]
    return a_scale, b_scale


@triton.jit
def _add_scaled(acc, product, a_scale, b_scale):
    """acc [BM, BN] += product * a_scale[row] * b_scale (one FMA per element for a scalar b)."""
    return acc + product * (a_scale[:, None] * b_scale)


@triton.jit
def _load_k_block(a_ptrs, b_ptrs, k_step, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """a [BM, BK] and b [BK, BN] of K block k_step; zeros past K (also for a whole odd block)."""
    if EVEN_K:
        a = tl.load(a_ptrs + k_step * BLOCK_K)
        b = tl.load(b_ptrs + k_step * BLOCK_K)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        k_left = K - k_step * BLOCK_K
        a = tl.load(a_ptrs + k_step * BLOCK_K, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs + k_step * BLOCK_K, mask=offs_k[:, None] < k_left, other=0.0)
    return a, b


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn,
    SCALE_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, K_UNROLL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr = 1, STEPS_PER_SPLIT: tl.constexpr = 0,
):  # fmt: skip
    """c = a @ b.T with block scales. With K_UNROLL 2, an iteration issues the dots of two K
    blocks before scaling either, so one tensor-core product runs while the other is rescaled.

    SPLIT_K > 1 (grid axis 1): program split s sums K blocks [s * STEPS_PER_SPLIT, ..) (a
    multiple of K_UNROLL) into c_ptr's float32 partials [SPLIT_K, M, N] (stride_cm: N), which
    `_sum_splits_kernel` adds up: with few rows, more programs than tiles keep the SMs busy.
    """
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrapped rows: loads need no mask
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BM, BK]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BK, BN]
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm  # [BM]
    b_scale_ptrs = b_scale_ptr + (offs_n // SCALE_BLOCK) * stride_bsn  # [BN]
    b_tile_scale_ptr = b_scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn
    num_scale_cols = tl.cdiv(K, SCALE_BLOCK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first, last = 0, tl.cdiv(K, BLOCK_K)
    if SPLIT_K > 1:
        first = tl.program_id(1) * STEPS_PER_SPLIT
        last = tl.minimum(first + STEPS_PER_SPLIT, last)
        c_ptr += tl.program_id(1).to(tl.int64) * M * N  # this split's partials
    for first_step in range(first, last, K_UNROLL):
        a, b = _load_k_block(a_ptrs, b_ptrs, first_step, K, EVEN_K, BLOCK_K)
        a_s, b_s = _k_block_scales(
            a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, first_step, num_scale_cols, stride_ask,
            SCALE_BLOCK, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        product = tl.dot(a, b)
        if K_UNROLL == 2:
            a2, b2 = _load_k_block(a_ptrs, b_ptrs, first_step + 1, K, EVEN_K, BLOCK_K)
            a2_s, b2_s = _k_block_scales(
                a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, first_step + 1, num_scale_cols,
                stride_ask, SCALE_BLOCK, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            product2 = tl.dot(a2, b2)
            acc = _add_scaled(acc, product, a_s, b_s)
            acc = _add_scaled(acc, product2, a2_s, b2_s)
        else:
            acc = _add_scaled(acc, product, a_s, b_s)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sum_splits_kernel(partials_ptr, c_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """c (flat, its dtype) = the sum over splits of partials [SPLIT_K, numel] float32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLIT_K):
        total += tl.load(partials_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tma_k_step(
    acc, a_desc, b_desc, a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, off_m, off_n, k_step,
    num_scale_cols, stride_ask,
    SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc += the scaled product of K block k_step (TMA tiles; zeros past K)."""
    a = a_desc.load([off_m, k_step * BLOCK_K])  # [BM, BK]
    b = b_desc.load([off_n, k_step * BLOCK_K])  # [BN, BK]
    a_s, b_s = _k_block_scales(
        a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, k_step, num_scale_cols, stride_ask,
        SCALE_BLOCK, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    return _add_scaled(acc, tl.dot(a, b.T), a_s, b_s)


@triton.jit
def _tma_tile(
    a_desc, b_desc, a_scale_ptr, b_scale_ptr, pid_m, pid_n, M, N, K,
    stride_asm, stride_ask, stride_bsn,
    SCALE_BLOCK: tl.constexpr, K_UNROLL: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The float32 [BM, BN] output tile (pid_m, pid_n), K blocks through TMA descriptors.

    WARP_SPECIALIZE runs the K loop as `tl.range(..., warp_specialize=True)` (the compiler may
    give the TMA loads their own warps; K_UNROLL is then ignored); a plain loop otherwise.
    K_UNROLL 2 issues the dots of two K blocks before scaling either (past K the descriptor reads
    zeros and the scales are 0).
    """
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    offs_m = (off_m + tl.arange(0, BLOCK_M)) % M
    offs_n = (off_n + tl.arange(0, BLOCK_N)) % N
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm  # [BM]
    b_scale_ptrs = b_scale_ptr + (offs_n // SCALE_BLOCK) * stride_bsn  # [BN]
    b_tile_scale_ptr = b_scale_ptr + (off_n // SCALE_BLOCK) * stride_bsn
    num_scale_cols = tl.cdiv(K, SCALE_BLOCK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WARP_SPECIALIZE:
        for k_step in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=True):
            acc = _tma_k_step(
                acc, a_desc, b_desc, a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, off_m, off_n,
                k_step, num_scale_cols, stride_ask, SCALE_BLOCK, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    elif K_UNROLL == 2:
        for first_step in range(0, tl.cdiv(K, BLOCK_K), 2):
            a = a_desc.load([off_m, first_step * BLOCK_K])  # [BM, BK]
            b = b_desc.load([off_n, first_step * BLOCK_K])  # [BN, BK]
            a_s, b_s = _k_block_scales(
                a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, first_step, num_scale_cols,
                stride_ask, SCALE_BLOCK, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            product = tl.dot(a, b.T)
            a2 = a_desc.load([off_m, (first_step + 1) * BLOCK_K])
            b2 = b_desc.load([off_n, (first_step + 1) * BLOCK_K])
            a2_s, b2_s = _k_block_scales(
                a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, first_step + 1, num_scale_cols,
                stride_ask, SCALE_BLOCK, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            product2 = tl.dot(a2, b2.T)
            acc = _add_scaled(acc, product, a_s, b_s)
            acc = _add_scaled(acc, product2, a2_s, b2_s)
    else:
        for k_step in range(0, tl.cdiv(K, BLOCK_K)):
            acc = _tma_k_step(
                acc, a_desc, b_desc, a_scale_ptrs, b_tile_scale_ptr, b_scale_ptrs, off_m, off_n,
                k_step, num_scale_cols, stride_ask, SCALE_BLOCK, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    return acc


@triton.jit
def _fp8_block_gemm_tma_kernel(
    a_desc, b_desc, c_desc, a_scale_ptr, b_scale_ptr,
    M, N, K,
    stride_asm, stride_ask, stride_bsn,
    SCALE_BLOCK: tl.constexpr, K_UNROLL: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The same product with tiles moved by the TMA engine (K % 16 == 0; edges zero-padded)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    acc = _tma_tile(
        a_desc, b_desc, a_scale_ptr, b_scale_ptr, pid_m, pid_n, M, N, K,
        stride_asm, stride_ask, stride_bsn, SCALE_BLOCK, K_UNROLL, WARP_SPECIALIZE,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


@triton.jit
def _fp8_block_gemm_persistent_kernel(
    a_desc, b_desc, c_desc, a_scale_ptr, b_scale_ptr,
    M, N, K,
    stride_asm, stride_ask, stride_bsn,
    SCALE_BLOCK: tl.constexpr, K_UNROLL: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    FLATTEN: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The TMA product with NUM_PROGRAMS programs (a few per SM), each looping over the tiles
    program_id, program_id + NUM_PROGRAMS, ... in the grouped order: no tail of short-lived
    programs, and (FLATTEN: `tl.range(..., flatten=True)`) one flattened loop nest whose pipeline
    may load the next tile's first K blocks during this tile's epilogue."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if FLATTEN:
        for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = grouped_tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = _tma_tile(
                a_desc, b_desc, a_scale_ptr, b_scale_ptr, pid_m, pid_n, M, N, K,
                stride_asm, stride_ask, stride_bsn, SCALE_BLOCK, K_UNROLL, WARP_SPECIALIZE,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))
    else:
        for tile_id in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
            pid_m, pid_n = grouped_tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = _tma_tile(
                a_desc, b_desc, a_scale_ptr, b_scale_ptr, pid_m, pid_n, M, N, K,
                stride_asm, stride_ask, stride_bsn, SCALE_BLOCK, K_UNROLL, WARP_SPECIALIZE,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))
