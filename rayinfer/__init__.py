"""rayinfer: serve Mixture-of-Experts LLMs on PCIe multi-GPU servers with Ray Serve."""

from rayinfer.config import ParallelPlan
from rayinfer.engine.outputs import RequestFailedError, RequestOutput
from rayinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from rayinfer.llm import LLM

__all__ = [
    "LLM",
    "InvalidRequestError",
    "ParallelPlan",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
]
