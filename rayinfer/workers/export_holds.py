"""The exporting group's own references to its hand-offs, kept until the importer is done.

A hand-off's ObjectRefs (KVRefs.shards: the returns of the workers' `export_kv` calls) are
owned by the process that made those calls, a Prefill replica, and reach decode nested in that
replica's reply. Serve sends a reply as an item of a streaming generator
(`handle_request_with_rejection`), and Ray can lose the borrow of ObjectRefs nested in such an
item (ray-project/ray#58080): the owner then frees the payload's header once its own references
are gone, and the decode worker's read fails with ReferenceCountingAssertionError, so decode
recomputes the prompt (about one hand-off in 1,000 at 48 concurrent requests on CPU). A
reference the owner itself holds keeps the object whatever the borrow bookkeeping says.

A hand-off is held from its export's start until its importer is done with it: an arena
export's spans, mapped here, are released by the importer (or taken back by their owner, or
their arena is gone). Where nothing here shows that (an export through the object store, or
into an arena on another node), it is held until the lease has passed since its export ended
(`KVHandoffConfig.lease_s`: as long as an arena keeps a span nobody released), and such holds
keep at most `KVHandoffConfig.arena_bytes` of KV (the oldest ended ones let go first): an arena
never keeps more for its importers either, so a steady load across nodes does not keep a whole
lease of hand-offs in the object store. Letting go of a hold frees nothing a reader still
borrows; it only ends this guard for that hand-off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from rayinfer.comm.rendezvous import this_node_id
from rayinfer.workers.handoff_io import LOST_OBJECT_ERRORS
from rayinfer.workers.runner.kv_arena import ArenaSpan
from rayinfer.workers.runner.kv_arena_maps import ArenaMaps


@dataclass
class _Held:
    request_id: str
    shards: list[ray.ObjectRef]
    num_bytes: int  # the KV it carries
    until: float | None = None  # time.monotonic() past which it is dropped; None: exporting
    spans: list[ArenaSpan] | None = None  # whose release ends it; None: only the lease does


class ExportHolds:
    def __init__(self, lease_s: float, max_unseen_bytes: int):
        """max_unseen_bytes: the most KV held for hand-offs whose import nothing here shows."""
        self.lease_s = lease_s
        self.max_unseen_bytes = max_unseen_bytes
        self.held: list[_Held] = []
        self.maps = ArenaMaps(pin=False)  # the header tables of this node's arenas

    @property
    def request_ids(self) -> list[str]:
        return [held.request_id for held in self.held]

    def hold(self, request_id: str, shards: list[ray.ObjectRef], num_bytes: int) -> None:
        """Keep an export's references (from the call that started it) until its import."""
        self.held.append(_Held(request_id, list(shards), num_bytes))

    def drop_done(self) -> None:
        """Forget the hand-offs their importers are done with, those past their lease, and the
        oldest whose import nothing here shows past max_unseen_bytes."""
        self._note_ended_exports()
        now = time.monotonic()
        self.held = [held for held in self.held if not self._is_done(held, now)]
        unseen = [held for held in self.held if held.until is not None and held.spans is None]
        excess = sum(held.num_bytes for held in unseen) - self.max_unseen_bytes
        let_go = set()
        for held in unseen:  # in export order: the oldest first
            if excess <= 0:
                break
            let_go.add(id(held))
            excess -= held.num_bytes
        if let_go:
            self.held = [held for held in self.held if id(held) not in let_go]

    def clear(self) -> None:
        self.held = []
        self.maps.close()

    def _note_ended_exports(self) -> None:
        """Start the lease of each export that has ended, and find its arena spans."""
        exporting = [held for held in self.held if held.until is None]
        calls = [shard for held in exporting for shard in held.shards]
        if not calls:
            return
        ended, _ = ray.wait(calls, num_returns=len(calls), timeout=0, fetch_local=False)
        ended, here = set(ended), this_node_id()
        for held in exporting:
            if not all(shard in ended for shard in held.shards):
                continue
            held.until = time.monotonic() + self.lease_s
            try:
                spans = [header.arena for header in ray.get(held.shards)]
            except LOST_OBJECT_ERRORS:  # the export failed: nothing left to keep
                held.until = 0.0
                continue
            if all(span is not None and span.node_id == here for span in spans):
                held.spans = spans

    def _is_done(self, held: _Held, now: float) -> bool:
        if held.until is None:
            return False
        if now > held.until:
            return True
        return held.spans is not None and all(map(self._is_let_go, held.spans))

    def _is_let_go(self, span: ArenaSpan) -> bool:
        """Whether the span's importer released it, or its owner no longer holds it."""
        return self.maps.is_released(span) or not self.maps.still_holds(span)
