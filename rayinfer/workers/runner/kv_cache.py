"""One device's paged KV cache: its allocation, and a request's tokens copied out of it and into
it for the hand-off between prefill and decode (kv_transfer.py is the payload's form, kv_copy.py
the chunked copies)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import torch

from rayinfer.config import ConfigError
from rayinfer.workers.runner.kv_copy import CHUNK_BYTES, KVCopier
from rayinfer.workers.runner.kv_transfer import (
    KVPayload,
    arena_chunks,
    check_layout,
    layer_shapes_of,
    pack_kv,
    payload_for_heads,
    token_slots,
    unpack_kv,
    widest_row,
)


def new_kv_caches(
    kv_shapes: tuple[tuple[int, ...], ...],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    key: str = "num_kv_blocks",
) -> list[torch.Tensor]:
    """Per layer a zeroed [num_blocks, block_size, *kv_shapes[layer]] tensor; a ConfigError
    naming what to lower (`key`, the count's) when they do not fit on the device."""
    shapes = [(num_blocks, block_size, *kv_shape) for kv_shape in kv_shapes]
    try:
        return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not isinstance(error, torch.OutOfMemoryError) and "alloc" not in str(error):
            raise
        size = sum(torch.Size(shape).numel() for shape in shapes) * dtype.itemsize
        raise ConfigError(
            f"the KV cache ({key}={num_blocks} x block_size={block_size} tokens, "
            f"{size / 2**30:.1f} GiB) does not fit on {device}; lower {key} or "
            "max_model_len"
        ) from None


class KVCache:
    def __init__(
        self,
        layers: list[torch.Tensor],
        block_size: int,
        kv_heads: tuple[int, int] | None,
        chunk_bytes: int = CHUNK_BYTES,
        window_layers: list[torch.Tensor] | None = None,
        window_span: int = 0,
    ):
        """layers: per layer [num_blocks, block_size, *kv_shape]; kv_heads: (first, count) of
        the K/V heads cached on this rank, None where every rank caches the same rows (MLA).
        chunk_bytes: the hand-off's chunk size (kv_copy.CHUNK_BYTES). window_layers: per layer
        the window pool's [num_window_blocks, block_size, width] (engine/block_manager.py),
        of which a hand-off carries the last window_span tokens ([] without a window pool)."""
        self.layers = layers
        self.window_layers = window_layers or []
        self.window_span = window_span
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.chunk_bytes = chunk_bytes
        self._copier: KVCopier | None = None
        self.last_import_way = ""  # how the last import copied (KVCopier.last_way, "converted")

    @property
    def copier(self) -> KVCopier:
        """The hand-off's chunked copies over this cache (made at first use)."""
        if self._copier is None:
            self._copier = KVCopier(self.layers, self.chunk_bytes)
        return self._copier

    def export_header(
        self,
        num_tokens: int,
        generator_state: torch.Tensor | None,
        window_table: list[int] | None = None,
    ) -> KVPayload:
        """The payload of a request's first num_tokens tokens, without its chunks (with its
        window state, whole, where the cache has a window pool)."""
        return KVPayload(
            window=self._export_window(window_table, num_tokens),
            chunks=[],
            num_layers=len(self.layers),
            shape=(num_tokens, *widest_row(self.layers)),
            dtype=self.layers[0].dtype,
            generator_state=generator_state,
            kv_heads=self.kv_heads,
            layer_shapes=layer_shapes_of([cache.shape[2:] for cache in self.layers]),
        )

    def export_chunks(
        self,
        block_table: list[int],
        num_tokens: int,
        generator_state: torch.Tensor | None,
        window_table: list[int] | None = None,
    ) -> tuple[KVPayload, Iterator[np.ndarray]]:
        """A request's first num_tokens tokens: the payload without its chunks, and the chunks
        as they are copied out (each valid until the next is taken; kv_copy.py)."""
        slots = token_slots(block_table, num_tokens, self.block_size)
        header = self.export_header(num_tokens, generator_state, window_table)
        return header, self.copier.export(slots, header.timings)

    def export_into(
        self, block_table: list[int], header: KVPayload, memory: torch.Tensor
    ) -> KVPayload:
        """Copy the header's tokens into `memory` ([header.num_bytes] uint8 of an arena span,
        page-locked on CUDA); the header with the layout of its chunks there."""
        header = replace(header, arena_chunk_tokens=self.copier.chunk_tokens)
        slots = token_slots(block_table, header.num_tokens, self.block_size)
        self.copier.export_into(slots, arena_chunks(memory, header), header.timings)
        return header

    def import_payloads(
        self,
        block_table: list[int],
        payloads: list[KVPayload],
        window_table: list[int] | None = None,
    ) -> torch.Tensor | None:
        """Write a hand-off into these blocks: from the shards of every prefill rank, this rank
        takes its own K/V heads (any prefill plan to any decode plan). Returns the sampling
        generator's state that came with it (None: a greedy request)."""
        mine = payload_for_heads(payloads, self.kv_heads)
        self._import_window(window_table, mine)
        slots = token_slots(block_table, mine.num_tokens, self.block_size)
        check_layout(self.layers, mine.kv_shapes)
        if mine.dtype == self.layers[0].dtype:
            # chunks viewing an arena are page-locked on CUDA (kv_arena_maps.py)
            self.copier.import_(slots, mine.chunks, pinned=mine.arena is not None)
            self.last_import_way = self.copier.last_way
        else:  # another dtype (a float32 prefill into a bfloat16 decode): convert on the way
            unpack_kv(self.layers, slots, mine.kv)
            self.last_import_way = "converted"
        return mine.generator_state

    def _window_slots(self, window_table: list[int], num_tokens: int) -> torch.Tensor:
        """[n] int64: window-pool slots of the last window_span of a sequence's num_tokens."""
        first = max(num_tokens - self.window_span, 0)
        positions = torch.arange(first, num_tokens)
        blocks = torch.tensor(window_table, dtype=torch.int64)[positions // self.block_size]
        if bool((blocks < 0).any()):
            raise ValueError("the window table holds no block for the hand-off's last tokens")
        return blocks * self.block_size + positions % self.block_size

    def _export_window(self, window_table: list[int] | None, num_tokens: int):
        """The window state of the last window_span tokens as a one-chunk payload (None without
        a window pool)."""
        if not self.window_layers:
            return None
        if window_table is None:
            raise ValueError("this cache keeps window state: export it with the window table")
        slots = self._window_slots(window_table, num_tokens)
        return KVPayload.from_tensors(pack_kv(self.window_layers, slots), generator_state=None)

    def _import_window(self, window_table: list[int] | None, payload: KVPayload) -> None:
        if not self.window_layers and payload.window is None:
            return
        if not self.window_layers or payload.window is None or window_table is None:
            raise ValueError(
                "a hand-off between caches with and without a window pool (or without the "
                "window table) cannot carry the window state"
            )
        window = payload.window
        slots = self._window_slots(window_table, payload.num_tokens)
        if window.num_tokens != slots.shape[0]:
            raise ValueError(
                f"the hand-off carries window state of {window.num_tokens} tokens; this cache "
                f"keeps {slots.shape[0]} (window_span {self.window_span})"
            )
        unpack_kv(self.window_layers, slots, window.kv)
