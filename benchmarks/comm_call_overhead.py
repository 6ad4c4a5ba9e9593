"""Python overhead of one RayinferGroup.all_to_all call, apart from the exchange itself (issue 4).

The process group and (for the schedule layer) the transport are stubs that return at once, so
what is timed is only the Python around the call: argument checks, planning, metrics, views,
schedule objects. Stubs: a benchmark of wrapper overhead, never a test of correctness (tests/comm
checks the real exchanges).

    python benchmarks/comm_call_overhead.py [--tokens 128 --hidden 7168 --json out.json]

Modes, each in a fresh process (Ray's metrics are set up once per process):
  stub       world size 2 (rank 0) with a stub process group: raw alltoall_base against the
             group's nccl/dist, auto with and without the split matrix, and the schedule layer
             (nccl/host, pairwise/host) over a transport that returns at once.
  stub+ray   the same with ray.init() active, so every call also records its metrics; plus
             what one Counter.inc + Histogram.observe costs.
  host2      two processes, the real host-staged transport through shared memory: the group's
             nccl/host call against the bare transport exchange of the same blocks.
  flag-sim   the GPU-driven host protocol (flag_pipeline.py) queueing one exchange (one block
             each way, 2 ranks) on the stream simulator of tests/comm/test_flag_pipeline.py:
             the pipeline's own Python, without the driver calls a GPU adds.
Tensors are on CUDA where available (run it on the GPU machine as is), else on CPU.
Each number: the median over batches of the mean per call within a batch (perf_counter_ns).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

# This checkout's rayinfer, after any PYTHONPATH entries (a copy of older code to compare with).
_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
sys.path.insert(1 + len(_PYTHONPATH), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("stub", "stub+ray", "host2", "flag-sim")


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("all", *MODES), default="all")
    p.add_argument("--tokens", type=int, default=128, help="rows per rank")
    p.add_argument("--hidden", type=int, default=7168, help="bf16 elements per row")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--batch", type=int, default=50, help="calls per timed batch")
    p.add_argument("--host-tokens", type=int, default=8, help="rows per rank, host2 mode")
    p.add_argument("--host-iters", type=int, default=400, help="timed calls, host2 mode")
    p.add_argument("--json", default=None, help="write the rows here")
    return p.parse_args(argv)


def per_call_us(fn, batches: int, batch: int, warmup: int = 200) -> float:
    for _ in range(warmup):
        fn()
    means = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        means.append((time.perf_counter_ns() - t0) / batch)
    return statistics.median(means) / 1e3


# --- stubs -------------------------------------------------------------------------------------
class DoneWork:
    """An already-completed torch.distributed work."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = DoneWork()


class StubProcessGroup:
    """Rank 0 of `world_size`: every collective returns at once; allgather hands back this
    rank's tensor as every rank's (the benchmark's exchanges are symmetric)."""

    def __init__(self, world_size: int):
        self._world_size = world_size

    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return 0

    def name(self) -> str:
        return "stub"

    def allreduce(self, tensors, opts=None):
        return _DONE

    def allgather(self, outs, ins):
        for o in outs[0]:
            o.copy_(ins[0])
        return _DONE

    def alltoall_base(self, out, inp, out_splits, in_splits, opts=None):
        return _DONE


def make_stub_group(world_size: int, device: torch.device):
    import rayinfer.comm.group as group_mod
    from rayinfer.comm.transport import Transport

    class NullTransport(Transport):
        name = "null"

        def exchange(self, sends, recvs) -> None:
            pass

    group_mod._process_group = lambda store, rank, n, dev: StubProcessGroup(n)
    group = group_mod.RayinferGroup(
        world_size, 0, "rayinfer-decode-bench-ep0", store=dist.HashStore()
    )
    group._transports["host"] = NullTransport(0, world_size)
    return group


# --- modes -------------------------------------------------------------------------------------
def run_stub(args, with_ray: bool) -> list[dict]:
    if with_ray:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    n = 2
    group = make_stub_group(n, device)
    share = [args.tokens // n] * n
    matrix = [share] * n
    inp = torch.randn(args.tokens, args.hidden, device=device).to(torch.bfloat16)
    out = torch.empty_like(inp)
    pg = group.pg
    from rayinfer.comm.transport import Transfer

    rows_u8, outs_u8 = inp.view(torch.uint8), out.view(torch.uint8)
    half = rows_u8.shape[0] // 2
    sends = [Transfer(1, rows_u8[half:].reshape(-1))]
    recvs = [Transfer(1, outs_u8[half:].reshape(-1))]
    null = group._transports["host"]

    cases = {
        "raw pg.alltoall_base": lambda: pg.alltoall_base(
            out, inp, share, share, dist.AllToAllOptions()
        ).wait(),
        "group nccl/dist": lambda: group.all_to_all(out, inp, share, share, "nccl", "dist", matrix),
        "group auto, matrix": lambda: group.all_to_all(
            out, inp, share, share, "auto", "auto", matrix
        ),
        "group auto, no matrix": lambda: group.all_to_all(out, inp, share, share),
        "bare null exchange": lambda: null.exchange(sends, recvs),
        "self-block copy alone": lambda: out[:half].copy_(inp[:half]),
        "group nccl/null-host": lambda: group.all_to_all(
            out, inp, share, share, "nccl", "host", matrix
        ),
        "group pairwise/null-host": lambda: group.all_to_all(
            out, inp, share, share, "pairwise", "host", matrix
        ),
    }
    mode = "stub+ray" if with_ray else "stub"
    results = [
        dict(mode=mode, case=name, us=per_call_us(fn, args.batches, args.batch))
        for name, fn in cases.items()
    ]
    if with_ray:
        results += _ray_metric_costs(args)
    group.destroy_group()
    if with_ray:
        import ray

        ray.shutdown()
    return results


def _ray_metric_costs(args) -> list[dict]:
    from ray.util.metrics import Counter, Histogram

    tags = {"phase": "decode", "schedule": "nccl", "transport": "dist"}
    keys = tuple(tags)
    counter = Counter("rayinfer_bench_overhead_bytes", tag_keys=keys)
    hist = Histogram(
        "rayinfer_bench_overhead_seconds", boundaries=[1e-5, 1e-4, 1e-3], tag_keys=keys
    )
    cases = {
        "Counter.inc": lambda: counter.inc(1024, tags=tags),
        "Histogram.observe": lambda: hist.observe(1e-4, tags=tags),
    }
    return [
        dict(mode="stub+ray", case=name, us=per_call_us(fn, args.batches, args.batch))
        for name, fn in cases.items()
    ]


def run_host2(args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        mp.spawn(_host2_worker, args=(args, os.path.join(tmp, "store"), path), nprocs=2)
        with open(path) as f:
            return json.load(f)


def _host2_worker(rank: int, args, store_path: str, path: str) -> None:
    from rayinfer.comm import RayinferGroup
    from rayinfer.comm.transport import Transfer

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    store = dist.FileStore(store_path, 2)
    store.set_timeout(datetime.timedelta(seconds=60))
    group = RayinferGroup(2, rank, "rayinfer-decode-bench-ep0", store=store)
    share = [args.host_tokens // 2] * 2
    matrix = [share] * 2
    inp = torch.randn(args.host_tokens, args.hidden, device=device).to(torch.bfloat16)
    out = torch.empty_like(inp)
    transport = group.transport("host")
    peer, half = 1 - rank, args.host_tokens // 2
    rows_u8, outs_u8 = inp.view(torch.uint8), out.view(torch.uint8)
    sends = [Transfer(peer, rows_u8[peer * half : (peer + 1) * half].reshape(-1))]
    recvs = [Transfer(peer, outs_u8[peer * half : (peer + 1) * half].reshape(-1))]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    cases = {
        "bare host exchange": lambda: transport.exchange(sends, recvs),
        "group nccl/host": lambda: group.all_to_all(out, inp, share, share, "nccl", "host", matrix),
        "group pairwise/host": lambda: group.all_to_all(
            out, inp, share, share, "pairwise", "host", matrix
        ),
    }
    rows = []
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        sync()
        group.barrier()
        times = []
        for _ in range(args.host_iters):
            t0 = time.perf_counter_ns()
            fn()
            sync()
            times.append(time.perf_counter_ns() - t0)
        rows.append(dict(mode="host2", case=name, us=statistics.median(times) / 1e3))
    group.barrier()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)
    group.destroy_group()


def run_flag_sim(args) -> list[dict]:
    import random

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.append(os.path.join(root, "tests", "comm"))
    from test_flag_pipeline import make_pipelines, run_all

    from rayinfer.comm.transport import Transfer

    pipes, gpus = make_pipelines(2, slot_bytes=8 << 20, num_slots=8)
    block = args.tokens // 2 * args.hidden * 2
    bufs = [(torch.ones(block, dtype=torch.uint8), torch.empty(block, dtype=torch.uint8))] * 2
    rng = random.Random(0)

    def one() -> float:
        queued = 0
        for me, pipe in enumerate(pipes):
            send, recv = bufs[me]
            t0 = time.perf_counter_ns()
            pipe.exchange([Transfer(1 - me, send)], [Transfer(1 - me, recv)])
            queued += time.perf_counter_ns() - t0
        run_all(gpus, rng)  # the simulated streams run the queued copies and flags
        return queued / 2

    for _ in range(50):
        one()
    times = [one() for _ in range(args.batches * 10)]
    return [dict(mode="flag-sim", case="queue one exchange", us=statistics.median(times) / 1e3)]


def format_rows(rows: list[dict]) -> str:
    lines = ["| mode | case | us per call |", "|---|---|---|"]
    lines += [f"| {r['mode']} | {r['case']} | {r['us']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.mode == "all":
        rows = []
        for mode in MODES:
            cmd = [sys.executable, __file__, "--mode", mode, "--json", "-"]
            cmd += [
                f"--{k.replace('_', '-')}={v}"
                for k, v in vars(args).items()
                if k not in ("mode", "json")
            ]
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
            rows += json.loads(proc.stdout.strip().splitlines()[-1])
    elif args.mode == "host2":
        rows = run_host2(args)
    elif args.mode == "flag-sim":
        rows = run_flag_sim(args)
    else:
        rows = run_stub(args, with_ray=args.mode == "stub+ray")
    if args.json == "-":
        print(json.dumps(rows))
        return 0
    device = "cuda" if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    print(f"tokens {args.tokens} x hidden {args.hidden} bf16, world size 2, {device}")
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
