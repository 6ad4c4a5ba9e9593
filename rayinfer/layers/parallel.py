"""Where a layer sits in a parallel plan: its tensor- and expert-parallel rank and group.

Layers shard their weights by these numbers; with sizes 1 (the default) they are plain layers.
The `group` carries the collectives (`all_reduce`, `all_gather`, `dispatch`, `combine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: Any = None
    ep_group: Any = None

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} outside tp_size={self.tp_size}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} outside ep_size={self.ep_size}")


SINGLE = ParallelContext()


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the parallel size {denominator}")
    return numerator // denominator
