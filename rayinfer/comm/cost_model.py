"""Predict each (schedule, transport)'s time from a Topology and pick the fastest.

A schedule is a list of rounds; a round is a set of flows (src, dst, bytes) that run together.
  dist round  = slowest latency + bytes / bandwidth of its tightest resource: one pair's path,
                one rank's port out or in, or a shared cross-island link; an all-pairs-at-once
                round is further divided by the fitted one_shot_efficiency.
  host round  = host_latency + the busiest of: each direction of any rank's host link, and the
                shared cross-island links (host memory sits behind one socket, so traffic
                between islands still crosses them); plus one chunk of pipeline fill (a chunk
                must reach host memory before it can leave it).
Every rank holds the same topology and split matrix, so every rank picks the same plan.
"""

from dataclasses import dataclass, replace

from rayinfer.comm.topology import Topology

HOST_CHUNK_BYTES = 4 << 20
Flow = tuple[int, int, int]  # src, dst, bytes


@dataclass(frozen=True)
class Choice:
    """schedule, transport: what runs. predicted_s: every candidate's predicted time.
    reason: one line on why this one."""

    schedule: str
    transport: str
    predicted_s: dict[str, float]
    reason: str

    def override(self, schedule: str = "auto", transport: str = "auto") -> "Choice":
        """Apply explicit names from the caller; 'auto' keeps the model's pick."""
        if schedule == "auto" and transport == "auto":
            return self
        return replace(
            self,
            schedule=self.schedule if schedule == "auto" else schedule,
            transport=self.transport if transport == "auto" else transport,
            reason="chosen by the caller",
        )


def rounds(schedule: str, topo: Topology, matrix: list[list[int]]) -> list[list[Flow]] | None:
    """Flows of each round (bytes), or None where the schedule does not apply."""
    n = topo.world_size
    if schedule == "nccl":
        return [[(s, d, matrix[s][d]) for s in range(n) for d in range(n) if s != d]]
    if schedule == "pairwise":
        if n == 2:
            return None  # the same single message as the one-shot exchange: leave ties to it
        return [[(s, (s + k) % n, matrix[s][(s + k) % n]) for s in range(n)] for k in range(1, n)]
    if schedule == "hierarchical":
        return _hierarchical_rounds(topo.islands, matrix)
    raise ValueError(f"no cost model for schedule {schedule!r}")


def _hierarchical_rounds(islands, matrix) -> list[list[Flow]] | None:
    size = len(islands[0])
    if len(islands) == 1 or size == 1 or any(len(isl) != size for isl in islands):
        return None  # degenerates to a one-shot exchange, or needs equal islands
    intra = [
        (a, b, sum(matrix[a][isl[j]] for isl in islands))
        for mates in islands
        for a in mates
        for j, b in enumerate(mates)
        if a != b
    ]
    cross = [
        (src_isl[j], dst_isl[j], sum(matrix[s][dst_isl[j]] for s in src_isl))
        for src_isl in islands
        for dst_isl in islands
        if src_isl is not dst_isl
        for j in range(size)
    ]
    return [intra, cross]


def dist_round_s(topo: Topology, flows: list[Flow], is_one_shot: bool) -> float:
    flows = [f for f in flows if f[2] > 0]
    if not flows:
        return 0.0
    latency = max(topo.latency[s][d] for s, d, _ in flows)
    out_bytes, in_bytes = {}, {}
    pair_s = 0.0
    for s, d, b in flows:
        pair_s = max(pair_s, b / topo.bandwidth[s][d])
        out_bytes[s] = out_bytes.get(s, 0) + b
        in_bytes[d] = in_bytes.get(d, 0) + b
    port_s = max(
        max(b / topo.port_bandwidth(r) for r, b in out_bytes.items()),
        max(b / topo.port_bandwidth(r) for r, b in in_bytes.items()),
    )
    cross_s = _cross_link_s(topo, flows)
    efficiency = topo.one_shot_efficiency if is_one_shot else 1.0
    return latency + max(pair_s, port_s, cross_s) / efficiency


def _cross_link_s(topo: Topology, flows: list[Flow]) -> float:
    """Time the busiest shared cross-island link needs, per direction."""
    cross_bytes = {}
    for s, d, b in flows:
        link = (topo.island_of(s), topo.island_of(d))
        if link[0] != link[1] and topo.cross_link(*link):
            cross_bytes[link] = cross_bytes.get(link, 0) + b
    return max((b / topo.cross_link(*k) for k, b in cross_bytes.items()), default=0.0)


def host_round_s(topo: Topology, flows: list[Flow]) -> float:
    flows = [f for f in flows if f[2] > 0]
    if not flows:
        return 0.0
    busiest_s, fill_s = _cross_link_s(topo, flows), 0.0
    for r in range(topo.world_size):
        out_b = sum(b for s, _, b in flows if s == r)
        in_b = sum(b for _, d, b in flows if d == r)
        busiest_s = max(busiest_s, max(out_b, in_b) / topo.host_bandwidth[r])
    for s, _, b in flows:
        fill_s = max(fill_s, min(b, HOST_CHUNK_BYTES) / topo.host_bandwidth[s])
    return topo.host_latency + busiest_s + fill_s


def predict(topo: Topology, matrix: list[list[int]], row_bytes: int) -> dict[str, float]:
    """{"schedule/transport": seconds} for every candidate that applies."""
    byte_matrix = [[rows * row_bytes for rows in row] for row in matrix]
    transports = ["dist", "host"] if topo.is_host_staged_available else ["dist"]
    times = {}
    for schedule in ("nccl", "pairwise", "hierarchical"):
        plan = rounds(schedule, topo, byte_matrix)
        if plan is None:
            continue
        for transport in transports:
            if transport == "dist":
                total = sum(dist_round_s(topo, r, schedule == "nccl") for r in plan)
            else:
                total = sum(host_round_s(topo, r) for r in plan)
            times[f"{schedule}/{transport}"] = total
    return times


def choose(topo: Topology, matrix: list[list[int]], row_bytes: int) -> Choice:
    times = predict(topo, matrix, row_bytes)
    ranked = sorted(times, key=times.get)
    best = ranked[0]
    schedule, transport = best.split("/")
    runner_up = f"; next {ranked[1]} {times[ranked[1]] * 1e6:.0f} us" if len(ranked) > 1 else ""
    reason = f"{best} predicted {times[best] * 1e6:.0f} us{runner_up}"
    return Choice(schedule, transport, times, reason)
