"""Warm up and capture one forward per bucket into CUDA graphs that share one memory pool.

Decode graphs (batch-size buckets) and prefill graphs (token-count buckets) capture the same way:
per bucket, largest first, the forward runs eagerly over the bucket's padding (Triton compiles,
cuBLAS picks its kernels), then once more under capture. The graphs share the first one's pool,
and each keeps its output tensor, which a replay overwrites in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

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
