"""Where a timed `generate` call's wall time went, from the executor's step timelines
(workers/runner/step_timeline.py): the engine's own work around the step, sending it to the
workers, each rank's input building, model queueing, wait for the GPU and GPU time, and the
results' way back. All times are time.monotonic() seconds; the breakdown is in milliseconds."""

from __future__ import annotations

PHASES = ("engine", "send", "inputs", "queue", "queue_cpu", "wait", "return", "gpu", "skew")


def breakdown(span: tuple[float, float], timelines: dict) -> dict | None:
    """span: (start, end) of one generate call that ran one model step; timelines: what
    `Executor.drain_step_timelines()` returned after it. None when no step ran inside it."""
    start, end = span
    inside = [[s for s in rank if start <= s["received"] <= end] for rank in timelines["ranks"]]
    steps = [rank[-1] for rank in inside if rank]  # the call's last step on each rank
    if not steps:
        return None
    calls = [c for c in timelines["driver"] if start <= c["sent"] <= end]
    sent = calls[-1]["sent"] if calls else min(s["received"] for s in steps)
    results = calls[-1]["results"] if calls else max(s["finished"] for s in steps)
    ms = 1e3

    def slowest(phase):
        return ms * max(phase(s) for s in steps)

    gpu = [s["gpu_ms"] for s in steps if s["gpu_ms"] is not None]
    return {
        "total": ms * (end - start),
        "engine": ms * ((end - start) - (results - sent)),  # scheduling, outputs, all steps
        "send": slowest(lambda s: s["received"] - sent),
        "inputs": slowest(lambda s: s["inputs_ready"] - s["received"]),
        "queue": slowest(lambda s: s["queued"] - s["inputs_ready"]),
        # the thread's CPU time from the step's start to the forward queued (inputs included)
        "queue_cpu": max(s.get("queue_cpu_ms", 0.0) for s in steps),
        "wait": slowest(lambda s: s["finished"] - s["queued"]),
        "return": ms * (results - max(s["finished"] for s in steps)),
        "gpu": max(gpu) if gpu else None,
        "skew": ms * (max(s["received"] for s in steps) - min(s["received"] for s in steps)),
        "gpu_per_rank": gpu,
    }


def summary_line(rows: list[dict]) -> str:
    """'total 283 = engine 3 + send 2 + ...' from the medians of each phase over the repeats."""
    rows = [row for row in rows if row]
    if not rows:
        return "no step timelines"

    def median(values):
        values = sorted(v for v in values if v is not None)
        return values[len(values) // 2] if values else float("nan")

    parts = [f"{phase} {median(row[phase] for row in rows):.1f}" for phase in PHASES]
    gpus = " ".join(f"{row['gpu'] or 0:.0f}" for row in rows)
    totals = " ".join(f"{row['total']:.0f}" for row in rows)
    return f"step ms (median): {', '.join(parts)}; per run total [{totals}] gpu [{gpus}]"
