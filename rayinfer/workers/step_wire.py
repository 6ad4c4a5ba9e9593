"""What a worker group sends its workers of each scheduled request, step after step: `SentState`
remembers what the workers of each data-parallel replica already hold, so that a step carries
only what is new (Worker._complete_requests rebuilds the rest on the worker)."""

from __future__ import annotations

from dataclasses import replace

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.engine.sampling_params import SamplingParams


class SentState:
    def __init__(self):
        # request id -> (DP replica, the sequence's block table list, blocks sent): a table only
        # grows while it is the same list (a freed or preempted sequence gets a new one), so each
        # step sends the blocks added since (256 decodes' 512-block tables pickled to 557 KB per
        # worker call, past Ray's 100 KB inline limit)
        self.tables: dict[str, tuple[int, list[int], int]] = {}
        # request id -> (DP replica, the SamplingParams object sent): its workers keep it, so
        # later steps send none (64 decodes' params were 0.8 of 1.2 ms pickling a step's
        # requests and back, `cpu`)
        self.params: dict[str, tuple[int, SamplingParams]] = {}

    def as_sent(self, replica: int, requests: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The replica's requests as sent: a request whose table its workers already hold (the
        same list, on the same replica) carries only the blocks added since, and one whose
        SamplingParams they hold (the same object) carries none (`params` None)."""
        wire = []
        for request in requests:
            table = request.block_table
            known = self.tables.get(request.request_id)
            held = known[2] if known and known[0] == replica and known[1] is table else 0
            self.tables[request.request_id] = (replica, table, len(table))
            changes = {}
            if held:
                windows = request.window_table
                windows = None if windows is None else windows[held:]
                changes = dict(block_table=table[held:], block_table_from=held,
                               window_table=windows)  # fmt: skip
            sent = self.params.get(request.request_id)
            if sent and sent[0] == replica and sent[1] is request.params:
                changes["params"] = None
            self.params[request.request_id] = (replica, request.params)
            wire.append(replace(request, **changes) if changes else request)
        return wire

    def forget(self, request_ids: list[str]) -> None:
        """Freed requests: an id used again starts over."""
        for request_id in request_ids:
            self.tables.pop(request_id, None)
            self.params.pop(request_id, None)
