"""Small lists of host integers (sequence starts, row indices) as device tensors, without
waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable host memory, and CUDA makes such a copy
wait for everything already queued on the stream: the host stops until the GPU has drained, and
the GPU then idles until the host queues more. A 16k-token prefill of a DeepSeek-V2-Lite-shaped
model made 60 of these per step (two per MLA layer): 94 ms of host time blocked. The profiled
step's GPU idle went from 21 ms before to 6.9 ms after (one H200; `process.profile_cpu="stack"`
and `benchmarks/trace_overlap.py`, benchmarks/RESULTS.md).
Here the values go through pinned memory (PyTorch's caching host allocator keeps the buffer
until the copy has run) and an asynchronous copy.
"""

from __future__ import annotations

import torch


def device_ints(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (host ints [n]: a list, or a CPU tensor) -> [n] dtype tensor on `device`, queued
    on the current stream; on a CPU device or inside CUDA-graph capture (where a pinned
    buffer's address would be replayed), a plain copy."""
    host = values.to(dtype) if torch.is_tensor(values) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
