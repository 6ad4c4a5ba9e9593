"""Notice a worker's death the moment Ray reports it, busy or idle.

Each worker holds one call of `Worker.wait_until_killed` open on its own thread (the `watch`
concurrency group); the call only ends when the actor dies (`ray.kill`, a SIGKILL, its node
lost), so one thread waiting on those calls wakes as soon as the first worker is gone, without
polling and without queueing behind the workers' steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLost:
    """Which worker died first, and how Ray reported it."""

    worker_name: str
    error: str  # the exception's type name, e.g. "ActorDiedError"

    def describe(self) -> str:
        return f"worker {self.worker_name} died ({self.error})"


class DeathWatch:
    def __init__(
        self, workers: list, worker_names: list[str], on_lost: Callable[[WorkerLost], None]
    ):
        """on_lost runs once, on the watch's thread, for the first worker that dies; never
        after `close` (a group shutting down kills its own workers)."""
        self.on_lost = on_lost
        self.lost: WorkerLost | None = None
        self._closed = threading.Event()
        self._calls = {w.wait_until_killed.remote(): n for w, n in zip(workers, worker_names)}
        self._thread = threading.Thread(
            target=self._watch, name=f"death-watch-{worker_names[0]}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        ready, _ = ray.wait(list(self._calls), num_returns=1, timeout=None, fetch_local=False)
        if self._closed.is_set():
            return
        call = ready[0]
        try:
            ray.get(call)
            error = "returned"  # the call only ends with the actor: count it as lost
        except Exception as exc:  # noqa: BLE001  (ActorDiedError, or how else Ray says it)
            error = type(exc).__name__
        self.lost = WorkerLost(self._calls[call], error)
        logger.error("%s", self.lost.describe())
        try:
            self.on_lost(self.lost)
        except Exception:  # noqa: BLE001  (the thread ends either way; say why)
            logger.exception("the handler of %s failed", self.lost.describe())
