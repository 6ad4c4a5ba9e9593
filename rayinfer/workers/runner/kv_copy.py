"""Move a request's KV rows between the paged cache and host memory, chunk by chunk, on a copy
stream beside the compute.

Export, per chunk of tokens: gather every layer's rows at the request's slots into one device
staging buffer, copy it into pinned host memory (one asynchronous copy), and hand the host chunk
to the caller, which puts it into the object store while the next chunk is gathered and copied.
Import, the reverse: host chunk -> pinned memory (a parallel memcpy) -> device staging (one
asynchronous copy) -> scattered into the cache rows; two pinned buffers, so the CPU copy of one
chunk overlaps the device copy of the one before.

A synchronous `.cpu()` of each layer into pageable memory ran at 1.6-2.2 GB/s for a 115 MB
V2-Lite request (issue 28); pinned memory and one copy per chunk is what lets the host link's
55 GB/s show (`python -m rayinfer.bench handoff`).

One kernel gathers or scatters every layer's rows (kernels/cache_rows.py): beside a busy GPU
each launch waits for room on the SMs, and in a thread beside an engine loop each torch call
waits for the GIL.

Same-node hand-offs skip the object store and both host copies (workers/runner/kv_arena.py):
`export_into` lands each chunk's device -> host copy in the exporter's page-locked arena, and
`import_(..., pinned=True)` copies the importer's mapping of it straight to the device. Where
the request's slots lie in long runs (DIRECT_MIN_COPY_BYTES), those copies go without staging
or kernel: one batch of row copies on the copy engines (workers/runner/copy_batches.py).

On the CPU the cache already is host memory: rows are gathered and scattered directly.
The copier is used from one thread at a time (the worker's KV transfer thread).

Layers may keep rows of different widths (ModelConfig.kv_shapes_per_layer: DeepSeek-V4's layer
types, DSA's layers without an indexer key): a chunk holds the layers back to back, each
[tokens, its row bytes] (kv_transfer.layer_rows), so it carries no padding.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from rayinfer.engine_config import DIRECT_MIN_COPY_BYTES
from rayinfer.kernels import ops
from rayinfer.kernels.cache_rows import CacheRowsTable
from rayinfer.workers.runner.copy_batches import RowCopies, batch_copies_available, mean_copy_bytes
from rayinfer.workers.runner.kv_transfer import layer_rows

# Tokens per chunk are chosen so a chunk holds about this many bytes of all layers' rows: a long
# prompt streams through buffers of this size, while the copies of consecutive chunks overlap.
# `bench handoff` on an H200 (a 115 MB V2-Lite request): 128 MB chunks export / import at 10.7 /
# 11.7 GB/s, 32 MB at 7.9 / 8.3, 8 MB at 4.4 / 3.4: each chunk's object-store put and
# synchronisation cost more than the overlap gains at this size.
CHUNK_BYTES = 128 * 2**20
logger = logging.getLogger(__name__)

# Threads of the host memcpy from object-store memory into pinned memory on import: one
# thread's memcpy runs at about 8-10 GB/s, far below the host link.
HOST_COPY_THREADS = 8


class KVCopier:
    def __init__(self, kv_caches: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES):
        """kv_caches: per layer [num_blocks, block_size, *kv_shape] contiguous tensors."""
        self.num_layers = len(kv_caches)
        # The mean copy from which exports / imports go by batched row copies (the hand-off's
        # config sets them; None: never).
        self.export_min_copy_bytes: int | None = DIRECT_MIN_COPY_BYTES
        self.import_min_copy_bytes: int | None = DIRECT_MIN_COPY_BYTES
        num_slots = kv_caches[0].shape[0] * kv_caches[0].shape[1]
        # Per layer [num_slots, its row bytes] byte views of the cache.
        self.rows = [cache.view(num_slots, -1).view(torch.uint8) for cache in kv_caches]
        self.table = CacheRowsTable(self.rows)  # every layer's rows for one gather or scatter
        usable = kv_caches[0].device.type == "cuda" and batch_copies_available(kv_caches[0].device)
        self._row_copies = RowCopies(self.rows) if usable else None
        # How the last export or import copied: "host" (a CPU cache), "batched" (row copies on
        # the copy engines) or "staged" (device staging and one kernel).
        self.last_way = ""
        self.layer_bytes = tuple(rows.shape[1] for rows in self.rows)
        self.token_bytes = sum(self.layer_bytes)  # one token of every layer: a chunk's row
        self.device = kv_caches[0].device
        self.chunk_tokens = max(1, chunk_bytes // self.token_bytes)
        self.is_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._staging: torch.Tensor | None = None  # device, one chunk
        self._pinned: list[torch.Tensor] = []  # two host chunks
        self._threads: ThreadPoolExecutor | None = None

    def chunk_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """[start, end) token ranges of a request's chunks."""
        step = self.chunk_tokens
        return [(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step)]

    # --- export ------------------------------------------------------------------------------
    def export(self, slots: torch.Tensor, timings: dict | None = None) -> Iterator[np.ndarray]:
        """Yield the rows at `slots` chunk by chunk, each a [tokens x token_bytes] uint8 array
        (layer_rows) that stays valid until the next one is asked for (its buffer is then reused).
        timings, when given, gets "copy_s": the time spent gathering (waiting for the device
        copies on GPUs)."""
        bounds = self.chunk_bounds(len(slots))
        waited = 0.0
        if not self.is_cuda:
            for start, end in bounds:
                begin = time.perf_counter()
                chunk = torch.empty((end - start) * self.token_bytes, dtype=torch.uint8)
                self._gather(slots[start:end], chunk)
                waited += time.perf_counter() - begin
                yield chunk.numpy()
            self._record_way("host", timings)
            if timings is not None:
                timings["copy_s"] = waited
            return
        self._record_way("staged", timings)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            device_slots = slots.to(self.device, non_blocking=True)
            events = [self._gather_to_host(device_slots, bounds[0], 0)]
            for index, (start, end) in enumerate(bounds):
                if index + 1 < len(bounds):  # the next chunk copies while the caller puts this
                    events.append(self._gather_to_host(device_slots, bounds[index + 1], index + 1))
                begin = time.perf_counter()
                events[index].synchronize()
                waited += time.perf_counter() - begin
                yield self._host_view(index % 2, end - start).numpy()
        if timings is not None:
            timings["copy_s"] = waited

    def export_into(
        self, slots: torch.Tensor, chunks: list[torch.Tensor], timings: dict | None = None
    ) -> None:
        """Copy the rows at `slots` into host `chunks` (as `chunk_bounds` splits them, each a
        contiguous [tokens x token_bytes] uint8 tensor: page-locked on CUDA, so the copy is
        DMA); returns once they are there. timings gets "copy_s" as `export` does."""
        begin = time.perf_counter()
        bounds = self.chunk_bounds(len(slots))
        if not self.is_cuda:
            self._record_way("host", timings)
            for (start, end), chunk in zip(bounds, chunks):
                self._gather(slots[start:end], chunk)
        elif self.copies_directly(slots) and self._directly(self._export_by_runs, slots, chunks):
            self._record_way("batched", timings)
        else:
            self._record_way("staged", timings)
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                device_slots = slots.to(self.device, non_blocking=True)
                for (start, end), chunk in zip(bounds, chunks):
                    # One staging buffer: in stream order each gather waits for the copy before.
                    staging = self._device_view(end - start)
                    self._gather(device_slots[start:end], staging)
                    chunk.copy_(staging, non_blocking=True)
                self._stream.synchronize()
        if timings is not None:
            timings["copy_s"] = time.perf_counter() - begin

    def _gather_to_host(self, device_slots, bounds: tuple[int, int], index: int):
        start, end = bounds
        staging = self._device_view(end - start)
        self._gather(device_slots[start:end], staging)
        self._host_view(index % 2, end - start).copy_(staging, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    # --- import ------------------------------------------------------------------------------
    def import_(
        self, slots: torch.Tensor, chunks: Iterable[np.ndarray], pinned: bool = False
    ) -> None:
        """Write chunks (as `export` yields them, of a request laid out by `chunk_bounds` or in
        any token split) into the rows at `slots`; returns once they are in the cache.
        pinned: the chunks are page-locked host memory (an arena's mapping), copied to the
        device as they are, without the memcpy into the copier's pinned buffers."""
        start = 0
        if not self.is_cuda:
            self.last_way = "host"
            for num_tokens, layers, _ in self._pieces(chunks):
                for rows, host in zip(self.rows, layers):
                    rows[slots[start : start + num_tokens]] = host
                start += num_tokens
            return
        if pinned and self.copies_directly(slots, importing=True):
            chunks = list(chunks)
            if self._directly(self._import_by_runs, slots, chunks):
                self.last_way = "batched"
                return
        self.last_way = "staged"
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            device_slots = slots.to(self.device, non_blocking=True)
            freed = [None, None]  # per pinned buffer, the event after which it may be refilled
            for index, (num_tokens, layers, whole) in enumerate(self._pieces(chunks)):
                staging = self._device_view(num_tokens)
                if pinned:  # in stream order each copy waits for the scatter before
                    _copy_async(staging, layers, whole)
                else:
                    buffer = index % 2
                    if freed[buffer] is not None:
                        freed[buffer].synchronize()
                    host = self._host_view(buffer, num_tokens)
                    self._parallel_copy(layer_rows(host, self.layer_bytes), layers)
                    staging.copy_(host, non_blocking=True)
                    freed[buffer] = torch.cuda.Event()
                    freed[buffer].record(self._stream)
                chunk_slots = device_slots[start : start + num_tokens]
                ops.cache_rows(self.table, staging, chunk_slots, to_cache=True)
                start += num_tokens
            self._stream.synchronize()

    def _record_way(self, way: str, timings: dict | None) -> None:
        self.last_way = way
        if timings is not None:
            timings["way"] = way

    def _export_by_runs(self, slots: torch.Tensor, chunks: list[torch.Tensor]) -> None:
        host_slots = slots.numpy()
        for (start, end), chunk in zip(self.chunk_bounds(len(slots)), chunks):
            rows = layer_rows(chunk, self.layer_bytes)
            self._row_copies.issue(rows, host_slots[start:end], False, self._stream)
        self._stream.synchronize()

    def _import_by_runs(self, slots: torch.Tensor, chunks: list) -> None:
        host_slots, start = slots.numpy(), 0
        for num_tokens, layers, _ in self._pieces(chunks):
            piece = host_slots[start : start + num_tokens]
            self._row_copies.issue(layers, piece, True, self._stream)
            start += num_tokens
        self._stream.synchronize()

    def _directly(self, copy, slots: torch.Tensor, chunks: list) -> bool:
        """copy(slots, chunks) by batched row copies; False where the driver refused them (then
        this copier stages every later copy too, and the caller stages this one)."""
        try:
            copy(slots, chunks)
            return True
        except RuntimeError as error:
            logger.warning("batched KV row copies failed (%s); staging them from now on", error)
            self._row_copies = None
            return False

    def copies_directly(self, slots: torch.Tensor, importing: bool = False) -> bool:
        """Whether page-locked chunks of the rows at `slots` (CPU) leave (importing: enter)
        the cache by batched row copies: their copies average export_min_copy_bytes
        (import_min_copy_bytes) or more."""
        least = self.import_min_copy_bytes if importing else self.export_min_copy_bytes
        if self._row_copies is None or slots.device.type != "cpu" or least is None:
            return False
        return mean_copy_bytes(slots.numpy(), self.token_bytes, self.num_layers) >= least

    def _gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """out [len(slots) x token_bytes] <- every layer's rows at `slots` (layer_rows)."""
        ops.cache_rows(self.table, out, slots, to_cache=False)

    def _pieces(self, chunks: Iterable[np.ndarray]) -> Iterator[tuple]:
        """The chunks in pieces of at most chunk_tokens tokens (a chunk from another copier, or
        a merged payload, may be longer): (tokens, per layer [tokens, row bytes] host views,
        the piece as one contiguous tensor or None where it is not)."""
        for chunk in chunks:
            host = _as_tensor(chunk).reshape(-1)
            layers = layer_rows(host, self.layer_bytes)
            num_tokens = layers[0].shape[0]
            if num_tokens <= self.chunk_tokens:
                yield num_tokens, layers, host
                continue
            for begin in range(0, num_tokens, self.chunk_tokens):
                end = min(begin + self.chunk_tokens, num_tokens)
                yield end - begin, [layer[begin:end] for layer in layers], None

    def _parallel_copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """dst[layer].copy_(src[layer]) for per-layer host views, the layers spread over
        HOST_COPY_THREADS threads."""
        if sum(d.numel() for d in dst) < 4 * 2**20:
            _copy_layers(dst, src, range(len(dst)))
            return
        if self._threads is None:
            self._threads = ThreadPoolExecutor(HOST_COPY_THREADS, thread_name_prefix="kv-copy")
        layers = range(len(dst))
        groups = [layers[i::HOST_COPY_THREADS] for i in range(HOST_COPY_THREADS)]
        parts = [self._threads.submit(_copy_layers, dst, src, group) for group in groups if group]
        for part in parts:
            part.result()

    # --- buffers -----------------------------------------------------------------------------
    def _chunk_capacity_bytes(self) -> int:
        return self.chunk_tokens * self.token_bytes

    def _device_view(self, num_tokens: int) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(
                self._chunk_capacity_bytes(), dtype=torch.uint8, device=self.device
            )
        return self._staging[: num_tokens * self.token_bytes]

    def _host_view(self, buffer: int, num_tokens: int) -> torch.Tensor:
        if not self._pinned:
            capacity = self._chunk_capacity_bytes()
            self._pinned = [
                torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
        return self._pinned[buffer][: num_tokens * self.token_bytes]


def _copy_async(dst: torch.Tensor, layers: list[torch.Tensor], whole: torch.Tensor | None) -> None:
    """dst (a device chunk) <- a page-locked host piece: one copy where the piece is contiguous
    (a whole chunk), else one per layer (each layer's rows of a piece are contiguous), never a
    host copy to make it contiguous."""
    if whole is not None:
        dst.copy_(whole, non_blocking=True)
        return
    for staged, host in zip(layer_rows(dst, tuple(h.shape[1] for h in layers)), layers):
        staged.copy_(host, non_blocking=True)


def _copy_layers(dst: list[torch.Tensor], src: list[torch.Tensor], layers: range) -> None:
    for layer in layers:
        dst[layer].copy_(src[layer])


def _as_tensor(chunk) -> torch.Tensor:
    """A host chunk (numpy, possibly a read-only object-store buffer) as a uint8 tensor view."""
    if isinstance(chunk, torch.Tensor):
        return chunk
    with warnings.catch_warnings():  # object-store buffers are read-only; they are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(chunk))
