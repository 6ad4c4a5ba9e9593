"""Measure a live group's links and build its Topology; cached on disk, keyed by the hardware.

Per ordered pair: both directions at once at two message sizes, over the dist transport and the
host-staged one; latency and bandwidth come from the line through the two points. The one-shot
efficiency is the model's all-pairs time divided by the measured one. Every rank runs the same
sequence of exchanges; rank 0 assembles the result and shares it through the group's store.
"""

import hashlib
import time
from pathlib import Path

import torch

from rayinfer import envs
from rayinfer.comm import nvidia_smi
from rayinfer.comm.cost_model import dist_round_s, rounds
from rayinfer.comm.nvidia_smi import is_fast_link
from rayinfer.comm.topology import Topology, find_islands
from rayinfer.comm.transport import Transfer

PROBE_BYTES = (64 << 10, 32 << 20)


def probe(
    group,
    use_cache: bool = True,
    iters: int = 5,
    message_bytes: tuple[int, int] = PROBE_BYTES,
    cache_dir: Path | None = None,
) -> Topology:
    """Measure (or load) the topology of `group` (a RayinferGroup); every rank gets the same one.
    message_bytes: the small and the large size each pair is timed at. cache_dir: where the
    measured topology is kept (default: envs.cache_dir())."""
    key = hardware_key(group.world_size)
    path = (cache_dir or envs.cache_dir()) / f"topology-{key}.json"
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
    parts = [str(world_size), *envs.nccl_settings()]
    if torch.cuda.is_available():
        parts.append(
            nvidia_smi.run(["nvidia-smi", "--query-gpu=name,pci.bus_id", "--format=csv,noheader"])
        )
    else:
        parts.append("cpu")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def islands_from_links(links: tuple[tuple[str, ...], ...]) -> list[list[int]]:
    """Ranks whose GPUs share NVLink or one PCIe switch (`topo -m`) form an island."""
    n = len(links)
    fast = [
        [1.0 if i == j or is_fast_link(links[i][j]) else 0.0 for j in range(n)] for i in range(n)
    ]
    return find_islands(fast, ratio=1.0)


def _measure(group, iters: int, sizes: tuple[int, int]) -> Topology:
    n, is_cuda = group.world_size, group.device.type == "cuda"
    dist_fits = _fit_pairs(group, "dist", iters, sizes)
    host_fits = _fit_pairs(group, "host", iters, sizes) if is_cuda else {}
    bandwidth = _pair_matrix(n, dist_fits, 1)
    gpus = _gather_gpu_indices(group) if is_cuda else None
    base = Topology(
        bandwidth=bandwidth,
        latency=_pair_matrix(n, dist_fits, 0),
        host_bandwidth=_host_bandwidth(n, host_fits),
        host_latency=max((lat for lat, _ in host_fits.values()), default=20e-6),
        islands=tuple(tuple(i) for i in find_islands(bandwidth)),
        p2p=nvidia_smi.peer_access(gpus) if gpus else None,
        links=nvidia_smi.links_between(gpus) if gpus else None,
        is_host_staged_available=is_cuda,
    )
    return _fit_one_shot(group, base, iters, sizes[1])


def _fit_pairs(group, transport: str, iters: int, sizes) -> dict[tuple[int, int], tuple]:
    """(latency s, bytes/s per direction) for every pair i < j, both directions at once."""
    n = group.world_size
    return {
        (i, j): _pair_fit(group, transport, i, j, iters, sizes)
        for i in range(n)
        for j in range(i + 1, n)
    }


def _pair_matrix(n: int, fits: dict, field: int) -> tuple[tuple[float, ...], ...]:
    """[N][N] of one fitted field, symmetric; the diagonal is the row's best (bandwidth) or 0."""
    rows = [
        [fits[min(i, j), max(i, j)][field] if i != j else 0.0 for j in range(n)] for i in range(n)
    ]
    for i in range(n):
        rows[i][i] = max(rows[i]) if field == 1 and n > 1 else rows[i][i]
    return tuple(tuple(row) for row in rows)


def _host_bandwidth(n: int, fits: dict) -> tuple[float, ...]:
    """Each rank's slowest host-staged pair, or 25 GB/s where nothing was measured (CPU)."""
    if not fits:
        return (25e9,) * n
    return tuple(min(bw for (i, j), (_, bw) in fits.items() if r in (i, j)) for r in range(n))


def _gather_gpu_indices(group) -> list[int] | None:
    """nvidia-smi index of every rank's GPU, shared through the group's store."""
    key = group.next_key("gpu-index")
    mine = nvidia_smi.my_gpu_index()
    group.store.set(f"{key}-{group.rank}", "" if mine is None else str(mine))
    values = [group.store.get(f"{key}-{r}").decode() for r in range(group.world_size)]
    return None if "" in values else [int(v) for v in values]


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
