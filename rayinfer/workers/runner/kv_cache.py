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
    payload_for_heads,
    token_slots,
    unpack_kv,
)


def new_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    kv_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Per layer a zeroed [num_blocks, block_size, *kv_shape] tensor; a ConfigError naming what
    to lower when they do not fit on the device."""
    shape = (num_blocks, block_size, *kv_shape)
    try:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not isinstance(error, torch.OutOfMemoryError) and "alloc" not in str(error):
            raise
        size = torch.Size(shape).numel() * dtype.itemsize * num_layers
        raise ConfigError(
            f"the KV cache (num_kv_blocks={num_blocks} x block_size={block_size} tokens, "
            f"{size / 2**30:.1f} GiB) does not fit on {device}; lower num_kv_blocks or "
            "max_model_len"
        ) from None


class KVCache:
    def __init__(
        self,
        layers: list[torch.Tensor],
        block_size: int,
        kv_heads: tuple[int, int] | None,
        chunk_bytes: int = CHUNK_BYTES,
    ):
        """layers: per layer [num_blocks, block_size, *kv_shape]; kv_heads: (first, count) of
        the K/V heads cached on this rank, None where every rank caches the same rows (MLA).
        chunk_bytes: the hand-off's chunk size (kv_copy.CHUNK_BYTES)."""
        self.layers = layers
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.chunk_bytes = chunk_bytes
        self._copier: KVCopier | None = None

    @property
    def copier(self) -> KVCopier:
        """The hand-off's chunked copies over this cache (made at first use)."""
        if self._copier is None:
            self._copier = KVCopier(self.layers, self.chunk_bytes)
        return self._copier

    def export_header(self, num_tokens: int, generator_state: torch.Tensor | None) -> KVPayload:
        """The payload of a request's first num_tokens tokens, without its chunks."""
        return KVPayload(
            chunks=[],
            num_layers=len(self.layers),
            shape=(num_tokens, *self.layers[0].shape[2:]),
            dtype=self.layers[0].dtype,
            generator_state=generator_state,
            kv_heads=self.kv_heads,
        )

    def export_chunks(
        self, block_table: list[int], num_tokens: int, generator_state: torch.Tensor | None
    ) -> tuple[KVPayload, Iterator[np.ndarray]]:
        """A request's first num_tokens tokens: the payload without its chunks, and the chunks
        as they are copied out (each valid until the next is taken; kv_copy.py)."""
        slots = token_slots(block_table, num_tokens, self.block_size)
        header = self.export_header(num_tokens, generator_state)
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
        self, block_table: list[int], payloads: list[KVPayload]
    ) -> torch.Tensor | None:
        """Write a hand-off into these blocks: from the shards of every prefill rank, this rank
        takes its own K/V heads (any prefill plan to any decode plan). Returns the sampling
        generator's state that came with it (None: a greedy request)."""
        mine = payload_for_heads(payloads, self.kv_heads)
        slots = token_slots(block_table, mine.num_tokens, self.block_size)
        check_layout(self.layers, mine.num_layers, mine.shape[1:])
        if mine.dtype == self.layers[0].dtype:
            # chunks viewing an arena are page-locked on CUDA (kv_arena_maps.py)
            self.copier.import_(slots, mine.chunks, pinned=mine.arena is not None)
        else:  # another dtype (a float32 prefill into a bfloat16 decode): convert on the way
            unpack_kv(self.layers, slots, mine.kv)
        return mine.generator_state
