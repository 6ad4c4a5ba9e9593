"""The engine's view of whatever runs the model: one device in-process or a group of workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from rayinfer.engine.batch import ModelBatch, SampledTokens


class KVLostError(RuntimeError):
    """A hand-off's KV is gone (its owner died or it was evicted); the prompt must be recomputed."""


class Executor(ABC):
    @abstractmethod
    def execute(self, batch: ModelBatch) -> SampledTokens:
        """Run one step; the next token of each request that samples, in batch order, with the
        log-probabilities of those that asked for them."""

    @property
    def num_kv_blocks(self) -> int | None:
        """Blocks per partition the executor allocated when it sized the cache from GPU memory
        (`gpu_memory_utilization`); None: the CacheConfig's `num_blocks`."""
        return None

    @property
    def graph_capture_seconds(self) -> float | None:
        """Warm-up and capture of the graphs at start (a worker's); None without graphs."""
        return None

    @property
    def num_kv_partitions(self) -> int:
        """Separate KV caches (data-parallel attention replicas), each `num_blocks` blocks."""
        return 1

    @abstractmethod
    def export_kv(
        self,
        request_id: str,
        block_table: list[int],
        num_tokens: int,
        partition: int = 0,
        window_table: list[int] | None = None,
    ) -> Any:
        """Start copying out the KV of a request's first num_tokens tokens; returns the payload
        decode can import (a reference while the copy runs). The blocks may be reused once
        `transfers_done` reports it done. window_table: the request's, where the model keeps a
        window pool (engine/block_manager.py)."""

    @abstractmethod
    def import_kv(
        self,
        request_id: str,
        block_table: list[int],
        payload: Any,
        partition: int = 0,
        window_table: list[int] | None = None,
    ) -> Any:
        """Start writing a payload from `export_kv` (or a reference to it) into these blocks;
        returns a handle for `transfers_done` and then `finish_import` (None: already written).

        Raises KVLostError when the payload can no longer be read."""

    def discard_kv(self, payload: Any) -> None:
        """Release what a payload from `export_kv` holds (an exporter's shared-memory span)
        when it will not be imported: its request was aborted or ended at its first token."""

    def transfers_done(self, transfers: list[Any]) -> list[bool]:
        """Whether each export or import handle's copy has finished (without waiting)."""
        return [True] * len(transfers)

    def wait_for_transfers(self, transfers: list[Any], timeout_s: float) -> None:
        """Return when one of the copies has finished, or after timeout_s."""

    def finish_import(self, transfer: Any) -> None:
        """After `transfers_done`: raise KVLostError if the import found its payload gone."""

    @abstractmethod
    def free_requests(self, request_ids: list[str]) -> None:
        """Forget per-request state (sampling generators) of finished requests."""

    def drain_step_timelines(self) -> dict:
        """The last steps' timelines (see step_timeline.py), forgotten here: {"ranks": one list
        of step dicts per worker, "driver": one {"sent", "results"} per step where workers are
        called remotely, else []}."""
        return {"ranks": [], "driver": []}

    def start_profile(self, path: str) -> None:
        """Profile the steps from now on (see step_profiler.py); workers add `-rank<r>`."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile")

    def stop_profile(self) -> list[str]:
        """Stop profiling; returns the paths of the tables written."""
        raise NotImplementedError(f"{type(self).__name__} cannot profile")

    def shutdown(self) -> None:
        """Release devices and workers."""
