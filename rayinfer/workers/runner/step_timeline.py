"""When each part of a step happened, on the host's monotonic clock (one clock for every process of
a machine, so a driver's and its workers' times line up), and the step's GPU time.

A runner keeps its last steps' timelines (`StepTimelines`); a worker group adds when it sent each
step and when the results were back. `bench parallel` splits a timed step with them into: sending
the step to the workers, building its inputs, queueing the model, waiting for the GPU, returning
the results, and the engine's own work around the call. That tells a step that is long on the GPU
from one that is long on the host, which a profile of the GPU alone cannot.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

KEPT_STEPS = 256


@dataclass
class StepTimeline:
    """One runner's step; times in seconds of time.monotonic()."""

    num_tokens: int
    received: float  # the runner started the step
    inputs_ready: float = 0.0  # its input tensors and attention metadata were queued
    queued: float = 0.0  # the model's forward was queued (the host may be far ahead of the GPU)
    finished: float = 0.0  # the sampled tokens were on the host
    gpu_ms: float | None = None  # GPU time from the step's first copy to its sampling (CUDA)
    # CPU time the runner's thread spent from the step's start until the forward was queued:
    # near `queued - received` when the host computes all along, far below when it was blocked
    queue_cpu_ms: float = 0.0
    _cpu_start: float = field(default=0.0, repr=False)
    _events: tuple | None = field(default=None, repr=False)

    def mark(self, name: str) -> None:
        setattr(self, name, time.monotonic())
        if name == "queued":
            self.queue_cpu_ms = 1e3 * (time.thread_time() - self._cpu_start)

    def resolve(self) -> StepTimeline:
        """Read the GPU time once its end event has run (waits for it)."""
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            self.gpu_ms = start.elapsed_time(end)
            self._events = None
        return self


class StepTimelines:
    """The last KEPT_STEPS steps of one runner."""

    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.steps: deque[StepTimeline] = deque(maxlen=KEPT_STEPS)

    def begin(self, num_tokens: int) -> StepTimeline:
        step = StepTimeline(num_tokens, time.monotonic(), _cpu_start=time.thread_time())
        if self.on_gpu and not torch.cuda.is_current_stream_capturing():
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            step._events = (start, None)
        self.steps.append(step)
        return step

    @staticmethod
    def end(step: StepTimeline) -> None:
        """After the step's last work is queued (its sampled tokens on the host, or not)."""
        if step._events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            step._events = (step._events[0], end)
        step.mark("finished")

    def drain(self) -> list[dict]:
        """The kept steps as plain dicts (oldest first), forgotten here."""
        steps = [step.resolve() for step in self.steps]
        self.steps.clear()
        return [
            {key: value for key, value in vars(step).items() if not key.startswith("_")}
            for step in steps
        ]
