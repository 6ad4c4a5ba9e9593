"""Sort (token, slot) pairs by expert and pad each expert's run to a multiple of the tile height.

The grouped GEMM of fused_moe then walks `sorted_slot_ids` in tiles of `block_m` rows, every tile
belonging to exactly one expert (`block_expert_ids`). A slot is `token * top_k + k`; padding rows
hold `num_slots` (= T * K) and are masked out by the GEMM. Slots routed to an expert this rank does
not hold (id < 0 or >= num_experts) are dropped. Nothing here synchronizes with the host: the
buffers have their worst-case length and `num_padded_slots` [1] says how much of it is used.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayinfer.kernels.triton_compat import tl, triton


class MoeAlignment(NamedTuple):
    sorted_slot_ids: torch.Tensor  # [P_max] int32: slot ids grouped by expert; padding = T*K
    block_expert_ids: torch.Tensor  # [P_max / block_m] int32: each tile's expert; -1 past the end
    num_padded_slots: torch.Tensor  # [1] int32: rows in use, a multiple of block_m


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst case: every expert's run ends one row into a new tile."""
    worst = num_slots + num_experts * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


@triton.jit
def _count_and_rank_kernel(
    ids_ptr, counts_ptr, ranks_ptr,
    num_slots, num_experts,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Each slot takes the next free row of its expert (order within an expert is arbitrary)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_slots
    expert = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    is_local = in_range & (expert >= 0) & (expert < num_experts)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=is_local)
    tl.store(ranks_ptr + offs, rank, mask=is_local)


@triton.jit
def _expert_offsets_kernel(
    counts_ptr, offsets_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_experts, num_blocks_max,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One program: padded run starts per expert, and the expert of every tile."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E]
    ends = tl.cumsum(padded, 0)  # [E]: exclusive end of each expert's run
    tl.store(offsets_ptr + experts, ends - padded, mask=experts < num_experts)
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    for block_start in range(0, num_blocks_max, BLOCK_B):
        blocks = block_start + tl.arange(0, BLOCK_B)
        row = blocks * BLOCK_M  # [B]
        # The tile's expert is the number of runs that end at or before its first row.
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), 1)  # [B]
        expert = tl.where(row < total, expert, -1)
        tl.store(block_expert_ids_ptr + blocks, expert, mask=blocks < num_blocks_max)


@triton.jit
def _scatter_kernel(
    ids_ptr, ranks_ptr, offsets_ptr, sorted_ptr,
    num_slots, num_experts,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_slots
    expert = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    is_local = in_range & (expert >= 0) & (expert < num_experts)
    rank = tl.load(ranks_ptr + offs, mask=is_local, other=0)
    start = tl.load(offsets_ptr + expert, mask=is_local, other=0)
    tl.store(sorted_ptr + start + rank, offs, mask=is_local)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, K] int -> MoeAlignment (three small launches, no host sync)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be [T, K] int32/int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two")
    ids = topk_ids.contiguous().view(-1)  # [T*K]
    num_slots, device = ids.numel(), ids.device
    padded_len = max_padded_slots(num_slots, num_experts, block_m)
    num_blocks_max = padded_len // block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(max(num_slots, 1), dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_slot_ids = torch.full((padded_len,), num_slots, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(num_blocks_max, dtype=torch.int32, device=device)
    num_padded_slots = torch.empty(1, dtype=torch.int32, device=device)
    grid = (max(triton.cdiv(num_slots, 1024), 1),)
    _count_and_rank_kernel[grid](ids, counts, ranks, num_slots, num_experts, BLOCK=1024)
    _expert_offsets_kernel[(1,)](
        counts, offsets, block_expert_ids, num_padded_slots, num_experts, num_blocks_max,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=64,
    )  # fmt: skip
    _scatter_kernel[grid](ids, ranks, offsets, sorted_slot_ids, num_slots, num_experts, BLOCK=1024)
    return MoeAlignment(sorted_slot_ids, block_expert_ids, num_padded_slots)


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Same layout with slots in ascending order inside each expert's run."""
    ids = topk_ids.reshape(-1).long()  # [T*K]
    num_slots = ids.numel()
    padded_len = max_padded_slots(num_slots, num_experts, block_m)
    sorted_slot_ids = torch.full((padded_len,), num_slots, dtype=torch.int32)
    block_expert_ids = torch.full((padded_len // block_m,), -1, dtype=torch.int32)
    row = 0
    for expert in range(num_experts):
        slots = (ids == expert).nonzero(as_tuple=True)[0]  # [n], ascending
        sorted_slot_ids[row : row + slots.numel()] = slots.int()
        num_rows = triton.cdiv(slots.numel(), block_m) * block_m
        block_expert_ids[row // block_m : (row + num_rows) // block_m] = expert
        row += num_rows
    return MoeAlignment(sorted_slot_ids, block_expert_ids, torch.tensor([row], dtype=torch.int32))
