"""All-to-all traffic as Prometheus metrics (`ray_rayinfer_all_to_all_bytes` and
`ray_rayinfer_all_to_all_seconds`), tagged by phase, schedule and transport.

The phase comes from the group's name (worker groups are named `rayinfer-<phase>-...`); groups
named otherwise report phase "other". Nothing is recorded outside a Ray worker or driver.
"""

from __future__ import annotations

import time
from functools import cache

TAG_KEYS = ("phase", "schedule", "transport")
SECONDS_BUCKETS = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0]


def phase_of(group_name: str) -> str:
    parts = group_name.split("-")
    return parts[1] if len(parts) > 2 and parts[0] == "rayinfer" else "other"


@cache
def _metrics():
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


class AllToAllTimer:
    """`with AllToAllTimer(group_name, bytes_to_others, schedule, transport): ...exchange...`"""

    def __init__(self, group_name: str, num_bytes: int, schedule: str, transport: str):
        self.tags = {"phase": phase_of(group_name), "schedule": schedule, "transport": transport}
        self.num_bytes = num_bytes

    def __enter__(self) -> AllToAllTimer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        metrics = _metrics()
        if metrics is None or exc[0] is not None:
            return
        sent, seconds = metrics
        if self.num_bytes > 0:  # Counter.inc refuses 0
            sent.inc(self.num_bytes, tags=self.tags)
        seconds.observe(time.perf_counter() - self.start, tags=self.tags)
