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
4. Ring reuse (`--ring`): the same four copy streams, but through a small staging ring that is
   used over and over (GPU 0 writes slot i, GPU 1 reads it, and back), for several chunk sizes
   and ring lengths; then the transport's own 112 MiB exchange with those rings. If a ring small
   enough to stay in the CPU's last-level cache beats the 64 MiB figure of part 1, the copies
   escape host memory's bandwidth, which caps part 1.

Usage: python benchmarks/comm_host_path_probe.py [--out probe.json] [--ring]
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
    from rayinfer.comm.shm import pin_host

    devices = [torch.device("cuda", i) for i in range(2)]
    on_gpu = {d: torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=d) for d in devices}
    spare = {d: torch.empty(num_bytes, dtype=torch.uint8, device=d) for d in devices}
    rows = []
    for memory in ("torch-pinned", "shm-registered"):
        hosts = [_host_buffer(num_bytes, memory, pin_host) for _ in range(4)]
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


def ring_reuse(total_bytes: int = 256 * MIB) -> list[dict]:
    """GB/s per stream with all four copies at once, each chunk through ring slot i % R: GPU 0
    writes ring A and reads ring B, GPU 1 the reverse (no ordering between them: a bandwidth
    probe, not an exchange)."""
    from rayinfer.comm.shm import pin_host

    devices = [torch.device("cuda", i) for i in range(2)]
    sources = [torch.randint(0, 255, (total_bytes,), dtype=torch.uint8, device=d) for d in devices]
    targets = [torch.empty(total_bytes, dtype=torch.uint8, device=d) for d in devices]
    rows = []
    for chunk, slots in ((8 * MIB, 8), (4 * MIB, 4), (1 * MIB, 4), (MIB // 2, 4), (MIB // 4, 8),
                         (1 * MIB, 2), (MIB // 16, 8)):  # fmt: skip
        # torch's pinned memory: copies as fast as the registered /dev/shm pages (part 1)
        rings = [_host_buffer(chunk * slots, "torch-pinned", pin_host) for _ in range(2)]
        streams = [torch.cuda.Stream(d) for d in devices for _ in range(2)]
        plan = [  # (stream, gpu, direction, ring)
            (streams[0], 0, "d2h", rings[0]), (streams[1], 0, "h2d", rings[1]),
            (streams[2], 1, "d2h", rings[1]), (streams[3], 1, "h2d", rings[0]),
        ]  # fmt: skip

        _copy_through_ring(plan, sources, targets, chunk, slots)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            _copy_through_ring(plan, sources, targets, chunk, slots)
            times.append(time.perf_counter() - t0)
        gbps = total_bytes / statistics.median(times) / 1e9
        rows.append(dict(probe="ring_reuse", chunk_bytes=chunk, slots=slots,
                         ring_bytes=chunk * slots, gbps_per_stream=gbps))  # fmt: skip
        print(f"ring {slots} x {chunk / MIB:5.2f} MiB ({chunk * slots / MIB:5.1f} MiB): "
              f"{gbps:6.1f} GB/s per stream, all four at once", flush=True)  # fmt: skip
    return rows


def _copy_through_ring(plan, sources, targets, chunk: int, slots: int) -> None:
    """Every stream of `plan` copies its GPU's whole buffer chunk by chunk, chunk i through ring
    slot i % slots; returns when all are done."""
    for stream, gpu, direction, ring in plan:
        with torch.cuda.stream(stream):
            for i, start in enumerate(range(0, sources[gpu].numel(), chunk)):
                host = ring[(i % slots) * chunk : (i % slots + 1) * chunk]
                if direction == "d2h":
                    host.copy_(sources[gpu][start : start + chunk], non_blocking=True)
                else:
                    targets[gpu][start : start + chunk].copy_(host, non_blocking=True)
    for stream, *_ in plan:
        stream.synchronize()


def _cpu_description() -> dict:
    """Model name and cache sizes from lscpu (the last-level cache bounds part 4's rings)."""
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    wanted = ("Model name", "Socket(s)", "L2 cache", "L3 cache", "NUMA node(s)", "CPU(s)")
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            found[key.strip()] = value.strip()
    print("cpu:", found, flush=True)
    return dict(probe="cpu", **found)


def _join(rank: int, port: int):
    """(this rank's GPU, the shared store, a gloo group of the two ranks) in a worker."""
    torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, timeout)
    return torch.device("cuda", rank), store, pg


def _ring_exchange_worker(rank: int, port: int, out_path: str) -> None:
    """The transport's own 112 MiB and 8 MiB exchanges with the rings of ring_reuse."""
    from rayinfer.comm.host_staged import HostStagedTransport
    from rayinfer.comm.transport import Transfer

    device, store, pg = _join(rank, port)
    rows = []
    for chunk, slots in ((8 * MIB, 8), (2 * MIB, 4), (1 * MIB, 4), (MIB // 2, 8), (1 * MIB, 8)):
        prefix = dist.PrefixStore(f"ring{chunk}x{slots}", store)
        transport = HostStagedTransport(prefix, rank, 2, device, chunk_bytes=chunk,
                                        num_slots=slots, protocol="gpu")  # fmt: skip
        for size in (8 * MIB, 112 * MIB):
            send = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
            recv = torch.empty_like(send)
            gpu_s = []
            for it in range(8):
                pg.barrier().wait()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                transport.exchange([Transfer(1 - rank, send)], [Transfer(1 - rank, recv)])
                end.record()
                torch.cuda.synchronize()
                if it >= 2:
                    gpu_s.append(start.elapsed_time(end) / 1e3)
            ok = bool(torch.equal(recv, _peer_copy(send, pg)))
            seconds = statistics.median(gpu_s)
            rate = size / seconds / 1e9
            rows.append(dict(probe="ring_exchange", chunk_bytes=chunk, slots=slots, bytes=size,
                             total_us=seconds * 1e6, gbps=rate, exact=ok))  # fmt: skip
            if rank == 0:
                print(f"transport ring {slots} x {chunk / MIB:4.2f} MiB, {size / MIB:6.1f} MiB "
                      f"exchange: {seconds * 1e6:8.1f} us ({size / seconds / 1e9:.1f} GB/s), "
                      f"exact {ok}", flush=True)  # fmt: skip
        transport.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


def _host_buffer(num_bytes: int, memory: str, pin) -> torch.Tensor:
    if memory == "torch-pinned":
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    path = f"/dev/shm/rayinfer-probe-{os.getpid()}-{time.monotonic_ns()}"
    with open(path, "wb") as f:
        f.truncate(num_bytes)
    buf = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    os.unlink(path)
    pin(buf)
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

    device, store, pg = _join(rank, port)
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
    parser.add_argument("--ring", action="store_true", help="part 4 only: ring reuse")
    args = parser.parse_args()
    if args.ring:
        rows = [_cpu_description()] + ring_reuse()
        worker = _ring_exchange_worker
    else:
        rows = copy_concurrency()
        worker = _worker
    tmp = args.out + ".exchange"
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    mp.spawn(worker, args=(store.port, tmp), nprocs=2)
    with open(tmp) as f:
        rows += json.load(f)
    os.unlink(tmp)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
