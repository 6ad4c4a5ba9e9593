"""Which batch sizes get a captured decode graph, and which graph a batch of n sequences uses.

Sizes follow vLLM/SGLang: 1, 2, 4, 8, then every multiple of 8 up to the largest (which is kept
even when it is not a multiple of 8). A batch runs in the smallest bucket that holds it; the rows
past n are padding.
"""

from __future__ import annotations

import bisect

BUCKET_STEP = 8


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Ascending bucket sizes up to `max_batch_size`, e.g. 20 -> [1, 2, 4, 8, 16, 20]."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
    sizes = [size for size in (1, 2, 4) if size < max_batch_size]
    sizes += list(range(BUCKET_STEP, max_batch_size, BUCKET_STEP))
    return sizes + [max_batch_size]


def bucket_for(count: int, sizes: list[int]) -> int:
    """The smallest size >= count (sequences of a decode, tokens of a prefill; sizes ascending);
    ValueError when none holds it."""
    index = bisect.bisect_left(sizes, count)
    if count < 1 or index == len(sizes):
        raise ValueError(f"{count} fits no graph bucket of {sizes}")
    return sizes[index]
