"""The "rayinfer" collective group: ray.util.collective's collectives over torch.distributed
(NCCL on GPU, gloo on CPU), plus a bandwidth-aware all-to-all and MoE dispatch/combine."""

import datetime
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.distributed as dist
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import ReduceOp

from rayinfer.comm import moe
from rayinfer.comm.cost_model import Choice, choose
from rayinfer.comm.host_staged import HostStagedTransport
from rayinfer.comm.layout import as_byte_rows, check_splits
from rayinfer.comm.metrics import AllToAllRecorder
from rayinfer.comm.pending import Pending
from rayinfer.comm.rendezvous import forget_store, make_store
from rayinfer.comm.schedules import ScheduleContext, get_schedule
from rayinfer.comm.topology import Topology
from rayinfer.comm.transport import DistTransport, Transport
from rayinfer.exchange_config import HostStagedConfig

BACKEND_NAME = "RAYINFER"
# Size classes (see RayinferGroup.plan) checked for a plan that does not depend on size: class c
# is 2 ** (c / 2) bytes per pair, so 0..88 covers 1 byte to 16 TiB per pair.
_SIZE_CLASSES = range(89)
_UNKNOWN = object()
_NO_PLAN = -1  # _choices key for the caller's own (schedule, transport)
_REDUCE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


class RayinferGroup(BaseGroup):
    def __init__(
        self, world_size: int, rank: int, group_name: str, store: dist.Store | None = None
    ):
        super().__init__(world_size, rank, group_name)
        self.device = _device()
        joined_through_ray = store is None
        store = store or make_store(group_name, rank, world_size)
        self.store = dist.PrefixStore(f"rayinfer/{group_name}", store)
        self.pg = _process_group(self.store, rank, world_size, self.device)
        self.barrier()
        if joined_through_ray and rank == 0:
            forget_store(group_name)
        self._plans: dict[int, Choice] = {}
        self._choices: dict[tuple, Choice] = {}  # (id(plan) or _NO_PLAN, schedule, transport)
        self._keyed_plans: list[Choice] = []  # alive while keyed by id in _choices
        self._size_free_plan: Choice | None | object = _UNKNOWN
        # by (transport, channel), without split matrix
        self._contexts: dict[tuple[str, int], ScheduleContext] = {}
        self._metrics = AllToAllRecorder(group_name)
        self._key_counts: dict[str, int] = {}
        self.topology = Topology.uniform(world_size, is_cuda=self.device.type == "cuda")
        self._transports: dict[str, Transport] = {"dist": DistTransport(self.pg, rank, world_size)}
        self.host_staged = HostStagedConfig()  # the host transport's settings (use_host_staged)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"rayinfer-comm-{group_name}")
        self._last: Pending | None = None
        self._a2a_options = dist.AllToAllOptions()
        self._background = threading.local()  # .active is set on the executor's thread

    @classmethod
    def backend(cls):
        return BACKEND_NAME

    @classmethod
    def check_backend_availability(cls) -> bool:
        return dist.is_available()

    def destroy_group(self):
        self._executor.shutdown(wait=True)
        self._metrics.flush()
        for t in self._transports.values():
            t.close()
        if hasattr(self.pg, "shutdown"):
            self.pg.shutdown()

    # --- standard collectives (ray.util.collective passes tensors wrapped in lists) ---
    def allreduce(self, tensor, allreduce_options=None):
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(allreduce_options)
        self.pg.allreduce([_one(tensor)], opts).wait()

    def barrier(self, barrier_options=None):
        probe = torch.zeros(1, device=self.device)
        self.pg.allreduce([probe]).wait()

    def reduce(self, tensor, reduce_options=None):
        opts = dist.ReduceOptions()
        opts.reduceOp = _reduce_op(reduce_options)
        opts.rootRank = getattr(reduce_options, "root_rank", 0)
        t = _one(tensor)
        target = t if self.rank == opts.rootRank else t.clone()
        self.pg.reduce([target], opts).wait()

    def allgather(self, tensor_list, tensor, allgather_options=None):
        outs = tensor_list[0] if isinstance(tensor_list[0], list) else tensor_list
        self.pg.allgather([outs], [_one(tensor)]).wait()

    def broadcast(self, tensor, broadcast_options=None):
        opts = dist.BroadcastOptions()
        opts.rootRank = getattr(broadcast_options, "root_rank", 0)
        self.pg.broadcast([_one(tensor)], opts).wait()

    def reducescatter(self, tensor, tensor_list, reducescatter_options=None):
        out = _one(tensor)
        parts = tensor_list[0] if isinstance(tensor_list[0], list) else tensor_list
        flat = torch.stack([p.reshape(out.shape) for p in parts])  # [world, *shape]
        opts = dist.AllreduceOptions()
        opts.reduceOp = _reduce_op(reducescatter_options)
        self.pg.allreduce([flat], opts).wait()  # gloo has no reduce_scatter; bytes are small here
        out.copy_(flat[self.rank])

    def send(self, tensor, send_options):
        self.pg.send([_one(tensor)], send_options.dst_rank, 0).wait()

    def recv(self, tensor, recv_options):
        self.pg.recv([_one(tensor)], recv_options.src_rank, 0).wait()

    # --- all-to-all ---
    def all_to_all(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        schedule: str = "auto",
        transport: str = "auto",
        split_matrix: list[list[int]] | None = None,
        channel: int = 0,
    ) -> Choice:
        """out: [sum(out_splits), ...] any dtype: filled with rows from each rank, in rank order.
        inp: [sum(in_splits), ...] same dtype: in_splits[d] rows for rank d, in rank order.
        Zero splits are allowed. schedule: "auto", "nccl", "pairwise" or "hierarchical";
        transport: "auto", "dist" or "host". split_matrix: [world][world] rows i -> j, if the
        caller already has it; "auto" and "hierarchical" otherwise all-gather it (every rank
        must decide alike), unless the topology makes `auto`'s pick the same at every size.
        channel: the host transport keeps one independent pipeline (copy streams, staging slots,
        flags) per channel, so exchanges queued on different channels do not wait for each
        other in first-in-first-out streams (two-batch overlap gives each micro-batch its own);
        NCCL runs every channel on its one stream. Returns the (schedule, transport) used and
        why."""
        if self._last is not None:
            self._drain()  # calls run in issue order (a no-op on the background thread itself)
        # Every call pays this Python (~1 us per simple call on the GPU VM), so the common case
        # is kept to builtins on plain ints: no tensor views, no per-call objects.
        n, rows = self.world_size, inp.shape[0]
        if (
            len(out_splits) != n
            or len(in_splits) != n
            or sum(out_splits) != out.shape[0]
            or sum(in_splits) != rows
            or min(out_splits) < 0
            or min(in_splits) < 0
        ):
            check_splits(out.shape[0], out_splits, n, "out_splits")  # raises, saying what is wrong
            check_splits(rows, in_splits, n, "in_splits")
        if schedule == "auto" or transport == "auto":
            plan = self._size_free_plan
            if plan is _UNKNOWN:
                plan = self.size_free_plan()
            if plan is None:
                if split_matrix is None:
                    split_matrix = self.gather_split_matrix(in_splits)
                plan = self.plan(split_matrix, inp.nbytes // rows if rows else 0)
            choice = self._choices.get((id(plan), schedule, transport))
        else:
            plan = None
            choice = self._choices.get((_NO_PLAN, schedule, transport))
        if choice is None:
            choice = self._choice(plan, schedule, transport)
        if choice.schedule == "nccl" and choice.transport == "dist" and out.dtype == inp.dtype:
            # NCCL's own all_to_all_single on the caller's tensors: nothing added
            if not self._metrics.enabled or (
                out.is_cuda and torch.cuda.is_current_stream_capturing()
            ):
                # (a graph's capture only records the call: it takes no time worth a sample)
                self.pg.alltoall_base(out, inp, out_splits, in_splits, self._a2a_options).wait()
                return choice
            start = time.perf_counter()
            self.pg.alltoall_base(out, inp, out_splits, in_splits, self._a2a_options).wait()
            seconds = time.perf_counter() - start
            num_bytes = (inp.nbytes // rows) * (rows - in_splits[self.rank]) if rows else 0
            self._metrics.record("nccl", "dist", num_bytes, seconds)
            return choice
        return self._run_schedule(choice, out, inp, out_splits, in_splits, split_matrix, channel)

    def all_to_all_async(self, out, inp, out_splits, in_splits, **kw) -> Pending[Choice]:
        """As all_to_all, in the background; `out` is valid after `wait()`."""
        return self._submit(self.all_to_all, out, inp, out_splits, in_splits, **kw)

    @property
    def topology(self) -> Topology:
        """What `auto` plans on: a uniform placeholder until set (e.g. from probe.probe)."""
        return self._topology

    @topology.setter
    def topology(self, topology: Topology) -> None:
        self._topology = topology
        self._plans.clear()
        self._choices.clear()
        self._keyed_plans.clear()
        self._contexts.clear()
        self._size_free_plan = _UNKNOWN

    def plan(self, split_matrix: list[list[int]], row_bytes: int) -> Choice:
        """The (schedule, transport) `auto` picks for this exchange on this group's topology.

        Planned once per size class (mean bytes per pair in steps of sqrt(2)) on a uniform
        exchange of that size, and remembered: running the model on every call cost ~100 us
        of Python. Every rank holds the same matrix, so every rank picks the same plan."""
        n = self.world_size
        to_others = sum(map(sum, split_matrix)) - sum(split_matrix[i][i] for i in range(n))
        pair_rows = to_others / max(n * n - n, 1)
        return self._plan_for_class(round(2 * math.log2(max(pair_rows * row_bytes, 1.0))))

    def _plan_for_class(self, size_class: int) -> Choice:
        if size_class not in self._plans:
            n, pair_bytes = self.world_size, int(2 ** (size_class / 2))
            self._plans[size_class] = choose(self.topology, [[pair_bytes] * n] * n, 1)
        return self._plans[size_class]

    def size_free_plan(self) -> Choice | None:
        """`auto`'s pick when this topology makes it the same at every size (e.g. NVLink:
        always nccl/dist), else None. Then `auto` needs no split matrix, so no all-gather: the
        pick depends only on the topology, which every rank holds alike, so every rank still
        decides alike whatever its own splits. Worked out once per topology (all size classes
        planned: ~2 ms for 2 ranks, ~60 ms for 8)."""
        if self._size_free_plan is _UNKNOWN:
            picks = {(p.schedule, p.transport) for p in map(self._plan_for_class, _SIZE_CLASSES)}
            if len(picks) == 1:
                schedule, transport = picks.pop()
                reason = f"{schedule}/{transport} predicted fastest at every size on this topology"
                self._size_free_plan = Choice(schedule, transport, {}, reason)
            else:
                self._size_free_plan = None
        return self._size_free_plan

    def gather_split_matrix(self, in_splits: list[int] | torch.Tensor) -> list[list[int]]:
        """in_splits: [world] int (list, or a tensor on this group's device, which saves a
        device sync) -> [world][world]: rows rank i sends to rank j, for every i."""
        mine = torch.as_tensor(in_splits, dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.pg.allgather([rows], [mine]).wait()
        return torch.stack(rows).tolist()  # one device sync for the whole matrix

    # --- MoE ---
    def dispatch(self, x, topk_ids, topk_weights, *, num_experts: int, use_fp8=False, **kw):
        """See rayinfer.comm.moe.dispatch; returns a DispatchResult."""
        self._drain()
        return moe.dispatch(self, x, topk_ids, topk_weights, num_experts, use_fp8, **kw)

    def dispatch_async(self, x, topk_ids, topk_weights, *, num_experts: int, use_fp8=False, **kw):
        return self._submit(
            moe.dispatch, self, x, topk_ids, topk_weights, num_experts, use_fp8, **kw
        )

    def combine(self, expert_out, handle, **kw):
        """See rayinfer.comm.moe.combine; returns [T, H]."""
        self._drain()
        return moe.combine(self, expert_out, handle, **kw)

    def combine_async(self, expert_out, handle, **kw):
        return self._submit(moe.combine, self, expert_out, handle, **kw)

    def next_key(self, prefix: str) -> str:
        """A store key unique to this call: every rank makes the same calls in the same order,
        so every rank gets the same key, and no rank can read a value left by an earlier call."""
        self._key_counts[prefix] = self._key_counts.get(prefix, 0) + 1
        return f"{prefix}-{self._key_counts[prefix]}"

    def use_host_staged(self, config: HostStagedConfig) -> None:
        """The settings of the host-staged transports (channels) this group makes from now on
        (those made already keep theirs); every rank must pass the same ones."""
        self.host_staged = config

    def transport(self, name: str, channel: int = 0) -> Transport:
        """The transport `name` of `channel` (host: one pipeline per channel, made on first use;
        every rank makes its channels in the same order of calls, so their keys match)."""
        if name == "dist":
            return self._transports["dist"]
        key = name if channel == 0 else f"{name}#{channel}"
        if key not in self._transports:
            if name != "host":
                raise ValueError(f"unknown transport {name!r}; use 'dist', 'host' or 'auto'")
            if channel < 0:
                raise ValueError(f"channel={channel} must be 0 or more")
            store = dist.PrefixStore(self.next_key("host"), self.store)
            host = self.host_staged
            self._transports[key] = HostStagedTransport(
                store, self.rank, self.world_size, self.device, protocol=host.protocol,
                direct_max_bytes=host.direct_max_bytes,
                chunk_overhead_bytes=host.chunk_overhead_bytes,
            )  # fmt: skip
        return self._transports[key]

    def _run_schedule(self, choice, out, inp, out_splits, in_splits, matrix, channel=0):
        rows = inp.shape[0]
        num_bytes = (inp.nbytes // rows) * (rows - in_splits[self.rank]) if rows else 0
        chosen = get_schedule(choice.schedule)
        ctx = self._contexts.get((choice.transport, channel))
        if ctx is None:
            transport = self.transport(choice.transport, channel)
            ctx = ScheduleContext(self.rank, self.world_size, transport, self.topology.islands)
            self._contexts[(choice.transport, channel)] = ctx
        if chosen.needs_split_matrix:
            if matrix is None:
                matrix = self.gather_split_matrix(in_splits)
            ctx = replace(ctx, split_matrix=matrix)
        out_rows, in_rows = as_byte_rows(out), as_byte_rows(inp)
        start = time.perf_counter()
        chosen.run(ctx, out_rows, in_rows, out_splits, in_splits)
        # (a graph's capture only records the exchange: it takes no time worth a sample)
        if self._metrics.enabled and not (out.is_cuda and torch.cuda.is_current_stream_capturing()):
            seconds = time.perf_counter() - start
            self._metrics.record(choice.schedule, choice.transport, num_bytes, seconds)
        return choice

    def _choice(self, plan: Choice | None, schedule: str, transport: str) -> Choice:
        """The Choice returned for (plan, caller's names), made once: plan None is the caller's
        own pick; else the plan with the caller's explicit names applied."""
        key = (_NO_PLAN if plan is None else id(plan), schedule, transport)
        choice = self._choices.get(key)
        if choice is None:
            if plan is None:
                choice = Choice(schedule, transport, {}, "chosen by the caller")
            else:
                choice = plan.override(schedule, transport)
                self._keyed_plans.append(plan)  # so that its id is not reused while keyed
            self._choices[key] = choice
        return choice

    def _submit(self, fn, *args, **kw) -> Pending:
        stream = torch.cuda.current_stream() if self.device.type == "cuda" else None

        def run():
            self._background.active = True
            if stream is None:
                return fn(*args, **kw)
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
            with torch.cuda.stream(stream):
                return fn(*args, **kw)

        self._last = Pending(self._executor.submit(run))
        return self._last

    def _drain(self) -> None:
        """Calls run in issue order: wait for the background exchange before a blocking one."""
        if self._last is not None and not getattr(self._background, "active", False):
            self._last.wait()
            self._last = None


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _process_group(store, rank: int, world_size: int, device: torch.device) -> dist.ProcessGroup:
    timeout = datetime.timedelta(seconds=120)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, opts)
    return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, timeout)


def _one(tensor) -> torch.Tensor:
    """ray.util.collective wraps single tensors in a list; accept either form."""
    t = tensor[0] if isinstance(tensor, list) else tensor
    return torch.as_tensor(t)


def _reduce_op(options) -> dist.ReduceOp:
    return _REDUCE_OPS[getattr(options, "reduceOp", ReduceOp.SUM)]
