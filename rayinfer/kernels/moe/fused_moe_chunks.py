"""Expert chunks for the fused MoE GEMMs: each expert's run of TAIL_M row tiles cut into chunks of
up to BLOCK_M + TAIL_M rows, one program each (see fused_moe's row tiles).

- `expert_chunks`: the chunk lists, built on device without a host sync (`ExpertChunks`).
- `row_granule`: rows each expert's run is padded to (TAIL_M for chunked tiles, else BLOCK_M).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayinfer.kernels.moe.moe_align import MoeAlignment
from rayinfer.kernels.triton_compat import tl, triton


@triton.jit(do_not_specialize=["num_tiles", "long_list_offset"])  # any count, one compile
def _expert_chunks_kernel(
    block_expert_ids_ptr, run_first_ptr, run_last_ptr,
    chunk_first_tile_ptr, chunk_num_tiles_ptr, num_chunks_ptr,
    num_tiles, long_list_offset,
    TILES_PER_CHUNK: tl.constexpr, TILES_IN_MAIN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: cut each expert's run of n row tiles into ceil(n / TILES_PER_CHUNK) chunks of
    balanced size (4 tiles -> 2 + 2, not 3 + 1: a 1-tile chunk would pay a whole main tile).

    Pass 1 writes each run's first and last tile; pass 2 the chunks (first tile, tile count),
    compacted in two lists: chunks that fit the main rows (at 0), and chunks with tail rows (at
    long_list_offset), and the two counts.
    """
    for block_start in range(0, num_tiles, BLOCK):
        tiles = block_start + tl.arange(0, BLOCK)  # [B]
        in_range = tiles < num_tiles
        experts = tl.load(block_expert_ids_ptr + tiles, mask=in_range, other=-1)
        before = tl.load(block_expert_ids_ptr + tiles - 1, mask=in_range & (tiles >= 1), other=-1)
        after = tl.load(block_expert_ids_ptr + tiles + 1, mask=tiles + 1 < num_tiles, other=-1)
        held = experts >= 0
        tl.store(run_first_ptr + experts, tiles, mask=held & (before != experts))
        tl.store(run_last_ptr + experts, tiles, mask=held & (after != experts))
    tl.debug_barrier()  # pass 2 reads what other threads stored
    num_short, num_long = 0, 0
    for block_start in range(0, num_tiles, BLOCK):
        tiles = block_start + tl.arange(0, BLOCK)  # [B]
        experts = tl.load(block_expert_ids_ptr + tiles, mask=tiles < num_tiles, other=-1)
        held = experts >= 0
        first = tl.load(run_first_ptr + experts, mask=held, other=0)
        run_tiles = tl.load(run_last_ptr + experts, mask=held, other=0) - first + 1  # [B] n
        run_tiles = tl.where(held, run_tiles, 1)
        chunks_in_run = (run_tiles + TILES_PER_CHUNK - 1) // TILES_PER_CHUNK
        base = run_tiles // chunks_in_run  # the first `extra` chunks hold base + 1 tiles
        extra = run_tiles % chunks_in_run
        rel = tiles - first
        in_long = extra * (base + 1)
        chunk = tl.where(rel < in_long, rel // (base + 1), extra + (rel - in_long) // base)
        starts = held & (rel == chunk * base + tl.minimum(chunk, extra))
        size = base + (chunk < extra).to(tl.int32)  # [B] tiles in the chunk starting here
        short = (starts & (size <= TILES_IN_MAIN)).to(tl.int32)
        long = (starts & (size > TILES_IN_MAIN)).to(tl.int32)
        slot = tl.where(
            short != 0,
            num_short + tl.cumsum(short, 0) - 1,
            long_list_offset + num_long + tl.cumsum(long, 0) - 1,
        )  # [B]
        tl.store(chunk_first_tile_ptr + slot, tiles, mask=starts)
        tl.store(chunk_num_tiles_ptr + slot, size, mask=starts)
        num_short += tl.sum(short, 0)
        num_long += tl.sum(long, 0)
    tl.store(num_chunks_ptr, num_short)
    tl.store(num_chunks_ptr + 1, num_long)


class ExpertChunks(NamedTuple):
    """Runs of up to `tiles_per_chunk` row tiles of one expert, compacted in two lists: row 0
    chunks that fit the main rows, row 1 chunks with tail rows (see fused_moe)."""

    first_tile: torch.Tensor  # [2, C_max] int32: the chunk's first row tile in the sorted layout
    num_tiles: torch.Tensor  # [2, C_max] int32: its row tiles, 1..tiles_per_chunk
    num_chunks: torch.Tensor  # [2] int32: chunks in use in each list
    max_chunks: tuple[int, int]  # bounds on each list's count, known without a host sync


def expert_chunks(alignment: MoeAlignment, num_slots: int, num_experts: int, tile: dict):
    """Chunks of BLOCK_M + TAIL_M rows over an alignment made with block_m = TAIL_M."""
    tail_m, block_m = tile["TAIL_M"], tile["BLOCK_M"]
    tiles_per_chunk = (block_m + tail_m) // tail_m
    num_tiles = alignment.block_expert_ids.numel()
    # An expert with n slots has at most n / chunk rows + 1 chunks; a chunk with tail rows holds
    # more than BLOCK_M slots. Bounds without a host sync:
    max_short = min(
        num_tiles, num_slots // (tiles_per_chunk * tail_m) + min(num_experts, num_slots)
    )
    max_long = min(max_short, num_slots // (block_m + 1))
    device = alignment.block_expert_ids.device
    # Rows padded to 16 bytes: the GEMMs get row 1 as a pointer, which Triton specializes on
    # its 16-byte alignment, so an unpadded width would compile a second variant of each GEMM
    # whenever the width's remainder mod 4 changed (while serving: workers/kernel_compiles.py).
    width = -(-max(max_short, 1) // 4) * 4
    first_tile = torch.empty(2, width, dtype=torch.int32, device=device)
    chunk_tiles = torch.empty_like(first_tile)
    num_chunks = torch.empty(2, dtype=torch.int32, device=device)
    runs = torch.empty(2, max(num_experts, 1), dtype=torch.int32, device=device)  # first, last
    _expert_chunks_kernel[(1,)](
        alignment.block_expert_ids, runs[0], runs[1], first_tile, chunk_tiles, num_chunks,
        num_tiles, first_tile.stride(0),
        TILES_PER_CHUNK=tiles_per_chunk, TILES_IN_MAIN=block_m // tail_m, BLOCK=1024,
    )  # fmt: skip
    return ExpertChunks(first_tile, chunk_tiles, num_chunks, (max_short, max_long))


def _check_chunk_tile(tile: dict) -> None:
    tail_m, block_m = tile["TAIL_M"], tile["BLOCK_M"]
    if block_m % tail_m or tail_m & (tail_m - 1):
        raise ValueError(f"TAIL_M={tail_m} must be a power of two dividing BLOCK_M={block_m}")


def row_granule(config: dict) -> int:
    """Rows each expert's run is padded to: TAIL_M for chunked tiles, else BLOCK_M."""
    tile = config["w13"]
    granules = {stage_tile.get("TAIL_M") or stage_tile["BLOCK_M"] for stage_tile in config.values()}
    if len(granules) != 1:
        raise ValueError(
            f"w13 and w2 tiles need the same row granule (TAIL_M or BLOCK_M): {config}"
        )
    return tile.get("TAIL_M") or tile["BLOCK_M"]
