"""rayinfer's Serve metrics, through `ray.util.metrics` (Prometheus: `ray_rayinfer_*`).

Every metric is tagged with `phase` (ingress, prefill, decode or the colocated engine) so the
dashboard can split them.
Create one `ServeMetrics` per replica; metric objects are cheap handles onto Ray's metrics agent.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
TRANSFER_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5]
STEP_BUCKETS_S = [0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                  0.15, 0.25, 0.5, 1, 2.5]  # fmt: skip


# attribute -> (kind, metric name, description, extra tag keys besides phase)
METRICS = {
    "requests": (
        "counter",
        "rayinfer_requests",
        "Finished requests by phase and status.",
        ("status",),
    ),
    "ttft": ("latency", "rayinfer_time_to_first_token_seconds", "Seconds to the first token.", ()),
    "inter_token_latency": (
        "latency",
        "rayinfer_inter_token_latency_seconds",
        "Seconds per token between two streamed chunks of one request (the gap over the "
        "later chunk's tokens).",
        (),
    ),
    "prompt_tokens": ("counter", "rayinfer_prompt_tokens", "Prompt tokens received.", ()),
    "generation_tokens": ("counter", "rayinfer_generation_tokens", "Tokens generated.", ()),
    "queue_length": ("gauge", "rayinfer_queue_length", "Requests waiting in an engine.", ()),
    "running_requests": ("gauge", "rayinfer_running_requests", "Requests an engine runs.", ()),
    "kv_cache_usage": ("gauge", "rayinfer_kv_cache_usage", "KV cache blocks in use (0..1).", ()),
    "kv_cache_capacity_tokens": (
        "gauge",
        "rayinfer_kv_cache_capacity_tokens",
        "Tokens one replica's KV cache holds (all its data-parallel partitions).",
        (),
    ),
    "kv_handoff_bytes": (
        "counter",
        "rayinfer_kv_handoff_bytes",
        "KV bytes prefill exported for decode (into its arena or the object store).",
        (),
    ),
    "kv_handoff_seconds": (
        "transfer",
        "rayinfer_kv_handoff_seconds",
        "Seconds to export (prefill) or import (decode) one request's KV, by the path it took: "
        "shm (the prefill worker's shared-memory arena, mapped on the same node), "
        "object_store, or arena_via_object_store (an arena on another node, put when asked).",
        ("path",),
    ),
    "kv_recomputes": (
        "counter",
        "rayinfer_kv_recomputes",
        "Hand-offs whose KV was lost, so decode recomputed the prompt.",
        (),
    ),
    "engine_step_seconds": (
        "step",
        "rayinfer_engine_step_seconds",
        "Wall seconds of one engine step (schedule, the model on the workers, outputs), by "
        "kind=decode (decodes alone) or kind=prompt (a prompt's tokens beside any decodes).",
        ("kind",),
    ),
    "engine_steps": (
        "counter",
        "rayinfer_engine_steps",
        "Engine steps by how the workers ran the model: mode=graph (decode CUDA graphs), "
        "prefill_graph (prefill CUDA graphs) or eager.",
        ("mode",),
    ),
}
METRIC_NAMES = tuple(name for _, name, _, _ in METRICS.values())


def _make_metric(kind: str, name: str, description: str, tag_keys: tuple[str, ...]):
    if kind == "counter":
        return Counter(name, description=description, tag_keys=tag_keys)
    if kind == "gauge":
        return Gauge(name, description=description, tag_keys=tag_keys)
    buckets = {"latency": LATENCY_BUCKETS_S, "step": STEP_BUCKETS_S}.get(kind, TRANSFER_BUCKETS_S)
    return Histogram(name, description=description, boundaries=buckets, tag_keys=tag_keys)


class ServeMetrics:
    """One replica's handles onto the metrics in METRICS, tagged with its phase."""

    def __init__(self, phase: str):
        self.tags = {"phase": phase}
        for attribute, (kind, name, description, extra_tags) in METRICS.items():
            setattr(self, attribute, _make_metric(kind, name, description, ("phase", *extra_tags)))

    def count_request(self, status: str) -> None:
        self.requests.inc(1, tags={**self.tags, "status": status})

    def observe_engine(
        self, num_waiting: int, num_running: int, kv_usage: float, kv_capacity_tokens: int
    ) -> None:
        self.queue_length.set(num_waiting, tags=self.tags)
        self.running_requests.set(num_running, tags=self.tags)
        self.kv_cache_usage.set(kv_usage, tags=self.tags)
        self.kv_cache_capacity_tokens.set(kv_capacity_tokens, tags=self.tags)

    def observe_token_gap(self, seconds: float, num_tokens: int) -> None:
        """A chunk of num_tokens tokens `seconds` after the one before."""
        self.inter_token_latency.observe(seconds / max(num_tokens, 1), tags=self.tags)

    def observe_handoff(self, seconds: float, path: str, phase: str | None = None) -> None:
        """One request's export (phase "prefill") or import (this replica's phase) seconds,
        by the path its KV took."""
        tags = {**self.tags, "phase": phase or self.tags["phase"], "path": path}
        self.kv_handoff_seconds.observe(seconds, tags=tags)

    def observe_steps(self, step_times: list[tuple[float, float, int]]) -> None:
        """Engine steps' (start, seconds, prompt tokens), from EngineLoop.take_step_times."""
        for _, seconds, prompt_tokens in step_times:
            kind = "prompt" if prompt_tokens else "decode"
            self.engine_step_seconds.observe(seconds, tags={**self.tags, "kind": kind})

    def add_steps(self, mode: str, count: int) -> None:
        if count:
            self.engine_steps.inc(count, tags={**self.tags, "mode": mode})

    def add_tokens(self, num_prompt: int, num_generated: int) -> None:
        if num_prompt:
            self.prompt_tokens.inc(num_prompt, tags=self.tags)
        if num_generated:
            self.generation_tokens.inc(num_generated, tags=self.tags)
