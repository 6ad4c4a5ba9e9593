"""torch.profiler around the steps a caller chooses: `start(path)`, run steps, `stop()` writes the
busiest operators (device time first) to `<path>.txt` and a Chrome trace to `<path>.json`
(open it in chrome://tracing or Perfetto). The same switch as vLLM's `LLM.start_profile`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class StepProfiler:
    def __init__(self, device: torch.device):
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._profile = None
        self._path: Path | None = None

    def start(self, path: str) -> None:
        if self._profile is not None:
            raise RuntimeError("the profiler is already running; call stop_profile() first")
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._profile = profile(activities=self.activities, record_shapes=False)
        self._profile.__enter__()

    def stop(self) -> str:
        """Write the report; returns the table's path."""
        if self._profile is None:
            raise RuntimeError("the profiler is not running; call start_profile(path) first")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self._profile = self._profile, None
        prof.__exit__(None, None, None)
        sort_by = "cuda_time_total" if len(self.activities) > 1 else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=50)
        text_path = self._path.with_suffix(".txt")
        text_path.write_text(table)
        prof.export_chrome_trace(str(self._path.with_suffix(".json")))
        return str(text_path)
