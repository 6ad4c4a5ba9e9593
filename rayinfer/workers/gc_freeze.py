"""Python's cyclic garbage collector in a GPU serving process.

A full collection walks every object the process tracks; after loading a model and capturing
graphs that is a great many, and the pause stops the host from queueing kernels. A rank of an
expert-parallel group that pauses holds up its peers at their next exchange. As vLLM does after
its graph capture, the objects alive once the engine is built are collected once and then
frozen (`gc.freeze`): later collections skip them, so they stay short. Objects made later are
collected as usual.

Only a Ray worker calls this: its process holds one model runner for its whole life. A process
that builds and drops engines (the offline `LLM` in a notebook, tests, the benchmarks' driver)
must not freeze: what is frozen is never collected, so a dropped engine's reference cycles, and
the GPU memory they hold, would stay. Only on CUDA devices: on CPU the host's pauses starve no
device. ProcessConfig.gc_freeze=False leaves the collector as Python sets it.
"""

from __future__ import annotations

import gc

import torch


def freeze_after_startup(device: torch.device, enabled: bool = True) -> bool:
    """Collect, then freeze what is alive (see the module docstring); whether it did."""
    if not enabled or device.type != "cuda":
        return False
    gc.collect()
    gc.freeze()
    return True
