"""The KV copies of hand-offs while the engine keeps stepping: exports and imports in flight.

An export (a prefill-only request's KV going out) keeps the request's blocks until the executor
reports the copy done. An import (a prefilled request arriving) waits for blocks and a seat,
is copied in, and then joins the running batch; one whose KV was lost (KVLostError) is queued
to recompute its prompt here instead, as if preempted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rayinfer.engine.executor import Executor, KVLostError
from rayinfer.engine.request_state import RequestState
from rayinfer.engine.scheduler import Scheduler
from rayinfer.engine.sequence import Sequence, SequenceStatus
from rayinfer.engine_config import SchedulerConfig

# How long a step with nothing to run but copies in flight waits for one of them to finish
# (instead of spinning); new requests wait at most this long for the loop.
TRANSFER_WAIT_S = 0.002


@dataclass
class PendingImport:
    state: RequestState
    payload: Any
    transfer: Any = None  # the executor's handle while the copy is in flight
    aborted: bool = False  # aborted while in flight: its blocks are freed once the copy ends


@dataclass
class Export:
    seq: Sequence
    transfer: Any  # the executor's handle: its blocks are freed once it is done


class Handoffs:
    def __init__(
        self,
        scheduler: Scheduler,
        scheduler_config: SchedulerConfig,
        executor: Executor,
        free_request: Callable[[str], None],
    ):
        """free_request: frees a request's executor state at the end of the step."""
        self.scheduler = scheduler
        self.scheduler_config = scheduler_config
        self.executor = executor
        self.free_request = free_request
        self.pending_imports: list[PendingImport] = []  # waiting for blocks
        self.imports_in_flight: list[PendingImport] = []  # blocks allocated, KV being copied
        self.exports_in_flight: list[Export] = []
        self.num_kv_recomputes = 0  # hand-offs whose KV was lost, so decode recomputed the prompt

    @property
    def busy(self) -> bool:
        """Whether an import waits or a copy is in flight."""
        return bool(self.pending_imports or self.imports_in_flight or self.exports_in_flight)

    def start_export(self, seq: Sequence) -> Any:
        """Start copying out a finished prefill-only request's prompt KV; its payload."""
        payload = self.executor.export_kv(
            seq.request_id, seq.block_table, seq.num_prompt_tokens, seq.kv_partition,
            window_table=_window_table(seq),
        )  # fmt: skip
        self.exports_in_flight.append(Export(seq, payload))
        if self.executor.transfers_done([payload]) == [True]:  # an in-process copy: done
            self.finish_transfers()
        return payload

    def abort(self, state: RequestState) -> bool:
        """Forget a waiting import of `state` (its payload released); True when its KV is being
        copied in (its blocks are freed when that ends), so the caller leaves the rest to
        `finish_transfers`."""
        for pending in self.pending_imports:
            if pending.state is state:
                self.executor.discard_kv(pending.payload)
        self.pending_imports = [p for p in self.pending_imports if p.state is not state]
        for pending in self.imports_in_flight:
            if pending.state is state:
                pending.aborted = True
                return True
        return False

    def admit_pending_imports(self) -> None:
        """Give waiting hand-offs blocks and start copying their KV in (while seats last: an
        import in flight holds a seat)."""
        still_pending = []
        for pending in self.pending_imports:
            seq = pending.state.seq
            seq.kv_partition = self.scheduler.roomiest_partition()
            manager = self.scheduler.manager_of(seq)
            seated = len(self.scheduler.running) + len(self.imports_in_flight)
            fits = manager.can_allocate_slots(seq, seq.num_tokens, imported=True)
            if not fits or seated >= self.scheduler_config.max_num_seqs:
                seq.kv_partition = None
                still_pending.append(pending)
                continue
            manager.allocate_slots(seq, seq.num_prompt_tokens, imported=True)
            try:
                pending.transfer = self.executor.import_kv(
                    seq.request_id, seq.block_table, pending.payload, seq.kv_partition,
                    window_table=_window_table(seq),
                )  # fmt: skip
            except KVLostError:
                self._recompute_lost_handoff(seq)
                continue
            self.imports_in_flight.append(pending)
        self.pending_imports = still_pending

    def finish_transfers(self) -> None:
        """Free the blocks of finished exports; start decoding the imports that have landed."""
        exports, imports = self.exports_in_flight, self.imports_in_flight
        if not exports and not imports:
            return
        done = self.executor.transfers_done(
            [e.transfer for e in exports] + [p.transfer for p in imports]
        )
        self.exports_in_flight = [e for e, d in zip(exports, done) if not d]
        for export in (e for e, d in zip(exports, done) if d):
            self.scheduler.release(export.seq)
            self.free_request(export.seq.request_id)
        self.imports_in_flight = [p for p, d in zip(imports, done[len(exports) :]) if not d]
        for pending in (p for p, d in zip(imports, done[len(exports) :]) if d):
            self._land_import(pending)

    def wait_for_a_transfer(self) -> None:
        transfers = [e.transfer for e in self.exports_in_flight]
        transfers += [p.transfer for p in self.imports_in_flight]
        if transfers:
            self.executor.wait_for_transfers(transfers, TRANSFER_WAIT_S)

    def _land_import(self, pending: PendingImport) -> None:
        seq = pending.state.seq
        try:
            self.executor.finish_import(pending.transfer)
        except KVLostError:
            if pending.aborted:
                self.scheduler.manager_of(seq).free(seq)
                self.free_request(seq.request_id)
            else:
                self._recompute_lost_handoff(seq)
            return
        if pending.aborted:
            self.scheduler.finish(seq, "abort")
            self.free_request(seq.request_id)
            return
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.scheduler.manager_of(seq).mark_computed(seq)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)

    def _recompute_lost_handoff(self, seq: Sequence) -> None:
        """Queue the request to compute its prompt and first token here, as if preempted."""
        self.scheduler.manager_of(seq).free(seq)
        self.num_kv_recomputes += 1
        self.scheduler.add(seq)


def _window_table(seq: Sequence) -> list[int] | None:
    """The sequence's window table where its cache keeps a window pool, else None."""
    return seq.window_table or None
