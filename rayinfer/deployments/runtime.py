"""Assemble what a replica runs from the AppConfig: model source, tokenizer, engine, workers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.phase_config import PhaseConfig
from rayinfer.engine.model_source import resolve_dtype, resolve_model_path
from rayinfer.engine.tokenizer import Tokenizer, TokenizerError
from rayinfer.graph_config import (
    DEFAULT_MAX_PIECEWISE_GRAPH_TOKENS,
    DEFAULT_MAX_PREFILL_GRAPH_TOKENS,
    CudaGraphConfig,
)

if TYPE_CHECKING:  # torch and the engine are imported where used: an ingress replica needs none
    from rayinfer.engine.engine import LLMEngine
    from rayinfer.engine_args import EngineArgs
    from rayinfer.engine_config import KVMemoryConfig
    from rayinfer.workers.group import WorkerGroup
    from rayinfer.workers.spec import WorkerSpec

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # of each worker's GPU (share), as vLLM's default


@dataclass(frozen=True)
class ModelSource:
    """The checkpoint an app serves, checked at build time and shipped to every replica.

    It keeps the model as the user named it and resolves the folder on the node that reads it,
    so "tiny" is written wherever a replica runs (a replica and its workers share one node).
    """

    model: str  # "tiny" or a checkpoint folder
    tokenizer: str | None  # a tokenizer folder; None: the model's own
    served_model_name: str
    max_model_len: int

    @classmethod
    def resolve(cls, config: AppConfig) -> ModelSource:
        from rayinfer.engine_args import MAX_DEFAULT_MODEL_LEN

        path = resolve_model_path(config.model)
        model_config = ModelConfig.from_pretrained(path)
        limit = model_config.max_position_embeddings
        max_model_len = config.max_model_len or min(limit, MAX_DEFAULT_MODEL_LEN)
        if max_model_len > limit:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{limit}; use max_model_len<={limit}"
            )
        name = config.served_model_name or (
            "tiny" if config.model == "tiny" else Path(config.model).name
        )
        return cls(config.model, config.tokenizer, name, max_model_len)

    @property
    def path(self) -> Path:
        return resolve_model_path(self.model)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_pretrained(self.path)

    def load_tokenizer(self) -> Tokenizer | None:
        try:
            return Tokenizer.from_pretrained(self.tokenizer or self.path)
        except TokenizerError:
            return None


def available_gpus() -> int:
    """GPUs of the Ray cluster, or of this machine before `serve run` has connected to Ray."""
    import ray

    if ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    import torch

    return torch.cuda.device_count()


def uses_gpus(config: AppConfig) -> bool:
    """Whether workers take GPUs: device=cuda, or auto with GPUs in the Ray cluster (or, before
    `serve run` has connected to Ray, on this machine: a head without GPUs needs device=cuda)."""
    if config.device != "auto":
        return config.device == "cuda"
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def phase_fields(phase_config: PhaseConfig, phase: str, use_gpus: bool) -> dict[str, Any]:
    """The EngineArgs fields a phase's section sets. Serve's own defaults: on GPUs the cache
    fills `gpu_memory_utilization` (default 0.9, as vLLM) of each worker's share of its GPU
    unless num_kv_blocks is given; the prefill phase, whose replicas stop after the first
    token, captures one decode bucket of 1; the decode phase no prefill graphs by default."""
    memory = None
    if use_gpus and phase_config.num_kv_blocks is None:
        memory = phase_config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    prefill_tokens = phase_config.max_graph_prefill_tokens
    if prefill_tokens is None:  # a colocated engine prefills too
        prefill_tokens = DEFAULT_MAX_PREFILL_GRAPH_TOKENS if phase != "decode" else 0
    piecewise_tokens = phase_config.max_graph_piecewise_tokens
    if piecewise_tokens is None:  # the decode phase runs pure decodes (and imports)
        piecewise_tokens = DEFAULT_MAX_PIECEWISE_GRAPH_TOKENS if phase != "decode" else 0
    return dict(
        num_kv_blocks=phase_config.num_kv_blocks,
        gpu_memory_utilization=memory,
        gpu_share=phase_config.gpus_per_worker or 1.0,
        max_num_seqs=phase_config.max_num_seqs,
        max_num_batched_tokens=phase_config.max_num_batched_tokens,
        waiting_served_ratio=phase_config.waiting_served_ratio,
        max_waiting_steps=phase_config.max_waiting_steps,
        parallel=phase_config.plan,
        two_batch_overlap=phase_config.two_batch_overlap,
        cuda_graphs=None if phase_config.cuda_graphs == "auto" else phase_config.cuda_graphs,
        max_graph_batch_size=1 if phase == "prefill" else phase_config.max_graph_batch_size,
        max_graph_prefill_tokens=prefill_tokens,
        max_graph_piecewise_tokens=piecewise_tokens,
        all_to_all=phase_config.all_to_all,
        overlap=phase_config.overlap,
        kernels=phase_config.kernels,
        process=phase_config.process,
        key_prefix=f"{phase}.",
    )


def phase_engine_args(
    config: AppConfig, source: ModelSource, phase: str, use_gpus: bool
) -> EngineArgs:
    """What one replica of `phase` runs, as the offline LLM would take it."""
    from rayinfer.engine.model_source import DTYPES
    from rayinfer.engine_args import EngineArgs

    phase_config: PhaseConfig = getattr(config, phase)
    return EngineArgs(
        model=source.model,
        device="cuda" if use_gpus else "cpu",
        dtype=None if config.dtype == "auto" else DTYPES[config.dtype],
        load_format=config.load_format,
        fp8_weights=phase_config.uses_fp8_weights(config.fp8_weights),
        index_cache_dtype=config.index_cache_dtype,
        max_model_len=source.max_model_len,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_handoff=config.kv_handoff,
        **phase_fields(phase_config, phase, use_gpus),
    )


def build_engine(
    config: AppConfig, source: ModelSource, phase: str, name_prefix: str
) -> tuple[LLMEngine, WorkerGroup]:
    """One replica's engine over a WorkerGroup scheduled into the replica's placement group."""
    from rayinfer.workers.group import WorkerGroup

    phase_config: PhaseConfig = getattr(config, phase)
    use_gpus = uses_gpus(config)
    args = phase_engine_args(config, source, phase, use_gpus)
    num_threads = 0 if use_gpus else max(1, round(phase_config.cpus_per_worker))
    spec = args.worker_spec(args.device, num_threads)

    def start_workers(spec: WorkerSpec) -> WorkerGroup:
        return WorkerGroup(
            name_prefix,
            spec,
            num_workers=phase_config.num_workers,
            use_gpus=use_gpus,
            cpus_per_worker=phase_config.cpus_per_worker,
            gpus_per_worker=phase_config.gpus_per_worker or 1.0,
        )

    engine = args.build(spec, start_workers, source.load_tokenizer())
    return engine, engine.executor


def kv_memory_config(
    phase_config: PhaseConfig, phase: str, use_gpus: bool, max_model_len: int
) -> KVMemoryConfig | None:
    """How a replica's workers size their KV cache: None keeps the CacheConfig's count
    (num_kv_blocks when given, which wins; on the CPU max(4 x max_model_len, 16384) tokens);
    on GPUs from memory (see phase_fields; workers/runner/kv_memory.py)."""
    from rayinfer.engine_args import EngineArgs

    args = EngineArgs(**phase_fields(phase_config, phase, use_gpus))
    return args.kv_memory(max_model_len)


@dataclass(frozen=True)
class KVCapacity:
    """What a replica's KV cache holds, for its start-up log line and the capacity gauge."""

    num_blocks: int  # per data-parallel partition
    num_partitions: int
    block_size: int
    bytes_per_token: int  # every layer's cache row of one token, on one worker
    rule: str  # how the block count was decided

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size * self.num_partitions

    def describe(self, phase: str) -> str:
        partitions = f" x {self.num_partitions} partitions" if self.num_partitions > 1 else ""
        return (
            f"{phase} KV cache: {self.num_blocks} blocks{partitions} of {self.block_size} tokens "
            f"= {self.num_tokens} tokens, {self.bytes_per_token} bytes per token per worker; "
            f"{self.rule}"
        )


def kv_capacity(
    config: AppConfig, source: ModelSource, phase: str, engine: LLMEngine
) -> KVCapacity:
    """The capacity of a built replica's cache (the engine holds the count its workers chose)."""
    import torch

    from rayinfer.engine.model_source import DTYPES
    from rayinfer.workers.runner.kv_memory import kv_bytes_per_block

    phase_config: PhaseConfig = getattr(config, phase)
    use_gpus = uses_gpus(config)
    memory = kv_memory_config(phase_config, phase, use_gpus, source.max_model_len)
    if phase_config.num_kv_blocks is not None:
        rule = f"{phase}.num_kv_blocks={phase_config.num_kv_blocks}"
    elif memory is None:
        rule = f"max(4 x max_model_len, 16384) tokens (max_model_len={source.max_model_len})"
    else:
        share = f" of a {memory.gpu_share:g} GPU share" if memory.gpu_share < 1 else ""
        rule = f"{memory.key}={memory.gpu_memory_utilization:g}{share}, after a profiling step"
    dtype = resolve_dtype(DTYPES.get(config.dtype), torch.device("cuda" if use_gpus else "cpu"))
    cache = engine.cache_config
    bytes_per_token = kv_bytes_per_block(engine.model_config, phase_config.tp, dtype.itemsize, 1)
    num_partitions = engine.executor.num_kv_partitions
    return KVCapacity(cache.num_blocks, num_partitions, cache.block_size, bytes_per_token, rule)


def phase_graphs(
    phase_config: PhaseConfig,
    phase: str,
    use_gpus: bool,
    max_model_len: int,
    model_config: ModelConfig | None = None,
) -> CudaGraphConfig | None:
    """The phase's graphs; `auto` captures them on GPUs where the forward can be captured
    (graph_config.graph_blocker). The decode phase replays its decode steps; the prefill phase,
    whose replicas stop after the first token, its new prompts (and one decode bucket of 1); a
    colocated engine both."""
    from rayinfer.engine_args import EngineArgs

    args = EngineArgs(**phase_fields(phase_config, phase, use_gpus))
    return args.graph_config(max_model_len, use_gpus, model_config)
