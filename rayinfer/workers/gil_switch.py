"""How long a GPU worker's threads wait for Python's GIL.

A worker runs its engine steps on one thread and its KV hand-off's copies (workers/handoff_io.py)
on another (the KV_IO concurrency group). The copy thread lets the GIL go while the driver
queues its copies and while it waits for them; to take it back from a thread that keeps running
Python (a step queueing kernels, the sampler, Ray's handlers) it waits up to the interpreter's
switch interval, 5 ms as Python ships, for each such return. A hand-off of 2.4 ms of copies thus
took 16 ms beside a thread spinning in Python, and 3.3 ms at a 0.5 ms interval
(`python benchmarks/handoff_copy_engines.py`, the "+ a Python thread" rows of
benchmarks/RESULTS.md). A shorter interval bounds each wait; the threads switch more often only
while both want the GIL, so a lone thread loses nothing.

Only a Ray worker calls this, at its startup: the interval is the whole interpreter's, and a
process that is not rayinfer's own (the offline `LLM` in a notebook) keeps the user's.
ProcessConfig.gil_switch_interval_ms sets it (0.5 ms unless told); None leaves Python's.
"""

from __future__ import annotations

import sys


def set_switch_interval(milliseconds: float | None) -> float:
    """Set this interpreter's switch interval (None: leave it); returns the interval in force,
    in seconds."""
    if milliseconds is not None:
        sys.setswitchinterval(milliseconds / 1e3)
    return sys.getswitchinterval()
