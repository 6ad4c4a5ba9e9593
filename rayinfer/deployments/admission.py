"""Admission at the ingress: take a request only if the engines can start it within a deadline.

A request is *waiting* from its admission until it has started: its first decode token arrived,
or it finished in prefill (a failed or abandoned request stops waiting too). A request of several
runs (a completions batch, `n` > 1: one run per choice) is admitted or refused as one, and each
of its runs waits on its own. The wait of a new request of `k` runs is estimated as

    estimated_wait_s = (num_waiting + k) / start_rate

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

Waiting that ends without a start measures nothing about the engines. A queue (a stretch of two
or more waiting) in which more requests left than started is not measured: the rate is the one
from before it, while it lasts and after. Such a queue is mostly one request's runs refused by
Serve's full queues, cancelled with a sibling's failure, or abandoned by clients: its time over
the few starts in it is no rate of the engines, and counting it would shed later requests the
engines could start at once. Lone waiting that ends in a leave is dropped too.

A request is refused only while others wait: with none waiting (nothing admitted is still to
start) it is admitted whatever the estimate says, since no wait would make it fit better. A
refused request's retry delay is the time until it would be admitted: until the waiting
requests ahead of it have drained to what fits in the deadline, or drained entirely. The counts
are this ingress replica's own (each replica admits for itself). Pure Python, no Ray: tested
on its own.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

QUEUED = 2  # requests waiting at once for the engines' start rate to be measured


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: its estimated wait and when to retry (whole seconds)."""

    estimated_wait_s: float
    retry_after_s: int


@dataclass
class QueuedStarts:
    """The starts that left a queue, and the queued time they took."""

    num_samples: int
    busy_s: float = 0.0  # queued time so far
    counted_busy_s: float = 0.0  # queued time at the last counted start
    window_origin_s: float = 0.0  # queued time at the start that left the window last
    stamps: deque[float] = field(default_factory=deque)  # queued time at each counted start

    def count_start(self) -> None:
        if len(self.stamps) == self.num_samples:
            self.window_origin_s = self.stamps.popleft()
        self.stamps.append(self.busy_s)
        self.counted_busy_s = self.busy_s

    def rate(self) -> float | None:
        """Starts per second of queued time over the window, counting the start under way
        (None: no start measured yet)."""
        busy_s = self.busy_s - self.window_origin_s
        if self.stamps and busy_s > 0:
            return (len(self.stamps) + 1) / busy_s
        return None

    def copy(self) -> QueuedStarts:
        return QueuedStarts(
            self.num_samples, self.busy_s, self.counted_busy_s, self.window_origin_s,
            deque(self.stamps),
        )  # fmt: skip


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
        self.parallelism = parallelism
        self._mark = clock()  # when the counts below were last brought up to date
        self._queued = QueuedStarts(num_samples)
        self._before_queue: QueuedStarts | None = None  # while a queue lasts: before it began
        self._num_queue_starts = 0  # starts and leaves during the current queue
        self._num_queue_leaves = 0
        self._alone_s = 0.0  # time with exactly one request waiting, up to a start
        self._alone_pending_s = 0.0  # and since the last start
        self._alone_starts = 0  # starts not counted as queued

    def start_rate(self) -> float:
        """Starts per second of queued time (see the module's docstring); before a queue, the
        one-at-a-time rate times `parallelism`; infinite before any start."""
        self._advance()
        rate = self._measured().rate()
        if rate is not None:
            return rate
        if self._alone_starts and self._alone_s > 0:
            return self._alone_starts / self._alone_s * self.parallelism
        return math.inf

    def estimated_wait_s(self, num_requests: int = 1) -> float:
        """How long the last of num_requests admitted now would wait to start."""
        return (self.num_waiting + num_requests) / self.start_rate()

    def try_admit(self, num_requests: int = 1) -> Refusal | None:
        """Admit num_requests together (one request's runs; each counts as waiting until its
        `start` or `leave`), or say why not."""
        rate = self.start_rate()
        wait_s = (self.num_waiting + num_requests) / rate
        if self.max_wait_s is not None and self.num_waiting > 0 and wait_s > self.max_wait_s:
            until_fits_s = wait_s - self.max_wait_s
            until_idle_s = self.num_waiting / rate
            return Refusal(wait_s, max(1, math.ceil(min(until_fits_s, until_idle_s))))
        self._set_waiting(self.num_waiting + num_requests)
        return None

    def start(self) -> None:
        """An admitted request started: it stops waiting; its start is measured if it left a
        queue (see the module's docstring)."""
        self._advance()
        queued = self._queued
        if self.num_waiting >= QUEUED or queued.busy_s > queued.counted_busy_s:
            queued.count_start()
        else:
            self._alone_starts += 1
        if self.num_waiting >= QUEUED:
            self._num_queue_starts += 1
        self._alone_s += self._alone_pending_s
        self._alone_pending_s = 0.0
        self._set_waiting(self.num_waiting - 1)

    def leave(self) -> None:
        """An admitted request stopped waiting without starting (it failed or was abandoned)."""
        if self.num_waiting >= QUEUED:
            self._num_queue_leaves += 1
        self._set_waiting(self.num_waiting - 1)
        if self.num_waiting == 0:
            self._alone_pending_s = 0.0

    def _measured(self) -> QueuedStarts:
        """The queued starts to estimate from: without the current queue if it is not measured."""
        if self._before_queue is not None and self._num_queue_leaves > self._num_queue_starts:
            return self._before_queue
        return self._queued

    def _advance(self) -> None:
        """Count the time since the last call at the current number waiting."""
        now = self.clock()
        if self.num_waiting >= QUEUED:
            self._queued.busy_s += now - self._mark
        elif self.num_waiting == 1:
            self._alone_pending_s += now - self._mark
        self._mark = now

    def _set_waiting(self, num_waiting: int) -> None:
        self._advance()  # close the interval at the old count
        if self.num_waiting < QUEUED <= num_waiting:  # a queue begins
            self._before_queue = self._queued.copy()
            self._num_queue_starts = self._num_queue_leaves = 0
        elif num_waiting < QUEUED <= self.num_waiting:  # it ends
            self._queued = self._measured()
            self._before_queue = None
        self.num_waiting = num_waiting


class Waiter:
    """One admitted request's place among the waiting: it starts or leaves once; later calls do
    nothing, so whoever holds it may give it back without knowing whether it started."""

    __slots__ = ("admission", "is_waiting")

    def __init__(self, admission: Admission):
        self.admission = admission
        self.is_waiting = True

    def start(self) -> None:
        if self.is_waiting:
            self.is_waiting = False
            self.admission.start()

    def leave(self) -> None:
        if self.is_waiting:
            self.is_waiting = False
            self.admission.leave()
