"""An importer's mappings of the exporters' arenas on its node (kv_arena.py): a span's bytes as a
view of the exporter's own pages, checked against the owner's death and the span's reuse.

Each arena is opened and mapped once per importing process (page-locked on CUDA, so that the
host -> device copy reads the exporter's pages by DMA; registering 2 GiB costs far more than a
request's copy) and kept until its owner is found dead or gone; an importer that finds the owner
dead unlinks its file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from rayinfer.comm.shm import map_file, pin_host, unpin_host
from rayinfer.workers.runner.kv_arena import (
    HEADER_BYTES,
    MAX_SPANS,
    ArenaSpan,
    owner_is_alive,
    unlink_quietly,
)


@dataclass
class _Mapping:
    fd: int
    memory: torch.Tensor  # [file bytes] uint8
    table: np.ndarray  # int64 [MAX_SPANS, 2], the arena's header
    is_pinned: bool


class ArenaMaps:
    def __init__(self, pin: bool):
        """pin: page-lock each mapping (an importer on CUDA)."""
        self.pin = pin
        self._maps: dict[str, _Mapping] = {}

    def view(self, span: ArenaSpan) -> torch.Tensor | None:
        """[span.num_bytes] uint8: the span's bytes, mapped; None when they cannot be read as
        exported: the owner died (its file is gone or unlocked) or reused the span."""
        mapping = self._mapping(span.path)
        if mapping is None:
            return None
        if not owner_is_alive(mapping.fd):  # killed: its file is ours to unlink
            self._drop(span.path)
            unlink_quietly(span.path)
            return None
        if not self.still_holds(span):
            return None
        return mapping.memory[span.offset : span.offset + span.num_bytes]

    def still_holds(self, span: ArenaSpan) -> bool:
        """Whether the owner still holds the span as exported (checked again after the copy:
        a span taken back meanwhile may hold another request's bytes)."""
        mapping = self._maps.get(span.path)
        return mapping is not None and int(mapping.table[span.slot, 0]) == span.generation

    def release(self, span: ArenaSpan) -> None:
        """Tell the owner its span may be reused (the KV landed, or the hand-off was dropped)."""
        mapping = self._mapping(span.path)
        if mapping is not None and self.still_holds(span):
            mapping.table[span.slot, 1] = span.generation

    def is_released(self, span: ArenaSpan) -> bool:
        """Whether an importer has released the span (its owner takes it back when it next
        allocates); False also when its arena is gone."""
        mapping = self._mapping(span.path)
        return mapping is not None and int(mapping.table[span.slot, 1]) == span.generation

    def close(self) -> None:
        for path in list(self._maps):
            self._drop(path)

    def _mapping(self, path: str) -> _Mapping | None:
        mapping = self._maps.get(path)
        if mapping is not None:
            return mapping
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:  # the owner closed it, or died and was cleaned up
            return None
        size = os.fstat(fd).st_size
        memory = map_file(f"/proc/self/fd/{fd}", size)
        table = memory[:HEADER_BYTES].view(torch.int64).view(MAX_SPANS, 2).numpy()
        is_pinned = self.pin and pin_host(memory)
        self._maps[path] = mapping = _Mapping(fd, memory, table, is_pinned)
        return mapping

    def _drop(self, path: str) -> None:
        mapping = self._maps.pop(path)
        if mapping.is_pinned:
            unpin_host(mapping.memory)
        os.close(mapping.fd)
