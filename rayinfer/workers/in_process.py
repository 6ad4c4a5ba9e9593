"""An Executor that runs the model on one device inside the calling process (no Ray actors)."""

from __future__ import annotations

from rayinfer.engine.batch import ModelBatch, SampledTokens
from rayinfer.engine.executor import Executor
from rayinfer.engine.model_source import resolve_device, resolve_dtype
from rayinfer.workers.runner.kv_transfer import KVPayload
from rayinfer.workers.runner.model_runner import ModelRunner
from rayinfer.workers.runner.step_profiler import StepProfiler
from rayinfer.workers.spec import WorkerSpec


class InProcessExecutor(Executor):
    def __init__(self, spec: WorkerSpec):
        """One device's runner in this process; the spec's plan must be one worker."""
        if spec.plan.num_workers != 1:
            workers = spec.plan.num_workers
            raise ValueError(f"plan {spec.plan} needs {workers} workers; use a WorkerGroup")
        device = resolve_device(spec.device)
        self.spec = spec
        self.runner = ModelRunner(
            spec.model_config,
            spec.cache_config,
            device,
            resolve_dtype(spec.dtype, device),
            two_batch_overlap=spec.two_batch_overlap,
            load_format=spec.load_format,
            cuda_graphs=spec.cuda_graphs,
            kv_memory=spec.kv_memory,
            fp8_weights=spec.fp8_weights,
            overlap=spec.overlap,
            kernels=spec.kernels,
        )
        self._handoff = None  # a HandoffIO, made at the first import from a WorkerGroup

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.cache_config.num_blocks

    def execute(self, batch: ModelBatch) -> SampledTokens:
        return self.runner.execute(batch)

    @property
    def graph_capture_seconds(self) -> float | None:
        return self.runner.graph_capture_seconds

    def export_kv(
        self,
        request_id: str,
        block_table: list[int],
        num_tokens: int,
        partition: int = 0,
        window_table: list[int] | None = None,
    ) -> KVPayload:
        return self.runner.export_kv(request_id, block_table, num_tokens, window_table)

    def import_kv(
        self,
        request_id: str,
        block_table: list[int],
        payload,
        partition: int = 0,
        window_table: list[int] | None = None,
    ) -> None:
        """`payload`: a KVPayload, or a WorkerGroup's KVRefs (mapped from the exporters' arenas
        or fetched from the object store); written before this returns."""
        if not hasattr(payload, "shards"):
            self.runner.import_kv(request_id, block_table, payload, window_table)
            return
        from rayinfer.engine.executor import KVLostError
        from rayinfer.workers.handoff_io import KVLost

        try:
            landed = self.handoff.import_(
                self.runner.kv_cache, block_table, payload.shards, window_table=window_table
            )
        except KVLost as lost:
            raise KVLostError(f"request {request_id!r}: its KV is gone ({lost})") from None
        if landed.generator_state is not None:
            self.runner.sampler.restore_generator(request_id, landed.generator_state)

    def discard_kv(self, payload) -> None:
        if hasattr(payload, "shards"):
            self.handoff.discard(payload.shards)

    @property
    def handoff(self):
        """The hand-off's import side (workers/handoff_io.py), made at first use: it needs Ray."""
        if self._handoff is None:
            from rayinfer.workers.handoff_io import HandoffIO

            is_cuda = self.runner.device.type == "cuda"
            self._handoff = HandoffIO(is_cuda, self.spec.kv_handoff, self.spec.import_timeout_s)
        return self._handoff

    def free_requests(self, request_ids: list[str]) -> None:
        self.runner.free_requests(request_ids)

    def drain_step_timelines(self) -> dict:
        return {"ranks": [self.runner.timelines.drain()], "driver": []}

    def start_profile(self, path: str) -> None:
        self._profiler = StepProfiler(self.runner.device, self.spec.process.profile_cpu)
        self._profiler.start(path)

    def stop_profile(self) -> list[str]:
        return [self._profiler.stop()]
