"""One worker's side of the KV hand-off: how its exports leave and its imports arrive.

Export (`KVHandoffConfig.path`):
- "auto": into this worker's shared-memory arena (workers/runner/kv_arena.py), one device ->
  host copy; the payload returned carries only the span's name. When the arena has no room,
  as "object_store". A request whose prompt ends in a step of this worker is copied there layer
  by layer during that step (`start_layer_exports`, workers/runner/layer_export.py): its export
  then only waits for the last layers.
- "object_store": chunk by chunk into pinned memory and the object store (one `ray.put` each,
  while the next chunk copies); the payload carries the chunks' ObjectRefs.
Import, whatever form arrives: an arena on this Ray node is mapped and copied from directly
(kv_arena_maps.py); an arena on another node is put into the object store by its owner when
asked (`kv_from_arena`, a method every exporting actor offers) and pulled from there; chunks
in the object store are pulled. The import releases the arena span once its copy has landed;
`discard` releases the spans of a hand-off that will not be imported.

Timings (seconds) travel with the payload: the export's "copy_s", "put_s", "export_s" (from
the export's call on: what it adds after the step) and "path"; the import adds "get_s"
(headers, mappings, and for object-store chunks their get), "copy_s" and its own "path"
("shm", "object_store", or "arena_via_object_store": from an arena on another node).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import ray
import torch

from rayinfer.comm.rendezvous import this_node_id
from rayinfer.engine_config import DEFAULT_KV_HANDOFF, KVHandoffConfig
from rayinfer.workers.runner.kv_arena import KVArena
from rayinfer.workers.runner.kv_arena_maps import ArenaMaps
from rayinfer.workers.runner.kv_cache import KVCache
from rayinfer.workers.runner.kv_copy import KVCopier
from rayinfer.workers.runner.kv_transfer import (
    KVPayload,
    arena_chunks,
    fetch_payloads,
    token_slots,
)
from rayinfer.workers.runner.layer_export import LayerExport, LayerExporter, StepCopies, chunk_rows

logger = logging.getLogger(__name__)

# The hand-off's object can no longer be read (OwnerDiedError is an ObjectLostError); an export
# whose worker died before it finished, or that failed, reads the same: decode recomputes.
LOST_OBJECT_ERRORS = (
    ray.exceptions.ObjectLostError,
    ray.exceptions.ObjectFetchTimedOutError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.RayActorError,
    ray.exceptions.RayTaskError,
)


@dataclass
class Landed:
    """An import that landed: the sampling generator's state that came with it, and timings."""

    generator_state: torch.Tensor | None
    timings: dict


class KVLost(Exception):
    """A payload the import needs cannot be read as exported (its owner died, its object or
    arena span is gone or was reused)."""


class HandoffIO:
    def __init__(
        self,
        is_cuda: bool,
        config: KVHandoffConfig = DEFAULT_KV_HANDOFF,
        import_timeout_s: float = 60.0,
    ):
        """is_cuda: the cache is on a GPU (the arena and the mappings are page-locked)."""
        self.is_cuda = is_cuda
        self.config = config
        self.import_timeout_s = import_timeout_s
        self.arena: KVArena | None = None
        self._arena_failed = False  # the arena could not be made: every export goes by store
        self.maps = ArenaMaps(pin=is_cuda)
        # Spans are taken by the step's thread (layer exports) and the KV transfer thread.
        self._arena_lock = threading.Lock()
        self.layer_exports: dict[str, LayerExport] = {}  # request id -> copied during its step
        self._layer_exporter: LayerExporter | None = None

    # --- export ------------------------------------------------------------------------------
    def start_layer_exports(self, cache: KVCache, requests: list) -> StepCopies | None:
        """Before a step's forward: spans for the requests (ScheduledRequests whose prompt this
        step ends, prefill-only) that the step copies out layer by layer as it caches them; the
        step's copies (None: none goes that way). A request goes the usual way instead where
        exports do not go to the arena, the cache keeps window state, the arena has no room,
        or (CUDA) its slots lie in runs too short for row copies (export_direct_min_copy_bytes)."""
        config = self.config
        if config.path != "auto" or not config.layer_by_layer or cache.window_layers:
            return None
        arena = self._arena()
        if arena is None:
            return None
        copier, exports = self._configured_copier(cache), []
        for request in requests:
            self.drop_layer_exports([request.request_id])  # a stale one (a recomputed prompt)
            num_tokens = request.seq_len
            slots = token_slots(request.block_table, num_tokens, cache.block_size)
            if copier.is_cuda and not copier.copies_directly(slots):
                continue
            header = replace(cache.export_header(num_tokens, None),
                             arena_chunk_tokens=copier.chunk_tokens)  # fmt: skip
            with self._arena_lock:
                span = arena.allocate(header.num_bytes)
            if span is None:
                break
            slots = slots.numpy()
            export = LayerExport(
                request.request_id, header, span,
                [slots[start:end] for start, end in copier.chunk_bounds(num_tokens)],
                chunk_rows(arena_chunks(arena.view(span), header), copier.layer_bytes),
            )  # fmt: skip
            self.layer_exports[request.request_id] = export
            exports.append(export)
        if not exports:
            return None
        if self._layer_exporter is None:
            self._layer_exporter = LayerExporter(copier.rows)
        return self._layer_exporter.step(exports)

    def drop_layer_exports(self, request_ids: list[str]) -> None:
        """Forget the layer exports of these requests that no export took (a request that ended
        at its first token, or was aborted): their spans are freed once their copies end."""
        for request_id in request_ids:
            export = self.layer_exports.pop(request_id, None)
            if export is not None:
                export.wait()
                with self._arena_lock:
                    if self.arena is not None:
                        self.arena.free(export.span)

    def export(
        self,
        cache: KVCache,
        block_table: list[int],
        num_tokens: int,
        generator_state: torch.Tensor | None,
        window_table: list[int] | None = None,
        request_id: str | None = None,
    ) -> KVPayload:
        """The request's first num_tokens tokens of KV, out of the cache before this returns:
        in the arena (a header naming its span) or in the object store (chunk ObjectRefs);
        window state (a window pool's, window_table) travels whole in the header. A request
        copied out during its step (request_id's layer export) only waits for its last copies."""
        start = time.perf_counter()
        started = self.layer_exports.pop(request_id, None) if request_id is not None else None
        if started is not None:
            if started.header.num_tokens == num_tokens and not started.failed:
                return self._finish_layer_export(started, generator_state, start)
            self.layer_exports[request_id] = started
            self.drop_layer_exports([request_id])
        self._configured_copier(cache)
        header = cache.export_header(num_tokens, generator_state, window_table)
        arena = self._arena() if self.config.path == "auto" else None
        span = None
        if arena is not None:
            with self._arena_lock:
                span = arena.allocate(header.num_bytes)
        if span is not None:
            try:
                header = cache.export_into(block_table, header, arena.view(span))
            except BaseException:
                with self._arena_lock:
                    arena.free(span)
                raise
            header.arena = span
            header.timings.update(path="shm", put_s=0.0)
        else:
            header = self._export_to_store(
                cache, block_table, num_tokens, generator_state, window_table
            )
        header.timings["export_s"] = time.perf_counter() - start
        return header

    def _configured_copier(self, cache: KVCache) -> KVCopier:
        """The cache's copier, taking batched row copies at this config's copy sizes."""
        copier = cache.copier
        copier.export_min_copy_bytes = self.config.export_direct_min_copy_bytes
        copier.import_min_copy_bytes = self.config.import_direct_min_copy_bytes
        return copier

    def _finish_layer_export(self, export: LayerExport, generator_state, start: float):
        waited = export.wait()
        header = replace(export.header, generator_state=generator_state, arena=export.span)
        header.timings.update(path="shm", put_s=0.0, copy_s=waited, way="layers")
        header.timings["export_s"] = time.perf_counter() - start
        return header

    def _export_to_store(
        self, cache, block_table, num_tokens, generator_state, window_table=None
    ) -> KVPayload:
        header, chunks = cache.export_chunks(block_table, num_tokens, generator_state, window_table)
        refs, put_s = [], 0.0
        for chunk in chunks:  # the next chunk copies while this one is put
            begin = time.perf_counter()
            refs.append(ray.put(chunk))
            put_s += time.perf_counter() - begin
        header.timings.update(path="object_store", put_s=put_s)
        return header.with_chunks(refs)

    def _arena(self) -> KVArena | None:
        """This worker's arena, made at its first export (page-locked on CUDA); None when it
        cannot be made (then the object store takes every export)."""
        if self.arena is None and not self._arena_failed:
            try:
                owner = ray.get_runtime_context().current_actor if ray.is_initialized() else None
            except RuntimeError:  # not inside an actor: no one to ask from another node
                owner = None
            config = self.config
            try:
                self.arena = KVArena(config.arena_bytes, config.lease_s, self.is_cuda, owner)
            except (OSError, RuntimeError) as error:
                logger.warning("no KV hand-off arena (%s); exports go through the object store",
                               error)  # fmt: skip
                self._arena_failed = True
        return self.arena

    def kv_from_arena(self, header: KVPayload) -> KVPayload | None:
        """For an importer on another node: the header's chunks put into the object store from
        this worker's arena (the span stays held until the importer releases it: other ranks
        may ask too); None when the span is no longer held."""
        span = header.arena
        if self.arena is None or not self.arena.holds(span):
            return None
        begin = time.perf_counter()
        refs = [ray.put(chunk.numpy()) for chunk in arena_chunks(self.arena.view(span), header)]
        timings = dict(header.timings, put_s=time.perf_counter() - begin)
        # the header as it is (its window state and layer shapes too), its chunks in the store
        return replace(header, chunks=refs, timings=timings, arena=None, arena_chunk_tokens=0)

    # --- import ------------------------------------------------------------------------------
    def import_(
        self,
        cache: KVCache,
        block_table: list[int],
        shards: list,
        needs=lambda payload: True,
        release: bool = True,
        window_table: list[int] | None = None,
    ) -> Landed:
        """Write this rank's part of a hand-off (shards: per prefill worker an ObjectRef to, or
        a, KVPayload; `needs(payload)`: whether this rank takes from it) into the cache. Raises
        KVLost when a payload it needs is gone. release: free the arena spans read once the
        copy has ended, landed or not (False where other ranks read them too: whoever knows
        that all of them have ended calls `discard`)."""
        start = time.perf_counter()
        self._configured_copier(cache)
        try:
            payloads = fetch_payloads(shards, needs, self.import_timeout_s)
        except LOST_OBJECT_ERRORS as error:
            raise KVLost(type(error).__name__) from None
        spans = [p.arena for p in payloads if p.arena is not None]
        try:
            payloads, path = self._resolve(payloads)
            fetched = time.perf_counter()
            state = cache.import_payloads(block_table, payloads, window_table)
            mapped = [p.arena for p in payloads if p.arena is not None]  # read from the mapping
            if not all(self.maps.still_holds(span) for span in mapped):
                raise KVLost("an arena span was taken back during the copy")
        except LOST_OBJECT_ERRORS as error:
            raise KVLost(type(error).__name__) from None
        finally:
            if release:
                self._release(spans)
        timings = {
            "path": path,
            "get_s": fetched - start,
            "copy_s": time.perf_counter() - fetched,
            "way": cache.last_import_way,
            "export": dict(payloads[0].timings),
        }
        return Landed(state, timings)

    def _resolve(self, payloads: list[KVPayload]) -> tuple[list, str]:
        """The payloads with their chunks in this process (views of an arena mapped here, which
        keep their `arena`, or object-store buffers), and the path they came by."""
        resolved, path = [], "object_store"
        here = this_node_id()
        for payload in payloads:
            span = payload.arena
            if span is None:
                resolved.append(payload)
            elif span.node_id == here:
                memory = self.maps.view(span)
                if memory is None:
                    raise KVLost(f"the arena {span.path} is gone or its span was reused")
                resolved.append(payload.with_chunks(arena_chunks(memory, payload)))
                path = "shm"
            else:
                resolved.append(self._pull_from_other_node(payload))
                path = "arena_via_object_store"
        return resolved, path

    def _pull_from_other_node(self, payload: KVPayload) -> KVPayload:
        """The payload's chunks put into the object store by their arena's owner, pulled here
        (arena None: buffers of the object store)."""
        if payload.arena.owner is None:
            raise KVLost("an arena on another node, with no owner to ask")
        timeout = self.import_timeout_s
        put = ray.get(payload.arena.owner.kv_from_arena.remote(payload), timeout=timeout)
        if put is None:
            raise KVLost("the exporter no longer holds the arena span")
        return put.with_chunks(ray.get(put.chunks, timeout=timeout))

    def discard(self, shards: list) -> None:
        """Release the arena spans of a hand-off that will not be imported (aborted, or ended
        at its first token), or that every rank reading them has imported; a payload that is
        gone needs nothing."""
        try:
            headers = fetch_payloads(shards, lambda p: p.arena is not None, self.import_timeout_s)
        except LOST_OBJECT_ERRORS:
            return
        self._release([header.arena for header in headers])

    def release_own_span(self, span) -> None:
        """Free a span of this worker's arena (an importer on another node is done with it)."""
        if self.arena is not None:
            with self._arena_lock:
                self.arena.free(span)

    def _release(self, spans: list) -> None:
        """Tell the spans' owners they may reuse them: through the arena's header on this node,
        by a call to the owner from another (it no longer holds a span that is gone)."""
        here = this_node_id()
        for span in spans:
            if span.node_id == here:
                self.maps.release(span)
            elif span.owner is not None:
                span.owner.release_arena_span.remote(span)

    def close(self) -> None:
        """Unlink this worker's arena and drop its mappings of others' (at shutdown)."""
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self._arena_failed = True  # exports after this go through the object store
        self.maps.close()
