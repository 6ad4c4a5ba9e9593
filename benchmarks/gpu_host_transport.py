"""The host-staged transport on real GPUs (2 ranks, one process each), eager and in CUDA graphs:

1. stress: 200 all_to_all calls with random uneven splits (the same on every rank), hidden 7168
   bf16, blocks from 0 to ~8 MB, through "host-mbox" (the mailbox kernel for blocks <= 4 MiB,
   the copy pipeline beyond: both mix within calls), queued back to back with no sync between
   them; every output checked after.
2. graphs: all_to_all captured in CUDA graphs, replayed with new inputs each time, for "host"
   (the two-state copy pipeline) at 256 and 2,048 tokens (blocks of 4 and 15 chunks through an
   8-slot ring) and "host-mbox" at 256; every replay checked.
3. latency, eager: median wall time (slowest rank, CUDA synchronized, after a barrier) of one
   exchange at 128 tokens per rank: "host", "host-mbox", NCCL.
4. latency, replayed: a graph of 10 exchanges back to back per transport and size, replayed
   20 times; the median replay's CUDA-event time / 10 (what a decode step's graph pays).

    NCCL_P2P_DISABLE=1 python benchmarks/gpu_host_transport.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN = 7168
# chunk fixed costs (bytes of link time) swept for the replayed copy pipeline: chunk ~
# sqrt(block x this), so a 0.9 MB block goes in 11, 6 or 3 chunks (the default, 512 KiB: 2)
REPLAY_CHUNKINGS = (8 << 10, 32 << 10, 128 << 10)


def _group(rank: int, port: int):
    from rayinfer.comm import RayinferGroup
    from rayinfer.comm.host_staged import HostStagedTransport

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=120))
    group = RayinferGroup(2, rank, "mailbox", store=store)
    group.transport("host")
    mailbox_store = dist.PrefixStore(group.next_key("host-mbox"), group.store)
    group._transports["host-mbox"] = HostStagedTransport(
        mailbox_store, rank, 2, group.device, direct_max_bytes=4 << 20
    )
    for overhead in REPLAY_CHUNKINGS:  # the replayed pipeline's chunking, swept
        name = f"host-r{overhead >> 10}k"
        chunked_store = dist.PrefixStore(group.next_key(name), group.store)
        group._transports[name] = HostStagedTransport(
            chunked_store, rank, 2, group.device, replay_overhead_bytes=overhead
        )
    return group


def stress(group, calls: int = 200) -> dict:
    from rayinfer.comm.refs import all_to_all_ref

    me, dev = group.rank, group.device
    gen = torch.Generator().manual_seed(5)
    pending = []
    launches_before = group.transport("host-mbox").mailboxes.launches
    for _ in range(calls):
        matrix = torch.randint(0, 300, (2, 2), generator=gen)
        matrix[torch.rand(2, 2, generator=gen) < 0.2] = 0
        matrix = matrix.tolist()
        inputs = [torch.randn(sum(row), HIDDEN, generator=gen).bfloat16() for row in matrix]
        out = torch.empty(sum(r[me] for r in matrix), HIDDEN, device=dev, dtype=torch.bfloat16)
        inp = inputs[me].to(dev, non_blocking=False)
        group.all_to_all(out, inp, [r[me] for r in matrix], matrix[me], "nccl", "host-mbox")
        pending.append((out, all_to_all_ref(inputs, matrix)[me], inp))
    torch.cuda.synchronize()
    wrong = sum(not torch.equal(out.cpu(), expected) for out, expected, _ in pending)
    launches = group.transport("host-mbox").mailboxes.launches - launches_before
    return dict(calls=calls, wrong=wrong, mailbox_launches=launches)


def _capture(group, out, inp, split, transport: str, calls: int = 1):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the graph (compiles, plans)
            group.all_to_all(out, inp, split, split, "nccl", transport)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    group.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            group.all_to_all(out, inp, split, split, "nccl", transport)
    torch.cuda.synchronize()
    group.barrier()
    return graph


def graphs(group, transport: str, tokens: int, replays: int = 30) -> dict:
    me, dev = group.rank, group.device
    split = [tokens // 2, tokens // 2]
    inp = torch.zeros(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
    out = torch.zeros_like(inp)
    graph = _capture(group, out, inp, split, transport)
    wrong = 0
    for i in range(replays):
        values = [torch.full((tokens, HIDDEN), float(r * 1000 + i), device=dev) for r in range(2)]
        inp.copy_(values[me])
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.cat([values[r][me * split[0] : (me + 1) * split[0]] for r in range(2)])
        wrong += not torch.equal(out, expected.bfloat16())
    return dict(transport=transport, tokens=tokens, replays=replays, wrong=wrong)


def latency(group, tokens: int = 128, iters: int = 50) -> dict:
    """Eager: the host copy pipeline, the mailbox, NCCL."""
    from rayinfer.comm.probe import median_time

    share = [tokens // 2] * 2
    inp = torch.randn(tokens, HIDDEN, device=group.device, dtype=torch.bfloat16)
    out = torch.empty_like(inp)
    result = dict(tokens=tokens)
    for transport in ("host", "host-mbox", "dist"):

        def call(transport=transport):
            group.all_to_all(out, inp, share, share, "nccl", transport)

        result[f"{transport}_us"] = median_time(group, call, iters, warmup=3) * 1e6
    return result


def replayed_latency(group, tokens: int, calls: int = 10, replays: int = 20) -> dict:
    share = [tokens // 2] * 2
    inp = torch.randn(tokens, HIDDEN, device=group.device, dtype=torch.bfloat16)
    out = torch.empty_like(inp)
    result = dict(tokens=tokens)
    swept = [f"host-r{overhead >> 10}k" for overhead in REPLAY_CHUNKINGS]
    for transport in ("host", "host-mbox", "dist", *swept):
        graph = _capture(group, out, inp, share, transport, calls)
        times = []
        for _ in range(replays):
            group.barrier()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        median = torch.tensor([sorted(times)[len(times) // 2]], device=group.device)
        group.allreduce([median], _MaxOption)
        result[f"{transport}_us"] = float(median.item())
        del graph
    return result


class _MaxOption:
    from ray.util.collective.types import ReduceOp

    reduceOp = ReduceOp.MAX


def worker(rank: int, port: int, path: str) -> None:
    group = _group(rank, port)
    report = dict(
        stress=stress(group),
        graphs=[
            graphs(group, "host", 256),
            graphs(group, "host", 2048),
            graphs(group, "host-mbox", 256),
        ],
        latency=[latency(group, tokens) for tokens in (2, 16, 128, 512)],
        replayed=[replayed_latency(group, tokens) for tokens in (2, 16, 128, 512, 2048)],
    )
    if rank == 0:
        Path(path).write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1), flush=True)
    group.destroy_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    path = str(Path(args.out) / "gpu_host_transport.json")
    mp.spawn(worker, args=(store.port, path), nprocs=2)


if __name__ == "__main__":
    main()
