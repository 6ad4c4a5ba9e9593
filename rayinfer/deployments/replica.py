"""What a Prefill, Decode or Engine replica shares: its engine, the loop thread, metrics,
health, and the start-up line saying how many tokens its KV cache holds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.engine_loop import EngineLoop
from rayinfer.deployments.metrics import ServeMetrics
from rayinfer.deployments.runtime import ModelSource, build_engine, kv_capacity

logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log

GAUGE_REFRESH_S = 0.5


def replica_suffix() -> str:
    """A short id unique to this replica, so worker actor names never collide across replicas."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit tests)
        import uuid

        return uuid.uuid4().hex[:8]


class PhaseReplica:
    """Owns one engine over a WorkerGroup named `rayinfer-<phase>-<replica>-r<rank>`."""

    phase = ""

    def __init__(self, config: dict, source: ModelSource):
        self.config = AppConfig.model_validate(config)
        self.source = source
        self.metrics = ServeMetrics(self.phase)
        name_prefix = f"rayinfer-{self.phase}-{replica_suffix()}"
        self.engine, self.workers = build_engine(self.config, source, self.phase, name_prefix)
        self.kv_capacity = kv_capacity(self.config, source, self.phase, self.engine)
        logger.info("%s", self.kv_capacity.describe(self.phase))
        self._num_kv_recomputes = 0
        self._steps_reported = dict(self.workers.step_counts)  # mode -> steps already counted
        self._last_report = 0.0
        self.loop = EngineLoop(self.engine, name=name_prefix, on_tick=self._report_engine)

    def _report_engine(self) -> None:
        """Runs on the loop thread. Ray drops a gauge not set for 2 report intervals: refresh."""
        now = time.monotonic()
        if now - self._last_report < GAUGE_REFRESH_S:
            return
        self._last_report = now
        stats = self.loop.stats()
        self.metrics.observe_engine(
            stats["num_waiting"], stats["num_running"], stats["kv_usage"],
            self.kv_capacity.num_tokens,
        )  # fmt: skip
        new_recomputes = stats["num_kv_recomputes"] - self._num_kv_recomputes
        if new_recomputes:
            self.metrics.kv_recomputes.inc(new_recomputes, tags=self.metrics.tags)
            self._num_kv_recomputes = stats["num_kv_recomputes"]
        for mode, count in self.workers.step_counts.items():  # the loop thread counts them too
            self.metrics.add_steps(mode, count - self._steps_reported.get(mode, 0))
            self._steps_reported[mode] = count

    async def counted(self, chunks: AsyncIterator) -> AsyncIterator:
        """A request's stream passed through, the request counted by how it ended: "ok", "error",
        or "abort" when the caller left early."""
        status = "abort"
        try:
            async for chunk in chunks:
                yield chunk
            status = "ok"
        except Exception:
            status = "error"
            raise
        finally:
            self.metrics.count_request(status)

    async def check_health(self) -> None:
        if not self.loop.is_healthy:
            raise RuntimeError(f"{self.phase} engine loop stopped: {self.loop.fatal_error!r}")
        await asyncio.to_thread(self.workers.check_health)

    def worker_names(self) -> list[str]:
        return list(self.workers.worker_names)

    def num_kv_recomputes(self) -> int:
        return self.engine.num_kv_recomputes

    def step_counts(self) -> dict[str, int]:
        """Engine steps the workers ran from decode CUDA graphs ("graph"), from prefill graphs
        ("prefill_graph") or eagerly."""
        return dict(self.workers.step_counts)
