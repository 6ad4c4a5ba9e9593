"""WorkerGroup: an Executor whose workers are Ray actors, one per GPU (or one on the CPU).

Inside a Serve replica the workers are scheduled into the replica's placement group: bundle 0 is
the replica itself, bundle 1 + rank is worker `rank` (see `placement_bundles`), so autoscaling
adds and removes whole groups. Each step runs SPMD on every worker. The spec's ParallelPlan
splits the model: each data-parallel replica (`tp` consecutive workers) holds its own KV cache (a
partition of the engine's, see `num_kv_partitions`) and runs the requests the engine placed in it;
the first worker of each replica reports that share's tokens. The workers form their tensor- and
expert-parallel collective groups themselves (see `Worker`).

With `spec.kv_memory` on GPUs (`gpu_memory_utilization`), every worker profiles how many KV blocks
its GPU holds and the group allocates the smallest count on all of them: the engine's block
managers use one block count for every partition (`num_kv_blocks`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayinfer import envs
from rayinfer.engine.batch import ModelBatch, SampledTokens, ScheduledRequest
from rayinfer.engine.executor import Executor, KVLostError
from rayinfer.layers.forward_context import IDLE_FORWARD_TOKENS
from rayinfer.workers.death_watch import DeathWatch, WorkerLost
from rayinfer.workers.export_holds import ExportHolds
from rayinfer.workers.placement import WorkerPlacement
from rayinfer.workers.runner.decode_graphs import shared_decode_bucket
from rayinfer.workers.runner.graph_buckets import graph_batch_sizes
from rayinfer.workers.runner.kv_transfer import KVPayload
from rayinfer.workers.runner.prefill_graphs import shared_prefill_bucket
from rayinfer.workers.runner.step_timeline import KEPT_STEPS
from rayinfer.workers.step_wire import SentState
from rayinfer.workers.worker import KV_IO, WATCH, Worker, WorkerSpec

REPLICA_CPUS = 0.1  # the Serve replica only drives the engine loop; workers do the math


def placement_bundles(
    num_workers: int,
    use_gpus: bool,
    cpus_per_worker: float,
    gpus_per_worker: float = 1.0,
    resources: dict[str, float] | None = None,
) -> list[dict]:
    """Bundle 0 for the replica actor, then one per worker: {"GPU": g, "CPU": 1} or {"CPU": c},
    plus the custom `resources` that pin the group to the nodes offering them."""
    worker = {"GPU": gpus_per_worker, "CPU": 1.0} if use_gpus else {"CPU": float(cpus_per_worker)}
    worker.update(resources or {})
    return [{"CPU": REPLICA_CPUS}] + [dict(worker) for _ in range(num_workers)]


@dataclass
class KVRefs:
    """A request's KV in the object store: per exporting worker (rank order) the ObjectRef of
    its `export_kv` call, which resolves to a KVPayload whose chunks that worker owns."""

    shards: list[ray.ObjectRef]
    num_bytes: int
    owners: list[str]  # the exporting workers' actor names


@dataclass
class PendingImport:
    """An import in flight: per holding worker the ObjectRef of its `import_kv` call."""

    request_id: str
    calls: list[ray.ObjectRef]
    owners: list[str]
    shards: list[ray.ObjectRef]  # the hand-off's: its arena spans are released once all land


@dataclass
class TransferStats:
    """Hand-off timings the group measured, drained by the replica into metrics."""

    import_seconds: dict[str, float] = field(default_factory=dict)  # request_id -> seconds
    # request_id -> the workers' copy timings (get_s, copy_s; the export's put_s, copy_s, ...)
    handoff_timings: dict[str, dict] = field(default_factory=dict)
    lost_request_ids: set[str] = field(default_factory=set)  # hand-offs whose KV was gone


class WorkerGroup(Executor):
    def __init__(
        self,
        name_prefix: str,
        spec: WorkerSpec,
        num_workers: int | None = None,
        use_gpus: bool = False,
        cpus_per_worker: float = 0.5,
        placement_group: PlacementGroup | None = None,
        gpus_per_worker: float = 1.0,
    ):
        num_workers = num_workers or spec.plan.num_workers
        if num_workers != spec.plan.num_workers:
            raise ValueError(
                f"num_workers={num_workers} but plan {spec.plan} needs {spec.plan.num_workers}"
            )
        self.name_prefix = name_prefix
        self.num_workers = num_workers
        self.plan = spec.plan
        self.kv_is_replicated = spec.model_config.kv_is_replicated  # every TP rank, one row
        self.placements = [WorkerPlacement(rank, spec.plan) for rank in range(num_workers)]
        self.stats = TransferStats()
        # this group's references to its hand-offs, until their importers are done with them
        self.export_holds = ExportHolds(spec.kv_handoff.lease_s, spec.kv_handoff.arena_bytes)
        self.gpus_per_worker = gpus_per_worker
        placement_group = placement_group or get_current_placement_group()
        self.worker_names = [f"{name_prefix}-r{rank}" for rank in range(num_workers)]
        self.workers = [
            self._start_worker(rank, spec, use_gpus, cpus_per_worker, placement_group)
            for rank in range(num_workers)
        ]
        self.descriptions = ray.get([w.describe.remote() for w in self.workers])
        self.graph_buckets = self._graph_buckets(spec)
        self.prefill_graph_sizes = self._prefill_graph_sizes()
        # steps run from decode graphs, from prefill graphs, or eagerly
        self.step_counts = {"graph": 0, "prefill_graph": 0, "eager": 0}
        self.step_calls: deque[dict] = deque(maxlen=KEPT_STEPS)  # when each step went and came
        self.sent = SentState()  # what the workers hold of each request (step_wire.py)
        self._num_kv_blocks = None
        self._death_watch: DeathWatch | None = None
        if spec.kv_memory is not None:
            self._num_kv_blocks = self._agree_on_kv_blocks(spec.cache_config.num_blocks)

    def _agree_on_kv_blocks(self, configured: int) -> int | None:
        """Profile every worker at once (a tp / ep step has collectives), then allocate the
        smallest count anywhere; None when the workers allocated the configured cache (no
        CUDA)."""
        counts = ray.get([worker.kv_blocks_that_fit.remote() for worker in self.workers])
        waiting = [worker for worker, count in zip(self.workers, counts) if count is not None]
        num_blocks = min(counts) if len(waiting) == len(counts) else None
        ray.get([worker.allocate_kv.remote(num_blocks or configured) for worker in waiting])
        return num_blocks

    @property
    def num_kv_blocks(self) -> int | None:
        return self._num_kv_blocks

    def _start_worker(self, rank, spec, use_gpus, cpus_per_worker, placement_group):
        options = {
            "name": self.worker_names[rank],
            "max_restarts": 0,
            "max_concurrency": 1,  # execute and the rest one at a time; hand-off copies beside
        }
        if use_gpus:
            options.update(num_gpus=self.gpus_per_worker, num_cpus=1)
        else:
            options.update(num_cpus=cpus_per_worker)
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=1 + rank
            )
        env_vars = envs.forwarded()  # the declared variables, as this process sees them
        if env_vars:
            options["runtime_env"] = {"env_vars": env_vars}
        actor_class = ray.remote(concurrency_groups={KV_IO: 1, WATCH: 1})(Worker)
        return actor_class.options(**options).remote(
            self.worker_names[rank], rank, self.num_workers, spec
        )

    def _graph_buckets(self, spec: WorkerSpec) -> tuple[list[int], int] | None:
        """(bucket sizes, table width in blocks) of the decode graphs every worker captured, when
        the workers talk during a forward: then this driver picks each step's bucket for all of
        them. None: no graphs, or workers that may each decide alone."""
        graphs = spec.cuda_graphs
        if graphs is None or not self.plan.has_collectives:
            return None
        if not all(d["decode_graphs"] for d in self.descriptions):
            return None
        width = graphs.table_width(spec.cache_config.block_size)
        return graph_batch_sizes(graphs.max_batch_size), width

    def _prefill_graph_sizes(self) -> list[int]:
        """Token buckets of the prefill graphs every worker captured, when the workers talk
        during a forward (this driver then picks each step's bucket); else []."""
        sizes = [d["prefill_graph_sizes"] for d in self.descriptions]
        if not self.plan.has_collectives or any(s != sizes[0] for s in sizes):
            return []
        return sizes[0]

    # --- Executor ----------------------------------------------------------------------------
    def execute(self, batch: ModelBatch) -> SampledTokens:
        shares: list[list[ScheduledRequest]] = [[] for _ in range(self.plan.dp)]
        for request in batch.requests:
            shares[request.kv_partition].append(request)
        bucket = prefill_bucket = None
        if self.graph_buckets is not None:
            bucket = shared_decode_bucket(shares, *self.graph_buckets)
        if bucket is None:
            prefill_bucket = shared_prefill_bucket(shares, self.prefill_graph_sizes)
        mode = "graph" if bucket else "prefill_graph" if prefill_bucket else "eager"
        self.step_counts[mode] += 1
        # Each replica's token count (an idle one runs a placeholder) for the token exchange.
        tokens = [
            max(sum(len(r.token_ids) for r in share), IDLE_FORWARD_TOKENS) for share in shares
        ]
        calls, sent = [], time.monotonic()
        wire = [self.sent.as_sent(replica, share) for replica, share in enumerate(shares)]
        for rank, (worker, placement) in enumerate(zip(self.workers, self.placements)):
            ep_tokens = None
            if placement.tokens_differ_across_ep:
                ep_tokens = [tokens[replica] for replica in placement.ep_peer_replicas]
            requests = self._exporting_here(rank, wire[placement.dp_rank])
            share = ModelBatch(requests, ep_tokens, bucket, prefill_bucket)
            calls.append(worker.execute.remote(share))
        leaders = [i for i, placement in enumerate(self.placements) if placement.is_dp_leader]
        results: list[SampledTokens] = ray.get(calls)
        self.step_calls.append({"sent": sent, "results": time.monotonic()})
        tokens_of, logprobs_of, prompt_logprobs, errors = {}, {}, {}, {}
        for rank in leaders:
            sampling = [r.request_id for r in shares[self.placements[rank].dp_rank] if r.samples]
            result = results[rank]
            tokens_of.update(zip(sampling, result.token_ids))
            if result.logprobs is not None:
                logprobs_of.update(zip(sampling, result.logprobs))
            prompt_logprobs.update(result.prompt_logprobs or {})
            errors.update(result.errors or {})
        order = [r.request_id for r in batch.requests if r.samples]
        tokens = [tokens_of[request_id] for request_id in order]
        logprobs = [logprobs_of.get(request_id) for request_id in order] if logprobs_of else None
        return SampledTokens(tokens, logprobs, prompt_logprobs or None, errors or None)

    @property
    def num_kv_partitions(self) -> int:
        return self.plan.dp

    @property
    def graph_capture_seconds(self) -> float | None:
        return ray.get(self.workers[0].graph_capture_seconds.remote())

    def export_kv(
        self,
        request_id: str,
        block_table: list[int],
        num_tokens: int,
        partition: int = 0,
        window_table: list[int] | None = None,
    ) -> KVRefs:
        """Starts the workers' exports (their KV transfer threads) and returns at once."""
        exporters = self._holders(partition)
        if self.kv_is_replicated:
            exporters = exporters[:1]
        shards = [
            self.workers[rank].export_kv.remote(request_id, block_table, num_tokens, window_table)
            for rank in exporters
        ]
        # a hand-off carries every layer's rows unpadded: the cache's bytes per token
        per_token = sum(self.descriptions[rank]["kv_bytes_per_token"] for rank in exporters)
        owners = [self.worker_names[rank] for rank in exporters]
        self.export_holds.drop_done()
        self.export_holds.hold(request_id, shards, per_token * num_tokens)
        return KVRefs(shards=shards, num_bytes=per_token * num_tokens, owners=owners)

    def import_kv(
        self,
        request_id: str,
        block_table: list[int],
        payload,
        partition: int = 0,
        window_table: list[int] | None = None,
    ) -> PendingImport:
        """`payload`: KVRefs from another group, or a KVPayload from an in-process engine.
        Starts the holders' imports (their KV transfer threads) and returns at once."""
        if isinstance(payload, KVPayload):
            payload = KVRefs([ray.put(payload)], payload.num_bytes, ["driver"])
        holders = self._holders(partition)
        # A lone holder frees the arena spans it read itself; several all read the same spans,
        # which `finish_import` frees once every one has ended.
        alone = len(holders) == 1
        calls = [
            self.workers[rank].import_kv.remote(
                request_id, block_table, payload.shards, alone, window_table
            )
            for rank in holders
        ]
        return PendingImport(request_id, calls, payload.owners, [] if alone else payload.shards)

    def discard_kv(self, payload) -> None:
        """Release what a hand-off holds that will not be imported (its arena spans)."""
        if isinstance(payload, KVRefs):
            self.workers[0].discard_kv.remote(payload.shards)

    def transfers_done(self, transfers: list) -> list[bool]:
        calls = [call for transfer in transfers for call in _calls_of(transfer)]
        if not calls:
            return [True] * len(transfers)
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=0, fetch_local=False)
        ready = set(ready)
        return [all(call in ready for call in _calls_of(t)) for t in transfers]

    def wait_for_transfers(self, transfers: list, timeout_s: float) -> None:
        calls = [call for transfer in transfers for call in _calls_of(transfer)]
        if calls:
            ray.wait(calls, num_returns=1, timeout=timeout_s, fetch_local=False)

    def finish_import(self, transfer: PendingImport) -> None:
        request_id = transfer.request_id
        if transfer.shards:  # every holder has ended: the spans they read may be reused
            self.workers[0].discard_kv.remote(transfer.shards)
        try:
            results = ray.get(transfer.calls)
        except REPLICA_WORKER_ERRORS as error:  # a holding worker died: the step will fail too
            raise KVLostError(f"request {request_id!r}: import failed ({error!r})") from None
        if not all(results):
            self.stats.lost_request_ids.add(request_id)
            raise KVLostError(
                f"request {request_id!r}: its KV is gone (owners {transfer.owners} died, or its "
                "object was evicted or its arena span reused); decode recomputes the prompt"
            )
        slowest = max(results, key=lambda timings: timings["get_s"] + timings["copy_s"])
        self.stats.import_seconds[request_id] = slowest["get_s"] + slowest["copy_s"]
        self.stats.handoff_timings[request_id] = slowest

    def _exporting_here(self, rank: int, requests: list[ScheduledRequest]) -> list:
        """A replica's requests for one of its workers: where every rank caches the same rows,
        only the first exports them (`export_kv`), so the others do not copy them out during
        the step either (workers/runner/layer_export.py)."""
        if not self.kv_is_replicated or not any(r.exports_kv for r in requests):
            return requests
        if self._holders(self.placements[rank].dp_rank)[0] == rank:
            return requests
        return [replace(r, exports_kv=False) if r.exports_kv else r for r in requests]

    def _holders(self, partition: int) -> list[int]:
        """Ranks of the workers caching a partition's KV (its DP replica's TP group)."""
        return [i for i, p in enumerate(self.placements) if p.dp_rank == partition]

    def free_requests(self, request_ids: list[str]) -> None:
        self.sent.forget(request_ids)
        self.export_holds.drop_done()
        for worker in self.workers:
            worker.free_requests.remote(request_ids)

    def drain_step_timelines(self) -> dict:
        ranks = ray.get([worker.drain_step_timelines.remote() for worker in self.workers])
        driver, self.step_calls = list(self.step_calls), deque(maxlen=KEPT_STEPS)
        return {"ranks": ranks, "driver": driver}

    def start_profile(self, path: str) -> None:
        ray.get([worker.start_profile.remote(path) for worker in self.workers])

    def stop_profile(self) -> list[str]:
        return ray.get([worker.stop_profile.remote() for worker in self.workers])

    def watch(self, on_lost: Callable[[WorkerLost], None]) -> None:
        """Call on_lost once, as soon as Ray reports any of this group's workers dead (a group
        missing a worker cannot step: every step runs on all of them)."""
        self._death_watch = DeathWatch(self.workers, self.worker_names, on_lost)

    @property
    def lost_worker(self) -> WorkerLost | None:
        """The first worker the watch saw die; None while all live (or nothing watches)."""
        return self._death_watch.lost if self._death_watch is not None else None

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Raise if any worker is dead or does not answer within timeout_s."""
        if self.lost_worker is not None:
            raise RuntimeError(self.lost_worker.describe())
        ray.get([worker.describe.remote() for worker in self.workers], timeout=timeout_s)

    def close_arenas(self, timeout_s: float = 10.0) -> None:
        """Unlink the workers' hand-off arenas (each after its exports in flight; later exports
        go through the object store). Killed workers unlink nothing: a worker that does not
        answer within timeout_s leaves its file to the next arena made on the node, which
        unlinks a dead owner's."""
        closing = [worker.close_kv_arena.remote() for worker in self.workers]
        ray.wait(closing, num_returns=len(closing), timeout=timeout_s, fetch_local=False)

    def shutdown(self) -> None:
        """Unlink the workers' arenas, then kill the workers."""
        if self._death_watch is not None:
            self._death_watch.close()
        self.export_holds.clear()
        self.close_arenas()
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


REPLICA_WORKER_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError)


def _calls_of(transfer) -> list[ray.ObjectRef]:
    """The pending calls behind an export (KVRefs) or import (PendingImport) handle."""
    if isinstance(transfer, KVRefs):
        return transfer.shards
    if isinstance(transfer, PendingImport):
        return transfer.calls
    return []
