"""A Ray actor on exactly one GPU (or the CPU) holding one ModelRunner.

KV hand-off: `export_kv` puts the packed KV into the object store from inside this actor, so the
actor owns the object, and returns the ObjectRef nested in a `KVShard` (a reference, not a copy).
`import_kv` resolves a shard's ref here; a shard whose owner died reads as lost (False).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
import torch

from rayinfer.config import CacheConfig, ModelConfig
from rayinfer.engine.batch import ModelBatch
from rayinfer.engine.kv_transfer import KVPayload

# The hand-off's object can no longer be read (OwnerDiedError is an ObjectLostError).
LOST_OBJECT_ERRORS = (
    ray.exceptions.ObjectLostError,
    ray.exceptions.ObjectFetchTimedOutError,
    ray.exceptions.GetTimeoutError,
)


@dataclass
class KVShard:
    """One worker's part of a request's KV in the object store."""

    ref: ray.ObjectRef  # -> KVPayload, owned by the worker named `owner`
    num_bytes: int
    owner: str  # the worker actor's name


@dataclass
class WorkerSpec:
    """What a worker needs to build its ModelRunner."""

    model_config: ModelConfig
    cache_config: CacheConfig
    device: str  # "auto", "cpu" or "cuda"
    dtype: torch.dtype | None  # None: float32 on the CPU, bfloat16 on GPUs
    num_threads: int = 0  # torch CPU threads; 0 keeps torch's default
    import_timeout_s: float = 60.0


class Worker:
    """Use through `WorkerGroup`, which wraps this class with `ray.remote` and names each actor."""

    def __init__(self, name: str, rank: int, world_size: int, spec: WorkerSpec):
        from rayinfer.engine.model_runner import ModelRunner
        from rayinfer.engine.model_source import resolve_device, resolve_dtype

        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.spec = spec
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        self.runner = ModelRunner(spec.model_config, spec.cache_config, self.device, self.dtype)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "rank": self.rank,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "pid": os.getpid(),
        }

    def init_collective(self, world_size: int, rank: int, backend: str, group_name: str) -> None:
        """Join the group's collective group (one model over several workers uses it)."""
        import ray.util.collective as collective

        if backend == "rayinfer":
            import rayinfer.comm  # noqa: F401  (registers the backend)
        collective.init_collective_group(world_size, rank, backend=backend, group_name=group_name)

    def execute(self, batch: ModelBatch) -> list[int]:
        return self.runner.execute(batch)

    def export_kv(self, request_id: str, block_table: list[int], num_tokens: int) -> KVShard:
        payload = self.runner.export_kv(request_id, block_table, num_tokens)
        return KVShard(ref=ray.put(payload), num_bytes=payload.num_bytes, owner=self.name)

    def import_kv(self, request_id: str, block_table: list[int], shards: list[KVShard]) -> bool:
        """Write this rank's shard into the cache; False when its object is gone."""
        shard = shards[self.rank % len(shards)]
        try:
            payload: KVPayload = ray.get(shard.ref, timeout=self.spec.import_timeout_s)
        except LOST_OBJECT_ERRORS:
            return False
        self.runner.import_kv(request_id, block_table, payload)
        return True

    def free_requests(self, request_ids: list[str]) -> None:
        self.runner.free_requests(request_ids)
