"""Assemble what a replica runs from the AppConfig: model source, tokenizer, engine, workers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rayinfer.config import CacheConfig, ConfigError, KVMemoryConfig, ModelConfig, SchedulerConfig
from rayinfer.deployments.config import AppConfig, PhaseConfig
from rayinfer.engine.engine import LLMEngine
from rayinfer.engine.model_source import DTYPES, resolve_model_path
from rayinfer.engine.tokenizer import Tokenizer, TokenizerError
from rayinfer.graph_config import (
    DEFAULT_MAX_PREFILL_GRAPH_TOKENS,
    CudaGraphConfig,
    cuda_graph_config,
)
from rayinfer.workers.group import WorkerGroup
from rayinfer.workers.worker import WorkerSpec

MAX_DEFAULT_MODEL_LEN = 8192


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


def build_engine(
    config: AppConfig, source: ModelSource, phase: str, name_prefix: str
) -> tuple[LLMEngine, WorkerGroup]:
    """One replica's engine over a WorkerGroup scheduled into the replica's placement group."""
    phase_config: PhaseConfig = getattr(config, phase)
    model_config = source.model_config.with_index_cache_dtype(config.index_cache_dtype)
    block_size = config.block_size
    num_blocks = phase_config.num_kv_blocks or -(
        -max(4 * source.max_model_len, 16384) // block_size
    )
    cache_config = CacheConfig(block_size, num_blocks, config.enable_prefix_caching)
    scheduler_config = SchedulerConfig(
        phase_config.max_num_seqs, phase_config.max_num_batched_tokens, source.max_model_len
    )
    kv_memory = None  # num_kv_blocks, when given, wins
    if phase_config.gpu_memory_utilization is not None and phase_config.num_kv_blocks is None:
        kv_memory = KVMemoryConfig(
            phase_config.gpu_memory_utilization,
            phase_config.max_num_batched_tokens,
            source.max_model_len,
            phase_config.max_num_seqs,
            key=f"{phase}.gpu_memory_utilization",
        )
    use_gpus = uses_gpus(config)
    spec = WorkerSpec(
        model_config=model_config,
        cache_config=cache_config,
        device="cuda" if use_gpus else "cpu",
        dtype=None if config.dtype == "auto" else DTYPES[config.dtype],
        num_threads=0 if use_gpus else max(1, round(phase_config.cpus_per_worker)),
        plan=phase_config.plan,
        two_batch_overlap=phase_config.two_batch_overlap,
        all_to_all=phase_config.all_to_all.options(),
        cuda_graphs=phase_graphs(phase_config, phase, use_gpus, source.max_model_len, model_config),
        kv_memory=kv_memory,
        fp8_weights=phase_config.uses_fp8_weights(config.fp8_weights),
    )
    group = WorkerGroup(
        name_prefix,
        spec,
        num_workers=phase_config.num_workers,
        use_gpus=use_gpus,
        cpus_per_worker=phase_config.cpus_per_worker,
        gpus_per_worker=phase_config.gpus_per_worker or 1.0,
    )
    engine = LLMEngine(model_config, cache_config, scheduler_config, group, source.load_tokenizer())
    return engine, group


def phase_graphs(
    phase_config: PhaseConfig,
    phase: str,
    use_gpus: bool,
    max_model_len: int,
    model_config: ModelConfig | None = None,
) -> CudaGraphConfig | None:
    """The phase's graphs; `auto` captures them on GPUs where the forward can be captured
    (graph_config.graph_blocker). The decode phase replays its decode steps; the prefill phase,
    whose replicas stop after the first token, its new prompts (and one decode bucket of 1)."""
    requested = None if phase_config.cuda_graphs == "auto" else phase_config.cuda_graphs
    is_prefill = phase == "prefill"
    prefill_tokens = phase_config.max_graph_prefill_tokens
    if prefill_tokens is None:
        prefill_tokens = DEFAULT_MAX_PREFILL_GRAPH_TOKENS if is_prefill else 0
    return cuda_graph_config(
        requested,
        is_cuda=use_gpus,
        plan=phase_config.plan,
        max_num_seqs=phase_config.max_num_seqs,
        max_graph_batch_size=1 if is_prefill else phase_config.max_graph_batch_size,
        max_model_len=max_model_len,
        all_to_all=phase_config.all_to_all.options(),
        key=f"{phase}.cuda_graphs",
        max_prefill_tokens=min(prefill_tokens, phase_config.max_num_batched_tokens),
        model=model_config,
    )
