"""Admission at the ingress: take a request only if the engines can start it within a deadline.

A request is *waiting* from its admission until it has started: its first decode token arrived,
or it finished in prefill (a failed or abandoned request stops waiting too). The wait of a new
request is estimated as

    estimated_wait_s = (num_waiting + 1) / start_rate

where `start_rate` is measured, not configured: the starts of the last `num_samples` requests
divided by the *queued* time they took (time during which at least two requests were waiting,
so the engines had more work than one request). Only that time measures how fast the engines
start requests: one request at a time starts at the rate its latency allows, far below what a
batch starts (a 3.7k-token prompt alone measured 0.5 starts/s on an H200, where a burst of 16
starts at about 5/s), and measuring it shed a burst of 16 on an idle replica (issue 28). So a
start counts only when it left a queue (two or more waiting, or queued time passed since the
last counted start). Time with fewer waiting does not count, so a quiet server keeps its last
rate; queued time without a start does, so a stalled server's rate falls while it stalls (one
start more than measured is counted: the start under way). Until a queue has given it a rate,
a replica that has only seen requests one at a time takes their rate times `parallelism` (the
requests its engines batch at once: as if a batch started as fast as one request does, an
optimistic bound, so a burst on an idle replica is admitted while one far past what a batch
holds is shed); before any start it admits everything.

A request whose estimate exceeds `max_wait_s` is refused with a retry delay: the time until the
waiting requests ahead of it have drained to what fits in the deadline. The counts are this
ingress replica's own (each replica admits for itself). Pure Python, no Ray: tested on its own.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

QUEUED = 2  # requests waiting at once for the engines' start rate to be measured


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: its estimated wait and when to retry (whole seconds)."""

    estimated_wait_s: float
    retry_after_s: int


class Admission:
    def __init__(
        self,
        max_wait_s: float | None,
        num_samples: int = 256,
        clock: Callable[[], float] = time.monotonic,
        parallelism: int = 1,
    ):
        """max_wait_s: the deadline a new request must be estimated to start within (None: no
        bound, every request is admitted). num_samples: starts the rate is measured over.
        parallelism: requests the engines run at once (the rate's bound before a queue)."""
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.num_waiting = 0
        self._busy_s = 0.0  # queued time up to _busy_mark
        self._busy_mark = clock()
        self._counted_busy_s = 0.0  # queued time at the last counted start
        self._start_stamps: deque[float] = deque(maxlen=num_samples)  # busy time at each start
        self._window_origin_s = 0.0  # busy time at the start that left the window last
        self.parallelism = parallelism
        self._alone_s = 0.0  # time with exactly one request waiting
        self._alone_starts = 0  # starts not counted as queued

    def start_rate(self) -> float:
        """Starts per second of queued time over the window, counting the start under way;
        before a queue, the one-at-a-time rate times `parallelism`; infinite before any
        start (nothing measured yet)."""
        busy_s = self._busy_time() - self._window_origin_s
        if self._start_stamps and busy_s > 0:
            return (len(self._start_stamps) + 1) / busy_s
        if self._alone_starts and self._alone_s > 0:
            return self._alone_starts / self._alone_s * self.parallelism
        return math.inf

    def estimated_wait_s(self) -> float:
        """How long a request admitted now would wait to start."""
        return (self.num_waiting + 1) / self.start_rate()

    def try_admit(self) -> Refusal | None:
        """Admit a request (it counts as waiting until `start` or `leave`), or say why not."""
        wait_s = self.estimated_wait_s()
        if self.max_wait_s is not None and wait_s > self.max_wait_s:
            return Refusal(wait_s, max(1, math.ceil(wait_s - self.max_wait_s)))
        self._set_waiting(self.num_waiting + 1)
        return None

    def start(self) -> None:
        """An admitted request started: it stops waiting; its start is measured if it left a
        queue (see the module's docstring)."""
        busy_s = self._busy_time()
        if self.num_waiting >= QUEUED or busy_s > self._counted_busy_s:
            stamps = self._start_stamps
            if len(stamps) == stamps.maxlen:
                self._window_origin_s = stamps[0]
            stamps.append(busy_s)
            self._counted_busy_s = busy_s
        else:
            self._alone_starts += 1
        self._set_waiting(self.num_waiting - 1)

    def leave(self) -> None:
        """An admitted request stopped waiting without starting (it failed or was abandoned)."""
        self._set_waiting(self.num_waiting - 1)

    def _busy_time(self) -> float:
        """Queued time so far: while at least QUEUED requests were waiting."""
        now = self.clock()
        if self.num_waiting >= QUEUED:
            self._busy_s += now - self._busy_mark
        elif self.num_waiting == 1:
            self._alone_s += now - self._busy_mark
        self._busy_mark = now
        return self._busy_s

    def _set_waiting(self, num_waiting: int) -> None:
        self._busy_time()  # close the interval at the old count
        self.num_waiting = num_waiting
