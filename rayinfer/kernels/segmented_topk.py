"""Top-k positions of a few long score rows in two passes, to spread the selection over the GPU.

torch.topk selects each row's k largest largely within one thread block per row, so a decode
step's few rows (the indexer's scores: 16 queries x 128k positions) leave most SMs idle. Here
each row is first cut into `segments` equal parts whose own top-k are kept (rows x segments
selections in parallel), then the k largest of those candidates are taken: the same set of
values (any value among a row's k largest is among its segment's k largest).
"""

from __future__ import annotations

import torch

# Segment rows only when there are fewer rows than this (an H200 has 132 SMs; a prefill chunk's
# 256 scored queries already fill them) and each segment holds at least MIN_SEGMENT_FACTOR x k.
MAX_ROWS = 128
MAX_SEGMENTS = 16
MIN_SEGMENT_FACTOR = 4


def num_segments(num_rows: int, row_len: int, k: int) -> int:
    """How many parts to cut each row into: 1 (a plain topk) for many rows or short ones."""
    if num_rows >= MAX_ROWS:
        return 1
    return max(1, min(MAX_SEGMENTS, row_len // (MIN_SEGMENT_FACTOR * k)))


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [n, S] -> [n, k] int64: positions of each row's k largest, in no set order."""
    num_rows, row_len = scores.shape
    segments = num_segments(num_rows, row_len, k)
    if segments == 1:
        return scores.topk(k, dim=-1).indices
    width = -(-row_len // segments)
    padded = torch.nn.functional.pad(scores, (0, segments * width - row_len), value=float("-inf"))
    values, local = padded.view(num_rows, segments, width).topk(k, dim=-1)  # [n, g, k]
    offsets = torch.arange(segments, device=scores.device)[None, :, None] * width
    candidates = (local + offsets).flatten(1)  # [n, g * k] positions in the row
    best = values.flatten(1).topk(k, dim=-1).indices  # [n, k] into the candidates
    return candidates.gather(1, best)
