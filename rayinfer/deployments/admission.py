"""Admission at the ingress: take a request only if the engines can start it within a deadline.

A request is *waiting* from its admission until it has started: its first decode token arrived,
or it finished in prefill (a failed or abandoned request stops waiting too). The wait of a new
request is estimated as

    estimated_wait_s = (num_waiting + 1) / start_rate

where `start_rate` is measured, not configured: the starts of the last `num_samples` requests
divided by the *busy* time they took (time during which at least one request was waiting). Idle
time does not count, so a quiet server keeps its last rate; busy time without a start does, so a
stalled server's rate falls while it stalls (one start more than measured is counted: the start
under way). A replica admits everything until its first start gives it a rate. At low load the
measured rate is bounded by latency (one request at a time), below what batching can start: the
estimate errs towards shedding, never towards unbounded waiting, and rises as batches start.

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
    ):
        """max_wait_s: the deadline a new request must be estimated to start within (None: no
        bound, every request is admitted). num_samples: starts the rate is measured over."""
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.num_waiting = 0
        self._busy_s = 0.0  # busy time up to _busy_mark
        self._busy_mark = clock()
        self._start_stamps: deque[float] = deque(maxlen=num_samples)  # busy time at each start
        self._window_origin_s = 0.0  # busy time at the start that left the window last

    def start_rate(self) -> float:
        """Starts per second of busy time over the window, counting the start under way
        (infinite before the first start: nothing measured yet)."""
        busy_s = self._busy_time() - self._window_origin_s
        if not self._start_stamps or busy_s <= 0:
            return math.inf
        return (len(self._start_stamps) + 1) / busy_s

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
        """An admitted request started: it stops waiting and its start is measured."""
        stamps = self._start_stamps
        if len(stamps) == stamps.maxlen:
            self._window_origin_s = stamps[0]
        stamps.append(self._busy_time())
        self._set_waiting(self.num_waiting - 1)

    def leave(self) -> None:
        """An admitted request stopped waiting without starting (it failed or was abandoned)."""
        self._set_waiting(self.num_waiting - 1)

    def _busy_time(self) -> float:
        now = self.clock()
        if self.num_waiting > 0:
            self._busy_s += now - self._busy_mark
        self._busy_mark = now
        return self._busy_s

    def _set_waiting(self, num_waiting: int) -> None:
        self._busy_time()  # close the interval at the old count
        self.num_waiting = num_waiting
