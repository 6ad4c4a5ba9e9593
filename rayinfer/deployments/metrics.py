"""rayinfer's Serve metrics, through `ray.util.metrics` (Prometheus: `ray_rayinfer_*`).

Every metric is tagged with `phase` (ingress, prefill or decode) so the dashboard can split them.
Create one `ServeMetrics` per replica; metric objects are cheap handles onto Ray's metrics agent.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
TRANSFER_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5]

METRIC_NAMES = (
    "rayinfer_requests",
    "rayinfer_time_to_first_token_seconds",
    "rayinfer_inter_token_latency_seconds",
    "rayinfer_prompt_tokens",
    "rayinfer_generation_tokens",
    "rayinfer_queue_length",
    "rayinfer_running_requests",
    "rayinfer_kv_cache_usage",
    "rayinfer_kv_handoff_bytes",
    "rayinfer_kv_handoff_seconds",
    "rayinfer_kv_recomputes",
)


class ServeMetrics:
    def __init__(self, phase: str):
        self.tags = {"phase": phase}
        phase_key = ("phase",)
        self.requests = Counter(
            "rayinfer_requests",
            description="Finished requests by phase and status (ok, error, abort, invalid).",
            tag_keys=("phase", "status"),
        )
        self.ttft = Histogram(
            "rayinfer_time_to_first_token_seconds",
            description="Seconds from a request's arrival to its first token.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=phase_key,
        )
        self.inter_token_latency = Histogram(
            "rayinfer_inter_token_latency_seconds",
            description="Seconds between two streamed chunks of one request.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=phase_key,
        )
        self.prompt_tokens = Counter(
            "rayinfer_prompt_tokens", description="Prompt tokens received.", tag_keys=phase_key
        )
        self.generation_tokens = Counter(
            "rayinfer_generation_tokens", description="Tokens generated.", tag_keys=phase_key
        )
        self.queue_length = Gauge(
            "rayinfer_queue_length",
            description="Requests waiting in one replica's engine.",
            tag_keys=phase_key,
        )
        self.running_requests = Gauge(
            "rayinfer_running_requests",
            description="Requests one replica's engine is running.",
            tag_keys=phase_key,
        )
        self.kv_cache_usage = Gauge(
            "rayinfer_kv_cache_usage",
            description="Fraction of one replica's KV cache blocks in use (0..1).",
            tag_keys=phase_key,
        )
        self.kv_handoff_bytes = Counter(
            "rayinfer_kv_handoff_bytes",
            description="KV bytes put into the object store by prefill for decode.",
            tag_keys=phase_key,
        )
        self.kv_handoff_seconds = Histogram(
            "rayinfer_kv_handoff_seconds",
            description="Seconds to export (prefill) or import (decode) one request's KV.",
            boundaries=TRANSFER_BUCKETS_S,
            tag_keys=phase_key,
        )
        self.kv_recomputes = Counter(
            "rayinfer_kv_recomputes",
            description="Hand-offs whose KV was lost, so decode recomputed the prompt.",
            tag_keys=phase_key,
        )

    def count_request(self, status: str) -> None:
        self.requests.inc(1, tags={**self.tags, "status": status})

    def observe_engine(self, num_waiting: int, num_running: int, kv_usage: float) -> None:
        self.queue_length.set(num_waiting, tags=self.tags)
        self.running_requests.set(num_running, tags=self.tags)
        self.kv_cache_usage.set(kv_usage, tags=self.tags)

    def observe_handoff(self, seconds: float, num_bytes: int = 0) -> None:
        self.kv_handoff_seconds.observe(seconds, tags=self.tags)
        if num_bytes:
            self.kv_handoff_bytes.inc(num_bytes, tags=self.tags)

    def add_tokens(self, num_prompt: int, num_generated: int) -> None:
        if num_prompt:
            self.prompt_tokens.inc(num_prompt, tags=self.tags)
        if num_generated:
            self.generation_tokens.inc(num_generated, tags=self.tags)
