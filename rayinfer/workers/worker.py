"""A Ray actor on exactly one GPU (or the CPU) holding one ModelRunner.

KV hand-off (workers/handoff_io.py): `export_kv` and `import_kv` run on the actor's own KV
transfer thread (the `kv_io` concurrency group), beside `execute`, so a step never waits for a
copy. `export_kv` copies the KV into this worker's shared-memory arena (the payload names the
span) or puts it into the object store chunk by chunk from inside this actor, which owns those
objects (the payload holds the chunks' ObjectRefs: references, not copies). `import_kv` maps or
pulls them here; a payload whose owner died reads as lost (None). `close_kv_arena` unlinks the
arena before the group kills its workers.
"""

from __future__ import annotations

import logging
import os
import threading

import ray
import torch

from rayinfer.engine.batch import ModelBatch, SampledTokens
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.layers.parallel import SINGLE, LayerGroup, ParallelContext
from rayinfer.workers.gc_freeze import freeze_after_startup
from rayinfer.workers.gil_switch import set_switch_interval
from rayinfer.workers.handoff_io import HandoffIO, KVLost
from rayinfer.workers.kernel_compiles import CompileWatch
from rayinfer.workers.numa import bind_to_gpu_node
from rayinfer.workers.placement import WorkerPlacement
from rayinfer.workers.runner.kv_transfer import KVPayload
from rayinfer.workers.runner.step_profiler import StepProfiler
from rayinfer.workers.spec import WorkerSpec

logger = logging.getLogger(__name__)

KV_IO = "kv_io"  # the concurrency group (one thread) of the hand-off's copies
WATCH = "watch"  # the concurrency group (one thread) holding `wait_until_killed` open
# The calls made per step or per request keep no task events: the GCS holds ~3.5 KB for each call
# that does, up to Ray's 100,000-task cap, which is what grew under `python -m rayinfer.bench
# soak` (its steady phase's `gcs` RSS growth per minute).
HOT_PATH = {"enable_task_events": False}


class Worker:
    """Use through `WorkerGroup`, which wraps this class with `ray.remote` and names each actor."""

    def __init__(self, name: str, rank: int, world_size: int, spec: WorkerSpec):
        from rayinfer.engine.model_source import resolve_device, resolve_dtype
        from rayinfer.workers.runner.model_runner import ModelRunner

        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.spec = spec
        set_switch_interval(spec.process.gil_switch_interval_ms)
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        # Before weights and staging memory exist: their pages land on the GPU's NUMA node.
        self.compiles = CompileWatch()
        if self.device.type == "cuda":
            self.compiles.install()
        self.numa = None
        if self.device.type == "cuda":
            self.numa = bind_to_gpu_node(enabled=spec.process.numa_bind)
        self.placement = WorkerPlacement(rank, spec.plan)
        self.block_tables: dict[str, list[int]] = {}  # request id -> its whole table, as sent
        self.window_tables: dict[str, list[int]] = {}  # the same for window tables
        self.params: dict[str, SamplingParams] = {}  # request id -> its params, as first sent
        parallel = self._join_groups(name.rsplit("-r", 1)[0]) if world_size > 1 else SINGLE
        self.runner = ModelRunner(
            spec.model_config,
            spec.cache_config,
            self.device,
            self.dtype,
            parallel,
            spec.two_batch_overlap,
            spec.load_format,
            spec.cuda_graphs,
            spec.kv_memory,
            allocate_kv=False,
            fp8_weights=spec.fp8_weights,
            overlap=spec.overlap,
            kernels=spec.kernels,
        )
        is_cuda = self.device.type == "cuda"
        self.handoff = HandoffIO(is_cuda, spec.kv_handoff, spec.import_timeout_s)
        if self.runner.kv_memory is None:  # else the group sizes every worker's cache alike
            self.runner.allocate_kv(spec.cache_config.num_blocks)
            self._started()

    def _join_groups(self, prefix: str) -> ParallelContext:
        """Form this worker's tensor- and expert-parallel collective groups with its peers (every
        worker of the group runs this in its constructor, concurrently)."""
        import ray.util.collective as collective

        if self.spec.collective_backend == "rayinfer":
            import rayinfer.comm  # noqa: F401  (registers the backend)
        placement, plan = self.placement, self.spec.plan
        groups = {}
        for kind, group_name in placement.group_names(prefix).items():
            size, rank = (
                (plan.tp, placement.tp_rank) if kind == "tp" else (plan.ep, placement.ep_rank)
            )
            collective.init_collective_group(
                size, rank, backend=self.spec.collective_backend, group_name=group_name
            )
            handle = collective.get_group_handle(group_name)
            if self.spec.collective_backend == "rayinfer":
                handle.use_host_staged(self.spec.all_to_all.host)
            groups[kind] = LayerGroup(handle, rank, size, self.spec.all_to_all)
        return ParallelContext(
            tp_rank=placement.tp_rank,
            tp_size=plan.tp,
            ep_rank=placement.ep_rank,
            ep_size=plan.ep,
            tp_group=groups.get("tp"),
            ep_group=groups.get("ep"),
            tokens_differ_across_ep=placement.tokens_differ_across_ep,
        )

    def describe(self) -> dict:
        return {
            "name": self.name,
            "rank": self.rank,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "pid": os.getpid(),
            "decode_graphs": self.runner.captures_decode_graphs,
            "prefill_graph_sizes": self.runner.prefill_graph_sizes,
            "numa": None if self.numa is None else self.numa.reason,
            "kv_bytes_per_token": self.runner.kv_bytes_per_token,
        }

    @ray.method(**HOT_PATH)
    def execute(self, batch: ModelBatch) -> SampledTokens:
        self._complete_requests(batch)
        ending = [request for request in batch.requests if request.exports_kv]
        copies = self._start_layer_exports(ending) if ending else None
        if copies is None:
            return self.runner.execute(batch)
        try:
            return self.runner.execute(batch, on_layer_cached=copies.layer_cached)
        finally:
            copies.finish()

    def _start_layer_exports(self, ending: list):
        """The step's layer-by-layer exports (workers/runner/layer_export.py), or None; one
        that cannot start leaves the exports to copy after the step, never fails the step."""
        try:
            return self.handoff.start_layer_exports(self.runner.kv_cache, ending)
        except Exception:  # noqa: BLE001 - an optimization's failure: the usual way then
            logger.exception("layer exports not started; the exports copy after the step")
            self.handoff.drop_layer_exports([request.request_id for request in ending])
            return None

    def _complete_requests(self, batch: ModelBatch) -> None:
        """Each request's whole block table, from what earlier steps sent and this one's new
        blocks, and its SamplingParams where this step sent none (workers/step_wire.py)."""
        for request in batch.requests:
            if request.params is not None:
                self.params[request.request_id] = request.params
            elif (params := self.params.get(request.request_id)) is not None:
                request.params = params
            else:
                raise RuntimeError(f"request {request.request_id!r}: sent without its "
                                   "SamplingParams, which this worker does not hold")  # fmt: skip
            start = request.block_table_from
            if start == 0:
                self.block_tables[request.request_id] = request.block_table
                if request.window_table is not None:
                    self.window_tables[request.request_id] = request.window_table
                continue
            table = self.block_tables.get(request.request_id)
            if table is None or len(table) != start:
                raise RuntimeError(
                    f"request {request.request_id!r}: sent blocks from {start} on, but this "
                    f"worker holds {None if table is None else len(table)} of its table"
                )
            table.extend(request.block_table)
            request.block_table, request.block_table_from = table, 0
            if request.window_table is not None:
                # entries the engine released since are stale here: never read (a step reads
                # window state only within ModelConfig.window_span of its tokens)
                windows = self.window_tables[request.request_id]
                windows.extend(request.window_table)
                request.window_table = windows

    def drain_step_timelines(self) -> list[dict]:
        return self.runner.timelines.drain()

    def graph_capture_seconds(self) -> float | None:
        """Warm-up and capture of this worker's graphs; None without graphs."""
        return self.runner.graph_capture_seconds

    def kv_blocks_that_fit(self) -> int | None:
        """KV blocks this GPU can hold (a profiling step; the whole group runs it at once so
        that its collectives match); None when the cache is already allocated (no CUDA)."""
        if self.runner.kv_caches:
            return None
        return self.runner.kv_blocks_that_fit()

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks)
        self._started()

    def _started(self) -> None:
        """The last of its startup (the cache allocated, graphs captured)."""
        freeze_after_startup(self.device, self.spec.process.gc_freeze)
        self.compiles.serving = True  # kernels compiled from now on are logged

    def start_profile(self, path: str) -> None:
        self.profiler = StepProfiler(self.device, self.spec.process.profile_cpu)
        self.profiler.start(f"{path}-rank{self.rank}")

    def stop_profile(self) -> str:
        return self.profiler.stop()

    @ray.method(concurrency_group=KV_IO, **HOT_PATH)
    def export_kv(
        self,
        request_id: str,
        block_table: list[int],
        num_tokens: int,
        window_table: list[int] | None = None,
    ) -> KVPayload:
        """The request's KV copied out before this returns: into this worker's arena (the
        payload names the span) or into the object store (it holds the chunks' ObjectRefs)."""
        state = self.runner.sampler.generator_state(request_id)
        return self.handoff.export(
            self.runner.kv_cache, block_table, num_tokens, state, window_table, request_id
        )

    @ray.method(concurrency_group=KV_IO, **HOT_PATH)
    def import_kv(
        self,
        request_id: str,
        block_table: list[int],
        shards: list,
        release: bool = True,
        window_table: list[int] | None = None,
    ) -> dict | None:
        """Write this rank's part of a hand-off (from any prefill plan) into the cache: shards
        are per prefill worker an ObjectRef to (or a) KVPayload. Returns the timings in seconds
        ("get_s", "copy_s", "path", and the export's under "export"), or None when a payload it
        needs is gone. release: free the arena spans read (False: other ranks read them too,
        and the group discards them once all have ended)."""
        try:
            landed = self.handoff.import_(
                self.runner.kv_cache, block_table, shards, self._wants, release, window_table
            )
        except KVLost as lost:
            logger.warning("KV of %s cannot be read (%s)", request_id, lost)
            return None
        if landed.generator_state is not None:
            self.runner.sampler.restore_generator(request_id, landed.generator_state)
        return landed.timings

    @ray.method(concurrency_group=KV_IO, **HOT_PATH)
    def discard_kv(self, shards: list) -> None:
        """Release the arena spans of a hand-off that will not be imported, or that every
        holding rank has imported."""
        self.handoff.discard(shards)

    @ray.method(concurrency_group=KV_IO, **HOT_PATH)
    def kv_from_arena(self, header: KVPayload) -> KVPayload | None:
        """For an importer on another node: the KV of a span of this worker's arena, put into
        the object store (None: the span is no longer held)."""
        return self.handoff.kv_from_arena(header)

    @ray.method(concurrency_group=KV_IO, **HOT_PATH)
    def release_arena_span(self, span) -> None:
        self.handoff.release_own_span(span)

    @ray.method(concurrency_group=KV_IO)
    def close_kv_arena(self) -> None:
        """Unlink this worker's arena (after the exports before this call; at shutdown)."""
        self.handoff.close()

    @ray.method(concurrency_group=WATCH)
    def wait_until_killed(self) -> None:
        """Never returns: its caller learns of this actor's death when the call fails
        (workers/death_watch.py)."""
        threading.Event().wait()

    @ray.method(**HOT_PATH)
    def free_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.block_tables.pop(request_id, None)
            self.window_tables.pop(request_id, None)
            self.params.pop(request_id, None)
        self.handoff.drop_layer_exports(request_ids)
        self.runner.free_requests(request_ids)

    def _wants(self, payload: KVPayload) -> bool:
        return self._needs(payload.kv_heads)

    def _needs(self, shard_heads: tuple[int, int] | None) -> bool:
        mine = self.runner.kv_heads
        if shard_heads is None or mine is None:
            return True
        return shard_heads[0] < mine[0] + mine[1] and mine[0] < shard_heads[0] + shard_heads[1]
