"""What a Ray cluster holds in memory on this node: resident memory of its processes by kind, and
the object store's bytes, for the soak's before/after and growth figures.

The cluster's processes are those whose arguments name its session directory and their
descendants (`cluster_processes`). Kinds: `gcs`, `raylet`, `dashboard` (the dashboard and its
agents), `serve` (the Serve controller and proxies), `replica:<Deployment>`, `worker`
(rayinfer's worker actors), `ray-other` (idle pooled workers, log monitor, ...).
"""

from __future__ import annotations

from pathlib import Path

ACTOR_KINDS = (("ServeController", "serve"), ("ProxyActor", "serve"), ("Worker", "worker"))


def process_kind(argv: list[str], session_dir: str) -> str | None:
    """The kind of one of the cluster's processes from its arguments. Ray's workers replace
    their command line with a title (`ray::<Actor>[.<method>]`, `ray::IDLE`)."""
    if not argv:
        return None
    program = argv[0].rsplit("/", 1)[-1]
    if program in ("raylet", "gcs_server"):
        return "raylet" if program == "raylet" else "gcs"
    if argv[0].startswith("ray::"):
        title = argv[0].removeprefix("ray::").split(".", 1)[0]
        if title.startswith("ServeReplica:"):  # ServeReplica:<app>:<Deployment>
            return "replica:" + title.rsplit(":", 1)[-1]
        return dict(ACTOR_KINDS).get(title, "ray-other")
    return "dashboard" if any("dashboard" in arg for arg in argv) else "ray-other"


def _rss_bytes(status_path: Path) -> int:
    for line in status_path.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a kernel thread or a zombie


def _processes() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, arguments) of every process readable now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                raw = (entry / "cmdline").read_bytes().decode(errors="replace")
            except (OSError, ValueError, IndexError):  # it ended while being read
                continue
            found[int(entry.name)] = (parent, [arg for arg in raw.split("\0") if arg])
    return found


def cluster_processes(session_dir: str) -> dict[int, list[str]]:
    """pid -> arguments of the cluster's processes on this node: those whose arguments name its
    session directory (gcs_server, raylet, the dashboard and agents) and all their descendants
    (the raylet's workers and actors), so that another Ray cluster on the machine is left out."""
    processes = _processes()
    members = {pid for pid, (_, argv) in processes.items() if any(session_dir in a for a in argv)}
    grew = True
    while grew:
        children = {pid for pid, (parent, _) in processes.items() if parent in members} - members
        members |= children
        grew = bool(children)
    return {pid: processes[pid][1] for pid in members}


def rss_by_kind(session_dir: str, exclude_pids: set[int]) -> dict[str, int]:
    """Kind -> summed resident bytes of the cluster's processes on this node."""
    totals: dict[str, int] = {}
    for pid, argv in cluster_processes(session_dir).items():
        kind = process_kind(argv, session_dir)
        if kind is None or pid in exclude_pids:
            continue
        try:
            totals[kind] = totals.get(kind, 0) + _rss_bytes(Path(f"/proc/{pid}/status"))
        except OSError:
            continue
    return totals


def object_store_bytes() -> tuple[int, int]:
    """(bytes used, objects) in the object stores of the cluster this driver is connected to."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    address = ray._private.worker.global_worker.node.gcs_address
    stats = get_memory_info_reply(get_state_from_address(address)).store_stats
    return int(stats.object_store_bytes_used), int(stats.num_local_objects)


def session_dir() -> str:
    """This driver's Ray session directory (its command lines name it)."""
    import ray

    return ray._private.worker.global_worker.node.get_session_dir_path()


def growth_mib_per_min(samples: list[tuple[float, dict[str, int]]]) -> dict[str, float]:
    """Least-squares slope of each kind's RSS over (seconds, bytes-by-kind) samples, MiB/min; a
    kind missing from a sample (a replaced process) counts from where it appears."""
    kinds = sorted({kind for _, sample in samples for kind in sample} | {"total"})
    slopes = {}
    for kind in kinds:
        points = [(t, sum(s.values()) if kind == "total" else s[kind]) for t, s in samples
                  if kind == "total" or kind in s]  # fmt: skip
        if len(points) < 3:
            continue
        mean_t = sum(t for t, _ in points) / len(points)
        mean_v = sum(v for _, v in points) / len(points)
        spread = sum((t - mean_t) ** 2 for t, _ in points)
        if spread > 0:
            slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / spread
            slopes[kind] = round(slope * 60 / 2**20, 2)
    return slopes
