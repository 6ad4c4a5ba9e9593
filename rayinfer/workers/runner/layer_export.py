"""A prefill step's hand-off exports, copied out layer by layer while the step still computes.

The step that computes the last chunk of a prefill-only request's prompt (the one that samples its
first token) writes each layer's final KV of the request as that layer runs. Where the request's
export goes to this worker's shared-memory arena, its span is taken before the forward, and the
rows of layer l are copied there once layer l has cached them (ForwardContext.on_layer_cached):
on CUDA a batch of row copies on a copy stream that first waits for an event the compute stream
records at that point, so the copies run on the copy engines beside layers l+1...; on the CPU a
gather at once. Layers the forward did not announce (a step replayed whole from a prefill graph,
two-batch overlap's halves) are copied after the forward. The export called after the step then
only waits for the last copies, instead of copying the whole request (3.5-3.8 ms for a 115 MB
V2-Lite request on an H100, issue 28). vLLM's KV connectors save layer by layer the same way.

The arena layout is the whole-request export's (kv_copy.py: chunks of `chunk_tokens` tokens, each
holding its layers back to back), so the import cannot tell the two apart.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from rayinfer.workers.runner.copy_batches import RowCopies, slot_runs
from rayinfer.workers.runner.kv_transfer import KVPayload, layer_rows

logger = logging.getLogger(__name__)


@dataclass
class LayerExport:
    """One request's export under way: its header (the layout of its chunks in the span), the
    span, and per chunk its slots and per layer the span's rows for them."""

    request_id: str
    header: KVPayload
    span: object  # the arena's ArenaSpan
    slots: list[np.ndarray]  # per chunk [tokens] int64 cache slots
    rows: list[list[torch.Tensor]]  # per chunk, per layer [tokens, row bytes] uint8 span views
    done: torch.cuda.Event | None = None  # CUDA: recorded on the copy stream after the last copy
    failed: bool = False  # a copy could not be issued: the export copies the whole request

    def wait(self) -> float:
        """Block until every layer is in the span; the seconds it waited."""
        begin = time.perf_counter()
        if self.done is not None:
            self.done.synchronize()
        return time.perf_counter() - begin


class LayerExporter:
    """Copies announced layers of a step's exports out of one cache; used by the step's thread."""

    def __init__(self, cache_rows: list[torch.Tensor]):
        """cache_rows: per layer [num_slots, row bytes] uint8 views of the cache (KVCopier.rows)."""
        self.cache_rows = cache_rows
        self.num_layers = len(cache_rows)
        self.device = cache_rows[0].device
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # One batch of row copies per layer and chunk: per layer its own cache pointers; every
        # layer in one batch where the forward announced none (a step replayed from a graph).
        self.per_layer = [RowCopies([rows]) for rows in cache_rows] if self.is_cuda else None
        self.all_layers = RowCopies(cache_rows) if self.is_cuda else None

    def step(self, exports: list[LayerExport]) -> StepCopies:
        return StepCopies(self, exports)


class StepCopies:
    """One step's layer copies: `layer_cached` as the forward announces layers, then `finish`."""

    def __init__(self, exporter: LayerExporter, exports: list[LayerExport]):
        self.exporter = exporter
        self.exports = exports
        self.copied = [False] * exporter.num_layers
        self.failed = False
        # per export, per chunk: its slots as runs, found once for the step's layers
        self.runs = [[slot_runs(s) for s in e.slots] for e in exports] if exporter.is_cuda else None

    def layer_cached(self, layer: int) -> None:
        """Copy `layer`'s rows of every export out, after what the current stream has queued.
        A copy that cannot be issued (the driver refused it) fails these exports, never the
        step: each then copies the whole request after it."""
        if self.failed or not 0 <= layer < len(self.copied) or self.copied[layer]:
            return
        self.copied[layer] = True
        try:
            self._copy(layer)
        except RuntimeError as error:
            logger.warning("KV rows not copied during the step (%s); exported after it", error)
            self.failed = True

    def _copy(self, layer: int) -> None:
        exporter = self.exporter
        if not exporter.is_cuda:
            source = exporter.cache_rows[layer]
            for export in self.exports:
                for slots, rows in zip(export.slots, export.rows):
                    torch.index_select(source, 0, torch.from_numpy(slots), out=rows[layer])
            return
        self._after_current_stream()
        copies = exporter.per_layer[layer]
        for export, runs in zip(self.exports, self.runs):
            for chunk_runs, rows in zip(runs, export.rows):
                copies.issue([rows[layer]], chunk_runs, False, exporter.stream)

    def finish(self) -> None:
        """After the forward: copy the layers it did not announce; each export's `done` then
        marks the end of its copies."""
        exporter = self.exporter
        if exporter.is_cuda and not any(self.copied):
            self.copied = [True] * len(self.copied)
            try:
                self._after_current_stream()
                for export, runs in zip(self.exports, self.runs):
                    for chunk_runs, rows in zip(runs, export.rows):
                        exporter.all_layers.issue(rows, chunk_runs, False, exporter.stream)
            except RuntimeError as error:
                logger.warning("KV rows not copied after the step (%s); exported later", error)
                self.failed = True
        for layer in range(len(self.copied)):
            self.layer_cached(layer)
        done = None
        if exporter.is_cuda:
            done = torch.cuda.Event()
            done.record(self.exporter.stream)
        for export in self.exports:
            export.done, export.failed = done, self.failed

    def _after_current_stream(self) -> None:
        """The copy stream's next copies wait for what the current stream has queued."""
        exporter = self.exporter
        cached = torch.cuda.Event()
        cached.record(torch.cuda.current_stream(exporter.device))
        exporter.stream.wait_event(cached)


def chunk_rows(chunks: list[torch.Tensor], layer_bytes: tuple[int, ...]) -> list[list]:
    """Per chunk of a span (kv_transfer.arena_chunks), its per-layer row views."""
    return [layer_rows(chunk, layer_bytes) for chunk in chunks]
