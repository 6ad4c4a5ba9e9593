"""Measure a live group's links and build its Topology; cached on disk, keyed by the hardware.

Per ordered pair: both directions at once at two message sizes, over the dist transport and the
host-staged one; latency and bandwidth come from the line through the two points. The one-shot
efficiency is the model's all-pairs time divided by the measured one. Every rank runs the same
sequence of exchanges; rank 0 assembles the result and shares it through the group's store.
"""

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from rayinfer.comm.cost_model import dist_round_s, rounds
from rayinfer.comm.topology import Topology, find_islands
from rayinfer.comm.transport import Transfer

PROBE_BYTES = (64 << 10, 32 << 20)
CACHE_DIR = Path(os.environ.get("RAYINFER_CACHE", Path.home() / ".cache" / "rayinfer"))


def probe(
    group, use_cache: bool = True, iters: int = 5, message_bytes: tuple[int, int] = PROBE_BYTES
) -> Topology:
    """Measure (or load) the topology of `group` (a RayinferGroup); every rank gets the same one.
    message_bytes: the small and the large size each pair is timed at."""
    key = hardware_key(group.world_size)
    path = CACHE_DIR / f"topology-{key}.json"
    call = group.next_key("probe")
    if group.rank == 0:
        text = path.read_text() if use_cache and path.exists() else None
        group.store.set(f"{call}-cached", "1" if text else "0")
    is_cached = group.store.get(f"{call}-cached") == b"1"
    if not is_cached:
        text = _measure(group, iters, message_bytes).to_json()
        if group.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if group.rank == 0:
        group.store.set(f"{call}-result", text)
    return Topology.from_json(group.store.get(f"{call}-result").decode())


def hardware_key(world_size: int) -> str:
    """GPU names and bus ids, world size and the NCCL settings that change the paths."""
    parts = [
        str(world_size),
        os.environ.get("NCCL_P2P_DISABLE", ""),
        os.environ.get("NCCL_SHM_DISABLE", ""),
    ]
    if torch.cuda.is_available():
        parts.append(_run(["nvidia-smi", "--query-gpu=name,pci.bus_id", "--format=csv,noheader"]))
    else:
        parts.append("cpu")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def parse_topo_matrix(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi topo -m` -> {"GPU0": {"GPU1": "NV18", ...}, ...} (GPU rows and columns only)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = lines[0].split() if lines else []
    gpus = [h for h in header if h.startswith("GPU")]
    links = {}
    for line in lines[1:]:
        cells = line.split()
        if cells and cells[0] in gpus:
            links[cells[0]] = dict(zip(gpus, cells[1 : 1 + len(gpus)], strict=False))
    return links


def islands_from_links(links: dict[str, dict[str, str]]) -> list[list[int]]:
    """GPUs joined by NVLink (NV#) or one PCIe switch (PIX, PXB) share an island."""
    names = sorted(links, key=lambda g: int(g[3:]))
    fast = [
        [1.0 if i == j or _is_fast(links[a][b]) else 0.0 for j, b in enumerate(names)]
        for i, a in enumerate(names)
    ]
    return find_islands(fast, ratio=1.0)


def _is_fast(link: str) -> bool:
    return link.startswith("NV") or link in ("PIX", "PXB")


def _measure(group, iters: int, sizes: tuple[int, int]) -> Topology:
    n = group.world_size
    dist_t = [
        [_pair_fit(group, "dist", i, j, iters, sizes) if i != j else (0.0, 1e12) for j in range(n)]
        for i in range(n)
    ]
    host_t = (
        [
            [
                _pair_fit(group, "host", i, j, iters, sizes) if i != j else (0.0, 1e12)
                for j in range(n)
            ]
            for i in range(n)
        ]
        if group.device.type == "cuda"
        else None
    )
    bandwidth = [[bw for _, bw in row] for row in dist_t]
    latency = [[lat for lat, _ in row] for row in dist_t]
    for i in range(n):
        bandwidth[i][i] = max(b for j, b in enumerate(bandwidth[i]) if j != i) if n > 1 else 1e12
    topo_text = _run(["nvidia-smi", "topo", "-m"]) if group.device.type == "cuda" else ""
    host_bw = (
        [min(b for j, (_, b) in enumerate(host_t[i]) if j != i) for i in range(n)]
        if host_t
        else [25e9] * n
    )
    host_lat = (
        max((host_t[i][j][0] for i in range(n) for j in range(n) if i != j), default=20e-6)
        if host_t
        else 20e-6
    )
    base = Topology(
        bandwidth=tuple(map(tuple, bandwidth)),
        latency=tuple(map(tuple, latency)),
        host_bandwidth=tuple(host_bw),
        host_latency=host_lat,
        islands=tuple(tuple(i) for i in find_islands(bandwidth)),
        is_host_staged_available=host_t is not None,
        note=topo_text,
    )
    return _fit_one_shot(group, base, iters, sizes[1])


def _pair_fit(group, transport: str, a: int, b: int, iters: int, sizes) -> tuple[float, float]:
    """(latency s, bytes/s per direction) of a <-> b, both directions at once."""
    times = [_time_pair(group, transport, a, b, size, iters) for size in sizes]
    small, large = sizes
    slope = max((times[1] - times[0]) / (large - small), 1e-13)
    return max(times[0] - small * slope, 1e-6), 1.0 / slope


def _time_pair(group, transport: str, a: int, b: int, size: int, iters: int) -> float:
    me = group.rank
    peer = b if me == a else a if me == b else None
    send = torch.ones(size, dtype=torch.uint8, device=group.device)
    recv = torch.empty_like(send)
    sends = [Transfer(peer, send)] if peer is not None else []
    recvs = [Transfer(peer, recv)] if peer is not None else []
    run = lambda: group.transport(transport).exchange(sends, recvs)
    return median_time(group, run, iters)


def _fit_one_shot(group, topo: Topology, iters: int, size: int) -> Topology:
    """Measure a uniform all-pairs dist exchange of `size` bytes per pair."""
    n = group.world_size
    if n == 1:
        return topo
    inp = torch.ones(size * n, dtype=torch.uint8, device=group.device).view(n, size)
    out = torch.empty_like(inp)
    run = lambda: group.transport("dist").all_to_all(out, inp, [1] * n, [1] * n)
    measured = median_time(group, run, iters)
    matrix = [[size] * n for _ in range(n)]
    predicted = dist_round_s(topo, rounds("nccl", topo, matrix)[0], is_one_shot=False)
    efficiency = min(1.0, max(0.05, predicted / measured))
    return Topology(**{**topo.__dict__, "one_shot_efficiency": efficiency})


def median_time(group, fn, iters: int, warmup: int = 1) -> float:
    """Median wall time of fn over iters (after warm-up), slowest rank's (CUDA synchronized)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        group.barrier()
        _sync(group.device)
        start = time.perf_counter()
        fn()
        _sync(group.device)
        samples.append(time.perf_counter() - start)
    median = torch.tensor([sorted(samples)[len(samples) // 2]], device=group.device)
    group.allreduce([median], _MaxOption)
    return float(median.item())


class _MaxOption:
    from ray.util.collective.types import ReduceOp

    reduceOp = ReduceOp.MAX


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
