"""What a Prefill, Decode or Engine replica shares: its engine, the loop thread, metrics,
health, the start-up line saying how many tokens its KV cache holds, and its exit on failure.

A replica whose engine can no longer step (a worker died: every step runs on all of them; or
the loop failed) leaves at once: it kills its own actor. Serve marks a crashed replica
unhealthy at its next health check and replaces it (a failing check would need three in a
row), and every caller sees the replica die: Serve's router stops choosing it, sends new
requests elsewhere, and the ingress retries or resumes what it held on another replica. Until
the kill lands, a request that meets the failure does not answer; it waits for the exit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import ray
from ray import serve

from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.engine_loop import EngineLoop, EngineStoppedError
from rayinfer.deployments.metrics import ServeMetrics
from rayinfer.deployments.runtime import ModelSource, build_engine, kv_capacity
from rayinfer.deployments.step_log import StepLog

logger = logging.getLogger("ray.serve")  # Serve writes it to the replica's log

GAUGE_REFRESH_S = 0.5
# How long a request that met this replica's failure waits for the replica's own kill (it lands
# in well under a second) before it answers EngineStoppedError instead.
EXIT_WAIT_S = 10.0


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
        self._step_log = StepLog(self.phase, self.workers.drain_step_timelines)
        self.failure: str | None = None  # why this replica is leaving; None while it serves
        self.loop = EngineLoop(
            self.engine, name_prefix, on_tick=self._report_engine, on_fatal=self._engine_failed,
            chunk_interval_s=self.config.stream_interval_ms / 1000,
        )  # fmt: skip
        self.workers.watch(lambda lost: self._leave(lost.describe()))

    def __del__(self) -> None:
        """Serve's hook at a replica's graceful stop (scale-down, redeploy, `serve shutdown`),
        called once before Ray ends the actor: unlink the workers' hand-off arenas, which
        workers killed with their owner would leave behind (workers/runner/kv_arena.py)."""
        workers = getattr(self, "workers", None)  # None: the constructor failed
        if workers is not None and workers.workers and ray.is_initialized():
            workers.close_arenas()

    def _engine_failed(self, error: BaseException) -> None:
        self._leave(f"its engine loop failed ({type(error).__name__})")

    def _leave(self, why: str) -> None:
        """Runs on the loop's or the death watch's thread: mark the replica failed, then kill
        its actor (its workers go with it; Serve starts a replacement)."""
        if self.failure is not None:
            return
        self.failure = why
        logger.error("%s replica leaving: %s", self.phase, why)
        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return  # not an actor (unit tests): failing health is all there is
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def until_gone(self) -> None:
        """Returns at once while this replica serves; after a failure it waits for the kill
        (the caller then sees the replica die) and raises only if the kill never came."""
        if self.failure is None:
            return
        await asyncio.sleep(EXIT_WAIT_S)
        raise EngineStoppedError(self.failure)

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
        step_times = self.loop.take_step_times()
        self.metrics.observe_steps(step_times)
        self._step_log.add(step_times, now)
        for mode, count in self.workers.step_counts.items():  # the loop thread counts them too
            self.metrics.add_steps(mode, count - self._steps_reported.get(mode, 0))
            self._steps_reported[mode] = count

    async def counted(self, chunks: AsyncIterator) -> AsyncIterator:
        """A request's stream passed through, the request counted by how it ended: "ok", "error",
        or "abort" when the caller left early."""
        await self.until_gone()  # a request routed here while this replica leaves
        status = "abort"
        try:
            async for chunk in chunks:
                yield chunk
            status = "ok"
        except Exception:
            status = "error"
            await self.until_gone()
            raise
        finally:
            self.metrics.count_request(status)

    async def check_health(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"{self.phase} replica leaving: {self.failure}")
        if not self.loop.is_healthy:
            raise RuntimeError(f"{self.phase} engine loop stopped: {self.loop.fatal_error!r}")
        await asyncio.to_thread(self.workers.check_health)

    def worker_names(self) -> list[str]:
        return list(self.workers.worker_names)

    def num_kv_recomputes(self) -> int:
        return self.engine.handoffs.num_kv_recomputes

    def step_counts(self) -> dict[str, int]:
        """Engine steps the workers ran from decode CUDA graphs ("graph"), from prefill graphs
        ("prefill_graph") or eagerly."""
        return dict(self.workers.step_counts)
