"""What a worker's process does to itself besides running the model: `ProcessConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    cProfile (no GPU activity)."""

    # The Serve app's config (pydantic) validates this dataclass field by field and forbids
    # unknown keys; __post_init__ checks it either way.
    __pydantic_config__ = {"extra": "forbid"}

    numa_bind: bool = True
    gc_freeze: bool = True
    profile_cpu: Literal[PROFILE_CPU_CHOICES] = "ops"

    def __post_init__(self):
        check_choice("process.numa_bind", self.numa_bind, (True, False))
        check_choice("process.gc_freeze", self.gc_freeze, (True, False))
        check_choice("process.profile_cpu", self.profile_cpu, PROFILE_CPU_CHOICES)


DEFAULT_PROCESS = ProcessConfig()
