"""Where the host-staged transport's time goes, on a machine with 2 GPUs.

1. Copy concurrency (one process, both GPUs): GB/s per stream of 64 MiB copies between GPU and
   page-locked host memory, alone and with other copies at once (the same GPU's other direction,
   the other GPU), into torch's pinned memory and into /dev/shm pages registered the way the
   transport registers them. If four streams at once each get much less than one alone, host
   memory (not the PCIe links) bounds any host-staged exchange.
2. Flag round trip (two processes): GPU 0 writes a host flag, GPU 1's stream waits for it and
   writes another, GPU 0 waits for that; N round trips timed with CUDA events.
3. One exchange, both protocols (two processes): host time to queue it, GPU time from the
   caller's start event to its end event, for 64 KiB to 112 MiB blocks.

Usage: python benchmarks/comm_host_path_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1 << 20


def copy_concurrency(num_bytes: int = 64 * MIB, reps: int = 8) -> list[dict]:
    from rayinfer.comm.shm import _pin

    devices = [torch.device("cuda", i) for i in range(2)]
    on_gpu = {d: torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=d) for d in devices}
    spare = {d: torch.empty(num_bytes, dtype=torch.uint8, device=d) for d in devices}
    rows = []
    for memory in ("torch-pinned", "shm-registered"):
        hosts = [_host_buffer(num_bytes, memory, _pin) for _ in range(4)]
        cases = {
            "gpu0 d2h": [(0, "d2h")],
            "gpu0 h2d": [(0, "h2d")],
            "gpu0 d2h + gpu0 h2d": [(0, "d2h"), (0, "h2d")],
            "gpu0 d2h + gpu1 h2d": [(0, "d2h"), (1, "h2d")],
            "gpu0 d2h + gpu1 d2h": [(0, "d2h"), (1, "d2h")],
            "all four": [(0, "d2h"), (0, "h2d"), (1, "d2h"), (1, "h2d")],
        }
        for name, streams in cases.items():
            work = []
            for i, (gpu, direction) in enumerate(streams):
                d = devices[gpu]
                stream = torch.cuda.Stream(d)
                src, dst = (on_gpu[d], hosts[i]) if direction == "d2h" else (hosts[i], spare[d])
                work.append((stream, dst, src))
            for _ in range(2):
                _run_copies(work, 1)
            start = time.perf_counter()
            _run_copies(work, reps)
            seconds = time.perf_counter() - start
            gbps = num_bytes * reps / seconds / 1e9
            rows.append(dict(memory=memory, case=name, streams=len(work), gbps_per_stream=gbps))
            print(f"{memory:15s} {name:22s} {gbps:6.1f} GB/s per stream", flush=True)
    return rows


def _host_buffer(num_bytes: int, memory: str, pin) -> torch.Tensor:
    if memory == "torch-pinned":
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    path = f"/dev/shm/rayinfer-probe-{os.getpid()}-{time.monotonic_ns()}"
    with open(path, "wb") as f:
        f.truncate(num_bytes)
    buf = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    os.unlink(path)
    pin([buf])
    return buf


def _run_copies(work, reps: int) -> None:
    for stream, dst, src in work:
        with torch.cuda.stream(stream):
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
    for stream, _, _ in work:
        stream.synchronize()


def _worker(rank: int, port: int, out_path: str) -> None:
    from rayinfer.comm.host_staged import HostStagedTransport
    from rayinfer.comm.transport import Transfer

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, timeout)
    rows = []
    transports = {
        p: HostStagedTransport(dist.PrefixStore(p, store), rank, 2, device, protocol=p)
        for p in ("gpu", "cpu")
    }
    rows.append(_flag_round_trip(transports["gpu"], pg, rank))
    for size in (64 << 10, 917_504, 8 * MIB, 112 * MIB):
        send = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        for protocol, transport in transports.items():
            host_s, gpu_s = [], []
            for it in range(12):
                pg.barrier().wait()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                t0 = time.perf_counter()
                transport.exchange([Transfer(1 - rank, send)], [Transfer(1 - rank, recv)])
                host = time.perf_counter() - t0
                end.record()
                torch.cuda.synchronize()
                if it >= 2:
                    host_s.append(host)
                    gpu_s.append(start.elapsed_time(end) / 1e3)
            ok = bool(torch.equal(recv, _peer_copy(send, pg)))
            rows.append(
                dict(
                    probe="exchange",
                    protocol=protocol,
                    bytes=size,
                    host_us=statistics.median(host_s) * 1e6,
                    total_us=statistics.median(gpu_s) * 1e6,
                    gbps=size / statistics.median(gpu_s) / 1e9,
                    exact=ok,
                )
            )
            if rank == 0:
                r = rows[-1]
                print(
                    f"exchange {protocol} {size / MIB:8.2f} MiB: queue {r['host_us']:7.1f} us, "
                    f"done after {r['total_us']:8.1f} us ({r['gbps']:.1f} GB/s), exact {ok}",
                    flush=True,
                )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
    for t in transports.values():
        t.close()


def _peer_copy(send: torch.Tensor, pg) -> torch.Tensor:
    """What the other rank sent, through gloo on the CPU (for the exactness check)."""
    mine = send.cpu()
    both = [torch.empty_like(mine) for _ in range(2)]
    pg.allgather([both], [mine]).wait()
    return both[1 - pg.rank()].to(send.device)


def _flag_round_trip(transport, pg, rank: int, trips: int = 200) -> dict:
    """GPU 0 writes flag a; GPU 1 waits for a, writes b; GPU 0 waits for b: `trips` times."""
    pipeline = transport.pipeline
    shm, gpu = pipeline.shm, pipeline.gpu
    # Slots the transport never uses: the self pair (rank -> rank), slot 1.
    a = pipeline._device_address(shm.published_flag(0, 0, 1))
    b = pipeline._device_address(shm.published_flag(1, 1, 1))
    stream = torch.cuda.Stream()
    pg.barrier().wait()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record(stream)
    for i in range(1, trips + 1):
        if rank == 0:
            gpu.write(stream, a, i)
            gpu.wait_equal(stream, b, i)
        else:
            gpu.wait_equal(stream, a, i)
            gpu.write(stream, b, i)
    end.record(stream)
    stream.synchronize()
    us = start.elapsed_time(end) * 1e3 / trips
    if rank == 0:
        print(f"flag round trip GPU0 -> GPU1 -> GPU0 through host memory: {us:.1f} us", flush=True)
    return dict(probe="flag_round_trip", round_trip_us=us)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="comm_host_path_probe.json")
    args = parser.parse_args()
    rows = copy_concurrency()
    tmp = args.out + ".exchange"
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    mp.spawn(_worker, args=(store.port, tmp), nprocs=2)
    with open(tmp) as f:
        rows += json.load(f)
    os.unlink(tmp)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
