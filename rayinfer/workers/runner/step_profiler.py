"""torch.profiler around the steps a caller chooses: `start(path)`, run steps, `stop()` writes the
busiest operators (device time first) to `<path>.txt` and a Chrome trace to `<path>.json`
(open it in chrome://tracing or Perfetto). The same switch as vLLM's `LLM.start_profile`.

`cpu` (ProcessConfig.profile_cpu) says what of the host is recorded besides the GPU's activity:
"ops" (default) its operators; "none" nothing (tracing every operator slows the host enough to
open gaps between kernels that a host-bound step, such as the two-batch overlap's, does not have
unprofiled); "stack" its operators and Python frames (slower still: to find which line waits for
the GPU, see benchmarks/trace_overlap.py); "python" the host's Python alone, through cProfile
instead of torch.profiler (no GPU activity): `<path>.txt` lists the functions by their own time
and `<path>.pstats` holds the whole profile, to see what a host-bound step's queueing is made
of."""

from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rayinfer.process_config import PROFILE_CPU_CHOICES


class StepProfiler:
    def __init__(self, device: torch.device, cpu: str = "ops"):
        if cpu not in PROFILE_CPU_CHOICES:
            raise ValueError(
                f"process.profile_cpu={cpu!r}; use one of {', '.join(PROFILE_CPU_CHOICES)}"
            )
        on_gpu = device.type == "cuda"
        self.python_only = cpu == "python"
        self.activities = [ProfilerActivity.CPU] if cpu != "none" or not on_gpu else []
        self.with_stack = cpu == "stack"
        if on_gpu:
            self.activities.append(ProfilerActivity.CUDA)
        self._profile = None
        self._path: Path | None = None

    def start(self, path: str) -> None:
        if self._profile is not None:
            raise RuntimeError("the profiler is already running; call stop_profile() first")
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        if self.python_only:
            self._profile = cProfile.Profile()
            self._profile.enable()
            return
        self._profile = profile(
            activities=self.activities, record_shapes=False, with_stack=self.with_stack
        )
        self._profile.__enter__()

    def stop(self) -> str:
        """Write the report; returns the table's path."""
        if self._profile is None:
            raise RuntimeError("the profiler is not running; call start_profile(path) first")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self._profile = self._profile, None
        text_path = self._path.with_suffix(".txt")
        if self.python_only:
            prof.disable()
            prof.dump_stats(str(self._path.with_suffix(".pstats")))
            text_path.write_text(python_table(prof))
            return str(text_path)
        prof.__exit__(None, None, None)
        on_gpu = ProfilerActivity.CUDA in self.activities
        sort_by = "cuda_time_total" if on_gpu else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=50)
        text_path.write_text(table)
        prof.export_chrome_trace(str(self._path.with_suffix(".json")))
        return str(text_path)


def python_table(prof: cProfile.Profile, rows: int = 60) -> str:
    """The functions by their own time, then by the time under them (cProfile's columns)."""
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return out.getvalue()
