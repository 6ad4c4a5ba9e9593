"""Logs Python's garbage-collection pauses in every process that starts with this folder on
PYTHONPATH (Ray's workers inherit it), so that a pause can be told apart from other stalls:

    PYTHONPATH=$PWD/benchmarks/gc_pauses:$PWD:$PYTHONPATH python -m rayinfer.bench parallel ...

Each collection longer than RAYINFER_GC_LOG_MS (default 2) ms prints one line to stderr:
`GCPAUSE pid=<pid> gen=<generation> ms=<duration> collected=<objects>`.
"""

import gc
import os
import sys
import time

_THRESHOLD_MS = float(os.environ.get("RAYINFER_GC_LOG_MS", "2"))
_started = [0.0]


def _log_pause(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _started[0]) * 1e3
    if ms >= _THRESHOLD_MS:
        print(f"GCPAUSE pid={os.getpid()} gen={info['generation']} ms={ms:.1f} "
              f"collected={info['collected']}", file=sys.stderr, flush=True)  # fmt: skip


gc.callbacks.append(_log_pause)
