"""Warm up and capture one forward per bucket into CUDA graphs that share one memory pool.

Decode graphs (batch-size buckets) and prefill graphs (token-count buckets) capture the same way:
per bucket, largest first, the forward runs eagerly over the bucket's padding (Triton compiles,
cuBLAS picks its kernels), then once more under capture. The graphs share the first one's pool,
and each keeps its output tensor, which a replay overwrites in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs per bucket before its capture: Triton compiles, cuBLAS picks kernels

Captured = dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]  # bucket -> (graph, output)


@torch.inference_mode()
def capture_buckets(
    forward: Callable[..., torch.Tensor],
    sizes: Sequence[int],
    padding_step: Callable[[int], tuple],
    device: torch.device,
) -> tuple[Captured, float]:
    """(graph and output per bucket, seconds taken); `padding_step(bucket)` fills the static
    inputs with padding and returns the forward's arguments. CUDA only."""
    start = time.perf_counter()
    captured: Captured = {}
    pool = None
    for bucket in sorted(sizes, reverse=True):
        step = padding_step(bucket)
        for _ in range(WARMUP_RUNS):
            forward(*step)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward(*step)
        pool = graph.pool()
        captured[bucket] = (graph, output)
    torch.cuda.synchronize(device)
    return captured, time.perf_counter() - start


class BucketGraphs:
    """One graph per bucket over static inputs (`inputs.fill(requests, bucket)` and
    `inputs.fill_padding(bucket)` return the forward's arguments). On the CPU nothing is
    captured and `replay` runs the forward eagerly over the same padded inputs."""

    kind = ""  # what the log line calls these graphs

    def __init__(self, forward: Callable[..., torch.Tensor], sizes, inputs, device):
        self.forward, self.sizes, self.inputs, self.device = forward, sizes, inputs, device
        self.graphs: Captured = {}
        self.enabled = True  # False: the runner takes its eager path (benchmarks compare both)
        self.capture_seconds = 0.0

    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (one shared pool); CUDA only."""
        if self.device.type != "cuda":
            return
        self.graphs, self.capture_seconds = capture_buckets(
            self.forward, self.sizes, self.inputs.fill_padding, self.device
        )
        logger.info(
            "captured %d %s CUDA graphs (buckets %s) in %.1f s",
            len(self.sizes), self.kind, self.sizes, self.capture_seconds,
        )  # fmt: skip

    def replay(self, requests, bucket: int) -> torch.Tensor:
        """The forward's output over the whole bucket, requests first then padding; valid until
        the next replay (the graph's static output on CUDA)."""
        step = self.inputs.fill(requests, bucket)
        captured = self.graphs.get(bucket)
        if captured is None:
            return self.forward(*step)  # the CPU, or before capture
        graph, output = captured
        graph.replay()
        return output
