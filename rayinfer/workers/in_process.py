"""An Executor that runs the model on one device inside the calling process (no Ray actors)."""

from __future__ import annotations

import torch

from rayinfer.config import CacheConfig, KVMemoryConfig, ModelConfig
from rayinfer.engine.batch import ModelBatch, SampledTokens
from rayinfer.engine.executor import Executor
from rayinfer.graph_config import CudaGraphConfig
from rayinfer.workers.runner.kv_transfer import KVPayload, fetch_payloads
from rayinfer.workers.runner.model_runner import ModelRunner
from rayinfer.workers.runner.step_profiler import StepProfiler


class InProcessExecutor(Executor):
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: str | torch.device,
        dtype: torch.dtype,
        two_batch_overlap: bool | None = None,
        load_format: str = "safetensors",
        cuda_graphs: CudaGraphConfig | None = None,
        kv_memory: KVMemoryConfig | None = None,
        fp8_weights: bool = False,
    ):
        self.runner = ModelRunner(
            model_config,
            cache_config,
            device,
            dtype,
            two_batch_overlap=two_batch_overlap,
            load_format=load_format,
            cuda_graphs=cuda_graphs,
            kv_memory=kv_memory,
            fp8_weights=fp8_weights,
        )

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.cache_config.num_blocks

    def execute(self, batch: ModelBatch) -> SampledTokens:
        return self.runner.execute(batch)

    @property
    def graph_capture_seconds(self) -> float | None:
        return self.runner.graph_capture_seconds

    def export_kv(
        self, request_id: str, block_table: list[int], num_tokens: int, partition: int = 0
    ) -> KVPayload:
        return self.runner.export_kv(request_id, block_table, num_tokens)

    def import_kv(
        self, request_id: str, block_table: list[int], payload, partition: int = 0
    ) -> None:
        """`payload`: a KVPayload, or a WorkerGroup's KVRefs (fetched from the object store);
        written before this returns."""
        if hasattr(payload, "shards"):
            payload = fetch_payloads(payload.shards)
        self.runner.import_kv(request_id, block_table, payload)

    def free_requests(self, request_ids: list[str]) -> None:
        self.runner.free_requests(request_ids)

    def drain_step_timelines(self) -> dict:
        return {"ranks": [self.runner.timelines.drain()], "driver": []}

    def start_profile(self, path: str) -> None:
        self._profiler = StepProfiler(self.runner.device)
        self._profiler.start(path)

    def stop_profile(self) -> list[str]:
        return [self._profiler.stop()]
