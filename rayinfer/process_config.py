"""What a worker's process does to itself besides running the model: `ProcessConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rayinfer.config_error import ConfigError
from rayinfer.exchange_config import check_choice

# What the step profiler records of the host besides the GPU's activity
# (workers/runner/step_profiler.py)
PROFILE_CPU_CHOICES = ("ops", "none", "stack", "python")


@dataclass(frozen=True)
class ProcessConfig:
    """numa_bind: bind a GPU worker's threads to its GPU's NUMA node (workers/numa.py).
    gc_freeze: freeze the objects alive once a GPU worker is built, so that later collections
    skip them (workers/gc_freeze.py).
    profile_cpu: what `start_profile` records of the host: "ops" its operators, "none" nothing
    (tracing every operator opens gaps between kernels that a host-bound step does not have
    unprofiled), "stack" operators and Python frames, "python" the host's Python alone through
    cProfile (no GPU activity).
    gil_switch_interval_ms: how long a worker's thread waits at most for the GIL while another
    runs Python (workers/gil_switch.py: the KV hand-off's copy thread beside the engine step's);
    None keeps Python's 5 ms. 0.5 ms: a 115 MB hand-off's copies beside a thread running Python
    took 3.2 ms against 8.1 at 5 ms (2.4 ms idle), and in `serve run` the import's P95 fell to
    11 ms (benchmarks/RESULTS.md, C49 and C39)."""

    # The Serve app's config (pydantic) validates this dataclass field by field and forbids
    # unknown keys; __post_init__ checks it either way.
    __pydantic_config__ = {"extra": "forbid"}

    numa_bind: bool = True
    gc_freeze: bool = True
    profile_cpu: Literal[PROFILE_CPU_CHOICES] = "ops"
    gil_switch_interval_ms: float | None = 0.5

    def __post_init__(self):
        check_choice("process.numa_bind", self.numa_bind, (True, False))
        check_choice("process.gc_freeze", self.gc_freeze, (True, False))
        check_choice("process.profile_cpu", self.profile_cpu, PROFILE_CPU_CHOICES)
        interval = self.gil_switch_interval_ms
        if interval is not None and not (
            isinstance(interval, (int, float))
            and not isinstance(interval, bool)
            and 0 < interval <= 1000
        ):
            raise ConfigError(
                f"process.gil_switch_interval_ms={interval!r}; use a number of milliseconds "
                "in (0, 1000], or None for Python's own"
            )


DEFAULT_PROCESS = ProcessConfig()
