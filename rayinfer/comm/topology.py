"""What the links between a group's ranks can do, measured (probe.py) or written by hand.

Units: bytes/s and seconds. "dist" paths are what torch.distributed (NCCL) uses between a pair
(peer-to-peer or NVLink when present); "host" is each GPU's own link to pinned host memory,
which the host-staged transport uses in both directions at once.
"""

import json
from dataclasses import asdict, dataclass, field

GB = 1e9


@dataclass(frozen=True)
class Topology:
    """bandwidth: [N][N] bytes/s of pair i -> j alone over the dist path.
    latency: [N][N] s per message i -> j over the dist path.
    host_bandwidth: [N] bytes/s per direction of each rank's host link.
    host_latency: s for one chunk to cross host memory (copy launch, flag, copy launch).
    islands: ranks joined by fast links, each sorted; every rank in exactly one.
    cross_bandwidth: {"I,J": bytes/s} shared by all dist traffic between islands I and J;
        missing pairs are limited only by their pair bandwidth.
    one_shot_efficiency: fraction of the pair/port bandwidth that an all-pairs-at-once dist
        exchange reaches (NCCL over the CPU root complex collapses below 1; fitted by the probe).
    p2p: [N][N] whether GPU i can access GPU j directly (None: unknown).
    links: [N][N] `nvidia-smi topo -m` link names (NV18, PIX, PXB, PHB, NODE, SYS; None: unknown).
    is_host_staged_available: ranks share a node's memory and have GPUs to stage from."""

    bandwidth: tuple[tuple[float, ...], ...]
    latency: tuple[tuple[float, ...], ...]
    host_bandwidth: tuple[float, ...]
    host_latency: float
    islands: tuple[tuple[int, ...], ...]
    cross_bandwidth: dict[str, float] = field(default_factory=dict)
    one_shot_efficiency: float = 1.0
    p2p: tuple[tuple[bool, ...], ...] | None = None
    links: tuple[tuple[str, ...], ...] | None = None
    is_host_staged_available: bool = True
    note: str = ""

    def __post_init__(self):
        n = self.world_size
        ranks = sorted(r for isl in self.islands for r in isl)
        if ranks != list(range(n)):
            raise ValueError(f"islands {self.islands} must cover ranks 0..{n - 1} exactly once")
        if len(self.host_bandwidth) != n or any(len(row) != n for row in self.bandwidth):
            raise ValueError(f"bandwidth must be [{n}][{n}] and host_bandwidth [{n}]")

    @property
    def world_size(self) -> int:
        return len(self.bandwidth)

    def island_of(self, rank: int) -> int:
        return next(i for i, isl in enumerate(self.islands) if rank in isl)

    def port_bandwidth(self, rank: int) -> float:
        """What one rank can push into the dist fabric at once: its fastest pair."""
        return max(b for j, b in enumerate(self.bandwidth[rank]) if j != rank)

    def cross_link(self, a: int, b: int) -> float | None:
        key = f"{min(a, b)},{max(a, b)}"
        return self.cross_bandwidth.get(key)

    @classmethod
    def from_matrix(
        cls,
        bandwidth_gbps: list[list[float]],
        latency_us: float | list[list[float]] = 10.0,
        host_gbps: float | list[float] = 20.0,
        host_latency_us: float = 20.0,
        islands: list[list[int]] | None = None,
        cross_gbps: dict[str, float] | None = None,
        one_shot_efficiency: float = 1.0,
        **kw,
    ) -> "Topology":
        """Build by hand, in GB/s and microseconds (tests, simulation, published figures)."""
        n = len(bandwidth_gbps)
        lat = latency_us if isinstance(latency_us, list) else [[latency_us] * n for _ in range(n)]
        host = host_gbps if isinstance(host_gbps, list) else [host_gbps] * n
        return cls(
            bandwidth=tuple(tuple(b * GB for b in row) for row in bandwidth_gbps),
            latency=tuple(tuple(t * 1e-6 for t in row) for row in lat),
            host_bandwidth=tuple(h * GB for h in host),
            host_latency=host_latency_us * 1e-6,
            islands=tuple(tuple(i) for i in (islands or find_islands(bandwidth_gbps))),
            cross_bandwidth={k: v * GB for k, v in (cross_gbps or {}).items()},
            one_shot_efficiency=one_shot_efficiency,
            **kw,
        )

    @classmethod
    def uniform(cls, world_size: int, is_cuda: bool = False) -> "Topology":
        """Placeholder before a probe: equal links everywhere (host transport only on CUDA,
        where it is a real alternative; on CPU both transports copy through memory anyway)."""
        bw = [[50.0] * world_size for _ in range(world_size)]
        return cls.from_matrix(
            bw,
            islands=[list(range(world_size))],
            host_gbps=25.0,
            is_host_staged_available=is_cuda,
            note="uniform placeholder",
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        d = json.loads(text)
        for key in ("bandwidth", "latency", "p2p", "links"):
            if d.get(key) is not None:
                d[key] = tuple(tuple(row) for row in d[key])
        d["host_bandwidth"] = tuple(d["host_bandwidth"])
        d["islands"] = tuple(tuple(i) for i in d["islands"])
        return cls(**d)


def find_islands(bandwidth: list[list[float]], ratio: float = 0.6) -> list[list[int]]:
    """Ranks whose pair bandwidth is within `ratio` of the fastest pair share an island
    (connected components of the fast links)."""
    n = len(bandwidth)
    fastest = max((bandwidth[i][j] for i in range(n) for j in range(n) if i != j), default=0.0)
    island_of = list(range(n))

    def root(r: int) -> int:
        while island_of[r] != r:
            r = island_of[r]
        return r

    for i in range(n):
        for j in range(n):
            if i != j and min(bandwidth[i][j], bandwidth[j][i]) >= ratio * fastest:
                island_of[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for r in range(n):
        groups.setdefault(root(r), []).append(r)
    return sorted(groups.values())
