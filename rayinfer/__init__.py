"""rayinfer: serve Mixture-of-Experts LLMs on PCIe multi-GPU servers with Ray Serve.

The names below are imported on first use (PEP 562), not with the package: `rayinfer.LLM` needs
torch, which a process importing only a part of rayinfer (a Serve ingress replica, a client)
would otherwise load for nothing (~3 s of CPU each)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayinfer.engine.outputs import RequestFailedError, RequestOutput
    from rayinfer.engine.sampling_params import InvalidRequestError, SamplingParams
    from rayinfer.llm import LLM
    from rayinfer.parallel_plan import ParallelPlan

_MODULES = {
    "LLM": "rayinfer.llm",
    "InvalidRequestError": "rayinfer.engine.sampling_params",
    "ParallelPlan": "rayinfer.parallel_plan",
    "RequestFailedError": "rayinfer.engine.outputs",
    "RequestOutput": "rayinfer.engine.outputs",
    "SamplingParams": "rayinfer.engine.sampling_params",
}

__all__ = [
    "LLM",
    "InvalidRequestError",
    "ParallelPlan",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'rayinfer' has no attribute {name!r}")
