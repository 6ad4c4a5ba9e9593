"""WorkerSpec: everything a worker (a Ray actor, or the in-process executor) needs to build its
ModelRunner, as EngineArgs made it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rayinfer.config import ModelConfig, ParallelPlan
from rayinfer.engine_config import DEFAULT_KV_HANDOFF, CacheConfig, KVHandoffConfig, KVMemoryConfig
from rayinfer.exchange_config import AllToAllConfig
from rayinfer.graph_config import CudaGraphConfig
from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.overlap_config import DEFAULT_OVERLAP, OverlapConfig
from rayinfer.process_config import DEFAULT_PROCESS, ProcessConfig


@dataclass
class WorkerSpec:
    """What a worker needs to build its ModelRunner: the configs as validated where the user
    gave them (EngineArgs), unchanged."""

    model_config: ModelConfig
    cache_config: CacheConfig
    device: str  # "auto", "cpu" or "cuda"
    dtype: torch.dtype | None  # None: float32 on the CPU, bfloat16 on GPUs
    num_threads: int = 0  # torch CPU threads; 0 keeps torch's default
    import_timeout_s: float = 60.0
    plan: ParallelPlan = ParallelPlan()  # how the group's workers split the model
    two_batch_overlap: bool | None = None  # one micro-batch's all-to-all under the other's math
    load_format: str = "safetensors"  # or "dummy": random weights (benchmarks)
    all_to_all: AllToAllConfig = field(default_factory=AllToAllConfig)  # the MoE exchange
    collective_backend: str = "rayinfer"
    cuda_graphs: CudaGraphConfig | None = None  # decode graphs (see graph_config.graph_blocker)
    kv_memory: KVMemoryConfig | None = None  # size the cache from GPU memory (CUDA only)
    fp8_weights: bool = False  # keep FP8 block-scaled checkpoint weights in FP8 (DeepSeek)
    overlap: OverlapConfig = DEFAULT_OVERLAP  # the two-batch overlap's split, shared experts
    kernels: KernelBackends = DEFAULT_BACKENDS  # which kernel serves ops with several
    process: ProcessConfig = DEFAULT_PROCESS  # NUMA binding, GC freeze, profiler
    kv_handoff: KVHandoffConfig = DEFAULT_KV_HANDOFF  # how exported KV leaves (handoff_io.py)
