"""GPU time of an op as a decode step sees it: one call captured in a CUDA graph and replayed,
so Python's launch cost (which dominates a few small launches run eagerly) is left out."""

from __future__ import annotations

import torch


def graph_median_ms(fn, samples: int = 25, replays: int = 10, warm_samples: int = 5) -> float:
    """The median over `samples` (the first `warm_samples` dropped) of `replays` back-to-back
    replays of fn's graph, timed with CUDA events, per replay. fn runs three times on a side
    stream first, so compiling, autotuning and first allocations happen before the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    kept = sorted(times[warm_samples:])
    return kept[len(kept) // 2]
