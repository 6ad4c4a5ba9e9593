"""A busy replica's engine steps, logged every STEP_LOG_S: how many ran and their median seconds,
apart for steps of decodes alone and steps with a prompt's tokens (what a stream's time per
output token is made of), and where a decode step's time went between the replica and its
workers (the workers' step timelines, workers/runner/step_timeline.py):

    engine: the replica's own work around the call (scheduling, outputs, detokenizing)
    send:   the step's way to the first worker (Ray's call)
    host:   the worker's inputs and the model's launches, until the forward was queued
    wait:   the worker waiting for the GPU; gpu: the step's GPU time
    return: the sampled tokens' way back to the replica
"""

from __future__ import annotations

import logging
import statistics
import time

logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log

STEP_LOG_S = 10.0
DECODE_PHASES = ("engine", "send", "host", "wait", "gpu", "return")


def _median(values: list[float]) -> float:
    return statistics.median_high(values) if values else float("nan")


def decode_step_phases(steps: list[tuple[float, float, int]], timelines: dict) -> dict[str, float]:
    """Median milliseconds of each phase of DECODE_PHASES over the decode steps.

    steps: the loop's (start, seconds, prompt tokens) on time.monotonic(); timelines: what
    Executor.drain_step_timelines returned (its driver's calls and rank 0's steps). All three
    are in time order, so one pass pairs each step with its call and rank 0's run of it (this
    runs on the engine loop's thread, between two steps)."""
    calls = iter(timelines.get("driver") or [])
    runs = iter(sorted((timelines.get("ranks") or [[]])[0], key=lambda run: run["received"]))
    call = next(calls, None)
    run = next(runs, None)
    phases: dict[str, list[float]] = {name: [] for name in DECODE_PHASES}
    for start, seconds, prompt_tokens in steps:
        while call is not None and call["sent"] < start:
            call = next(calls, None)
        if call is None:
            break
        if call["sent"] > start + seconds:
            continue  # no call inside this step (kept calls begin later)
        while run is not None and run["received"] < call["sent"]:
            run = next(runs, None)
        if run is None:
            break
        if prompt_tokens or run["received"] > call["results"]:
            continue
        phases["engine"].append(seconds - (call["results"] - call["sent"]))
        phases["send"].append(run["received"] - call["sent"])
        phases["host"].append(run["queued"] - run["received"])
        phases["wait"].append(run["finished"] - run["queued"])
        phases["return"].append(call["results"] - run["finished"])
        if run.get("gpu_ms") is not None:
            phases["gpu"].append(run["gpu_ms"] / 1e3)
    return {name: 1e3 * _median(values) for name, values in phases.items() if values}


class StepLog:
    """Collects the loop's steps; `add` logs a line once STEP_LOG_S has passed since the last."""

    def __init__(self, phase: str, drain_timelines=None):
        """drain_timelines: the executor's drain_step_timelines, called when a line is due (on
        the loop thread, between steps); None: no decode phases in the line."""
        self.phase = phase
        self.drain_timelines = drain_timelines
        self.since = time.monotonic()
        self.steps: list[tuple[float, float, int]] = []

    def add(self, steps: list[tuple[float, float, int]], now: float) -> None:
        self.steps += steps
        if now - self.since < STEP_LOG_S:
            return
        if self.steps:
            timelines = self.drain_timelines() if self.drain_timelines else {}
            logger.info("%s", self.describe(now - self.since, timelines))
        self.since, self.steps = now, []

    def describe(self, span_s: float, timelines: dict | None = None) -> str:
        decode = [seconds for _, seconds, tokens in self.steps if not tokens]
        prompt = [(seconds, tokens) for _, seconds, tokens in self.steps if tokens]
        line = (
            f"{self.phase} steps in {span_s:.0f} s: {len(decode)} of decodes alone, median "
            f"{1e3 * _median(decode):.1f} ms; {len(prompt)} with prompt tokens, median "
            f"{1e3 * _median([s for s, _ in prompt]):.1f} ms for "
            f"{_median([t for _, t in prompt]):.0f} tokens"
        )
        phases = decode_step_phases(self.steps, timelines or {})
        if phases:
            line += "; a decode step's ms: " + ", ".join(
                f"{name} {ms:.1f}" for name, ms in phases.items()
            )
        return line
