"""EngineArgs: every setting of one engine, and the one builder that turns them into the engine's
configs, its executor and the engine, for the offline `LLM` and the Serve deployments alike.

The user-facing entry points (`LLM(...)`'s arguments, a Serve phase's config) become one
EngineArgs; its typed sub-configs (AllToAllConfig, OverlapConfig, KernelBackends, ProcessConfig,
KVHandoffConfig) are validated when they are made and travel unchanged in the WorkerSpec to every
worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from rayinfer.config import ConfigError, ModelConfig, ParallelPlan
from rayinfer.engine.engine import LLMEngine
from rayinfer.engine.executor import Executor
from rayinfer.engine.model_source import resolve_model_path
from rayinfer.engine_config import (
    DEFAULT_KV_HANDOFF,
    CacheConfig,
    KVHandoffConfig,
    KVMemoryConfig,
    SchedulerConfig,
    check_gpu_memory_utilization,
    default_num_kv_blocks,
    window_blocks_needed,
)
from rayinfer.exchange_config import AllToAllConfig
from rayinfer.graph_config import (
    DEFAULT_MAX_PIECEWISE_GRAPH_TOKENS,
    DEFAULT_MAX_PREFILL_GRAPH_TOKENS,
    CudaGraphConfig,
    cuda_graph_config,
)
from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.models.dummy import LOAD_FORMATS
from rayinfer.overlap_config import DEFAULT_OVERLAP, OverlapConfig
from rayinfer.process_config import DEFAULT_PROCESS, ProcessConfig
from rayinfer.workers.spec import WorkerSpec

# max_model_len when not given: the model's max_position_embeddings, at most this many tokens
MAX_DEFAULT_MODEL_LEN = 8192


def as_config(config_type: type, value: Any, key: str):
    """`value` (an instance of `config_type`, None for its defaults, or a mapping of its fields)
    as a `config_type`; a ConfigError names `key` and the valid fields or values."""
    if value is None:
        return config_type()
    if isinstance(value, config_type):
        return value
    if config_type is AllToAllConfig:
        return AllToAllConfig.of(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r}; use a {config_type.__name__} or a mapping")
    valid = [f.name for f in fields(config_type)]
    unknown = [name for name in value if name not in valid]
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is unknown; valid keys: {', '.join(valid)}")
    try:
        return config_type(**value)
    except ValueError as error:  # kernels/ raises ValueError: it imports nothing of rayinfer
        raise ConfigError(str(error)) from None


@dataclass(frozen=True)
class EngineArgs:
    """What one engine runs, as LLM's arguments say (see `rayinfer.LLM`).

    gpu_share: each worker's share of its GPU (Serve's gpus_per_worker), for sizing the cache
    from memory. key_prefix: how errors name the settings ("decode." for a Serve phase)."""

    model: str = "tiny"
    device: str = "auto"
    dtype: str | torch.dtype | None = None
    load_format: str = "safetensors"
    fp8_weights: bool = False
    index_cache_dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    gpu_share: float = 1.0
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 20
    parallel: ParallelPlan = field(default_factory=ParallelPlan)
    two_batch_overlap: bool | None = None
    cuda_graphs: bool | None = None
    max_graph_batch_size: int = 256
    max_graph_prefill_tokens: int = DEFAULT_MAX_PREFILL_GRAPH_TOKENS
    max_graph_piecewise_tokens: int = DEFAULT_MAX_PIECEWISE_GRAPH_TOKENS
    all_to_all: AllToAllConfig = field(default_factory=AllToAllConfig)
    overlap: OverlapConfig = DEFAULT_OVERLAP
    kernels: KernelBackends = DEFAULT_BACKENDS
    process: ProcessConfig = DEFAULT_PROCESS
    kv_handoff: KVHandoffConfig = DEFAULT_KV_HANDOFF
    key_prefix: str = ""

    def __post_init__(self):
        prefix = self.key_prefix
        if self.fp8_weights not in (True, False):
            raise ConfigError(f"{prefix}fp8_weights={self.fp8_weights!r}; use True or False")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"{prefix}load_format={self.load_format!r}; use one of {', '.join(LOAD_FORMATS)}"
            )
        check_gpu_memory_utilization(self.gpu_memory_utilization, f"{prefix}gpu_memory_utilization")
        for key, config_type in (
            ("parallel", ParallelPlan),
            ("all_to_all", AllToAllConfig),
            ("overlap", OverlapConfig),
            ("kernels", KernelBackends),
            ("process", ProcessConfig),
            ("kv_handoff", KVHandoffConfig),
        ):
            if not isinstance(getattr(self, key), config_type):
                raise ConfigError(f"{prefix}{key}: use a {config_type.__name__} (as_config)")

    @property
    def model_path(self) -> Path:
        return resolve_model_path(self.model)

    def model_config(self) -> ModelConfig:
        """The checkpoint's config with this engine's indexer-key cache dtype."""
        config = ModelConfig.from_pretrained(self.model_path)
        return config.with_index_cache_dtype(self.index_cache_dtype)

    def check_model(self, model_config: ModelConfig) -> None:
        """Fail (a ConfigError naming the key) where the model cannot run as asked: a plan that
        does not split it, FP8 weights it lacks or a tensor-parallel split that cuts a block."""
        from rayinfer.models.fp8 import check_fp8_weights
        from rayinfer.models.loader import check_has_fp8_weights, checkpoint_files

        prefix = self.key_prefix
        self.parallel.check_fits(model_config, prefix.rstrip(".") or "parallel")
        if self.fp8_weights:
            check_fp8_weights(model_config, self.parallel.tp, f"{prefix}fp8_weights", f"{prefix}tp")
            if self.load_format != "dummy":
                path = self.model_path
                check_has_fp8_weights(checkpoint_files(path), path, f"{prefix}fp8_weights")

    def resolved_max_model_len(self, model_config: ModelConfig) -> int:
        limit = model_config.max_position_embeddings
        return self.max_model_len or min(limit, MAX_DEFAULT_MODEL_LEN)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        try:
            return SchedulerConfig(
                self.max_num_seqs, max(self.max_num_batched_tokens, 1), max_model_len,
                self.waiting_served_ratio, self.max_waiting_steps,
            )  # fmt: skip
        except ConfigError as error:
            raise ConfigError(f"{self.key_prefix}{error}") from None

    def cache_config(self, max_model_len: int, window_span: int = 0) -> CacheConfig:
        """num_kv_blocks when given, else room for max(4 x max_model_len, 16384) tokens (what
        the workers allocate off CUDA, or where no memory share is given); window_span: the
        model's (ModelConfig.window_span), which sizes the window pool for the scheduler's
        limits."""
        num_blocks = self.num_kv_blocks or default_num_kv_blocks(max_model_len, self.block_size)
        scheduler = self.scheduler_config(max_model_len)
        window_blocks = window_blocks_needed(
            window_span, self.block_size, scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
        )  # fmt: skip
        return CacheConfig(self.block_size, num_blocks, self.enable_prefix_caching, window_blocks)

    def kv_memory(self, max_model_len: int) -> KVMemoryConfig | None:
        """Size the cache from GPU memory: with gpu_memory_utilization, unless num_kv_blocks
        is given (which wins); the runner ignores it off CUDA."""
        if self.gpu_memory_utilization is None or self.num_kv_blocks is not None:
            return None
        return KVMemoryConfig(
            self.gpu_memory_utilization,
            max(self.max_num_batched_tokens, 1),
            max_model_len,
            self.max_num_seqs,
            key=f"{self.key_prefix}gpu_memory_utilization",
            gpu_share=self.gpu_share,
        )

    def graph_config(
        self, max_model_len: int, is_cuda: bool, model_config: ModelConfig | None = None
    ) -> CudaGraphConfig | None:
        """The CUDA graphs to capture (graph_config.cuda_graph_config); None: none."""
        max_tokens = self.scheduler_config(max_model_len).max_num_batched_tokens
        return cuda_graph_config(
            self.cuda_graphs,
            is_cuda=is_cuda,
            plan=self.parallel,
            max_num_seqs=self.max_num_seqs,
            max_graph_batch_size=self.max_graph_batch_size,
            max_model_len=max_model_len,
            all_to_all=self.all_to_all,
            key=f"{self.key_prefix}cuda_graphs",
            max_prefill_tokens=min(self.max_graph_prefill_tokens, max_tokens),
            model=model_config,
            max_piecewise_tokens=min(self.max_graph_piecewise_tokens, max_tokens),
        )

    def worker_spec(self, device: str, num_threads: int = 0) -> WorkerSpec:
        """Everything a worker on `device` ("cpu" or "cuda") takes; num_threads: torch CPU
        threads per worker (0: torch's default)."""
        model_config = self.model_config()
        self.check_model(model_config)
        max_model_len = self.resolved_max_model_len(model_config)
        graphs = self.graph_config(max_model_len, device == "cuda", model_config)
        return WorkerSpec(
            model_config,
            self.cache_config(max_model_len, model_config.window_span),
            device=device,
            dtype=None if self.dtype == "auto" else self.dtype,
            num_threads=num_threads,
            plan=self.parallel,
            two_batch_overlap=self.two_batch_overlap,
            load_format=self.load_format,
            all_to_all=self.all_to_all,
            cuda_graphs=graphs,
            kv_memory=self.kv_memory(max_model_len),
            fp8_weights=self.fp8_weights,
            overlap=self.overlap,
            kernels=self.kernels,
            process=self.process,
            kv_handoff=self.kv_handoff,
        )

    def build(
        self,
        spec: WorkerSpec,
        make_executor: Callable[[WorkerSpec], Executor],
        tokenizer=None,
    ) -> LLMEngine:
        """The engine over the executor `make_executor` starts for `spec` (this args'
        worker_spec); its cache holds the block count the executor allocated."""
        executor = make_executor(spec)
        scheduler = self.scheduler_config(self.resolved_max_model_len(spec.model_config))
        return LLMEngine(spec.model_config, spec.cache_config, scheduler, executor, tokenizer)


def local_executor(spec: WorkerSpec, name_prefix: str, cpus_per_worker: float = 0.25) -> Executor:
    """The offline executor: one device in this process, or one Ray actor per worker (GPU) for a
    larger plan, on the Ray cluster this process joins (started here when there is none)."""
    if spec.plan.num_workers == 1:
        from rayinfer.workers.in_process import InProcessExecutor

        return InProcessExecutor(spec)
    import ray

    from rayinfer.workers.group import WorkerGroup

    if not ray.is_initialized():
        ray.init()
    use_gpus = spec.device == "cuda"
    return WorkerGroup(name_prefix, spec, use_gpus=use_gpus, cpus_per_worker=cpus_per_worker)
