"""Row layouts shared by schedules and transports: split offsets and byte views."""

import math

import torch


def offsets(splits: list[int]) -> list[int]:
    """Start row of each block: [0, s0, s0 + s1, ...] (one more entry than `splits`)."""
    starts = [0]
    for n in splits:
        starts.append(starts[-1] + n)
    return starts


def as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] any dtype -> [N, row_bytes] uint8 view of the same (contiguous) memory."""
    if not t.is_contiguous():
        raise ValueError("all_to_all needs contiguous tensors; call .contiguous() first")
    if t.dim() == 2 and t.stride(1) == 1:  # the common case: one view, or none
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)
    rows, row_bytes = t.shape[0], math.prod(t.shape[1:]) * t.element_size()
    if t.numel() == 0:
        return t.new_empty((rows, row_bytes), dtype=torch.uint8)
    return t.view(rows, -1).view(torch.uint8)


def check_splits(rows: int, splits: list[int], world_size: int, what: str) -> None:
    if len(splits) != world_size:
        raise ValueError(f"{what} has {len(splits)} entries; give one per rank ({world_size})")
    if any(n < 0 for n in splits):
        raise ValueError(f"{what} has negative entries: {splits}")
    if sum(splits) != rows:
        raise ValueError(f"{what} sums to {sum(splits)} but the tensor has {rows} rows")
