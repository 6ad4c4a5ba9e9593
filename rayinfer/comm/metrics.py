"""All-to-all traffic as Prometheus metrics (`ray_rayinfer_all_to_all_bytes` and
`ray_rayinfer_all_to_all_seconds`), tagged by phase, schedule and transport.

The phase comes from the group's name (worker groups are named `rayinfer-<phase>-...`); groups
named otherwise report phase "other". Nothing is recorded outside a Ray worker or driver.

Each call only appends (schedule, transport, bytes, seconds) to its group's recorder: Ray's
Counter.inc and Histogram.observe cost ~3 us each in Python (2-core VM), as much as the rest
of a small exchange's Python. A daemon thread hands the samples to Ray every FLUSH_INTERVAL_S
(bytes summed into one Counter.inc per tag set, one Histogram.observe per call, so the
histogram's counts are exact), and `flush()` does it at once (the group does on destroy). Ray
itself exports metrics every few seconds, so the batching adds no visible delay.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

TAG_KEYS = ("phase", "schedule", "transport")
SECONDS_BUCKETS = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0]
FLUSH_INTERVAL_S = 1.0
MAX_WAITING_SAMPLES = 1 << 16  # beyond (over 65k calls/s, or Ray shut down) the oldest drop


def phase_of(group_name: str) -> str:
    parts = group_name.split("-")
    return parts[1] if len(parts) > 2 and parts[0] == "rayinfer" else "other"


_made = None


def _metrics():
    """(Counter, Histogram) once Ray is initialized in this process, else None (asked again
    next time, so a group made before ray.init() still records once Ray is up)."""
    global _made
    if _made is None:
        _made = _make_metrics()
    return _made


def _make_metrics():
    import ray
    from ray.util.metrics import Counter, Histogram

    if not ray.is_initialized():
        return None
    sent = Counter(
        "rayinfer_all_to_all_bytes",
        description="bytes an all-to-all sent to other ranks",
        tag_keys=TAG_KEYS,
    )
    seconds = Histogram(
        "rayinfer_all_to_all_seconds",
        description="host wall time of one all-to-all, from call to completion",
        boundaries=SECONDS_BUCKETS,
        tag_keys=TAG_KEYS,
    )
    return sent, seconds


class AllToAllRecorder:
    """One group's all-to-all samples, on their way to Ray's metrics.

    `enabled` is False outside Ray (checked on creation): callers skip `record` then."""

    def __init__(self, group_name: str):
        self.phase = phase_of(group_name)
        self.enabled = _metrics() is not None
        # append/popleft are atomic: no lock on the hot path
        self._samples: deque = deque(maxlen=MAX_WAITING_SAMPLES)
        self._flush_lock = threading.Lock()
        self._tags: dict[tuple[str, str], dict[str, str]] = {}
        if self.enabled:
            _Flusher.watch(self)

    def record(self, schedule: str, transport: str, num_bytes: int, seconds: float) -> None:
        self._samples.append((schedule, transport, num_bytes, seconds))

    def flush(self) -> None:
        """Hand every sample recorded so far to Ray."""
        metrics = _metrics()
        if metrics is None:
            self._samples.clear()
            return
        sent, seconds = metrics
        with self._flush_lock:  # the flusher thread and an explicit flush() may race
            sent_bytes: dict[tuple[str, str], int] = {}
            for i in range(len(self._samples)):
                try:
                    schedule, transport, num_bytes, secs = self._samples.popleft()
                except IndexError:  # cleared meanwhile
                    break
                tags = self.tags(schedule, transport)
                seconds.observe(secs, tags=tags)
                key = (schedule, transport)
                sent_bytes[key] = sent_bytes.get(key, 0) + num_bytes
                if i % 64 == 63:
                    time.sleep(0)  # let the caller's thread run between slices
            for (schedule, transport), num_bytes in sent_bytes.items():
                if num_bytes > 0:  # Counter.inc refuses 0
                    sent.inc(num_bytes, tags=self.tags(schedule, transport))

    def tags(self, schedule: str, transport: str) -> dict[str, str]:
        key = (schedule, transport)
        if key not in self._tags:
            self._tags[key] = {"phase": self.phase, "schedule": schedule, "transport": transport}
        return self._tags[key]


class _Flusher:
    """One daemon thread per process flushes every live recorder each FLUSH_INTERVAL_S."""

    _recorders: weakref.WeakSet = weakref.WeakSet()
    _thread: threading.Thread | None = None
    _lock = threading.Lock()

    @classmethod
    def watch(cls, recorder: AllToAllRecorder) -> None:
        with cls._lock:
            cls._recorders.add(recorder)
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(
                    target=cls._run, name="rayinfer-a2a-metrics", daemon=True
                )
                cls._thread.start()

    @classmethod
    def _run(cls) -> None:
        import ray

        while True:
            time.sleep(FLUSH_INTERVAL_S)
            if not ray.is_initialized():  # shut down: nothing to record into
                continue
            for recorder in list(cls._recorders):
                try:
                    recorder.flush()
                except Exception:  # noqa: BLE001  (metrics must never break the exchange)
                    pass
