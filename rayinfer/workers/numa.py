"""A GPU worker's CPUs: bound to the NUMA node its GPU hangs off, where the machine has several.

On a two-socket PCIe server each GPU sits behind one socket. The host-staged all-to-all copies
through pinned host memory that the sending rank allocates (comm/shm.py): Linux places those pages
on the node of the CPU that first touches them, so a worker the scheduler happened to start on the
far socket stages every exchange across the socket link, and a restarted one may land elsewhere.
NCCL binds its own threads to the GPU's node for the same reason. Here each worker binds all its
threads, before it loads weights or makes its staging memory, to the CPUs of its GPU's node that
it may use; on one-node machines (and CPU workers) nothing changes.

The node and its CPUs come from sysfs (`/sys/bus/pci/devices/<bus id>/numa_node`,
`/sys/devices/system/node/node<n>/cpulist`), the GPU's bus id from nvidia-smi. Anything missing
or odd leaves the affinity alone. ProcessConfig.numa_bind=False switches it off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from rayinfer.comm import nvidia_smi

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NumaBinding:
    node: int | None  # the GPU's NUMA node (None: unknown)
    cpus: tuple[int, ...]  # the CPUs the process now runs on
    bound: bool  # whether this call changed the affinity
    reason: str  # why it did or did not


def parse_cpulist(text: str) -> list[int]:
    """sysfs CPU list ("0-3,8,10-11") -> [0, 1, 2, 3, 8, 10, 11]; "" -> []."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def sysfs_bus_id(nvidia_smi_bus_id: str) -> str:
    """nvidia-smi's "00000000:18:00.0" -> sysfs's "0000:18:00.0" (4-digit domain, lower case)."""
    domain, _, rest = nvidia_smi_bus_id.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def nodes_with_cpus(sysfs: Path) -> dict[int, list[int]]:
    """{node: its CPUs} for every NUMA node that has CPUs."""
    nodes = {}
    for path in sorted((sysfs / "devices/system/node").glob("node[0-9]*")):
        cpulist = path / "cpulist"
        cpus = parse_cpulist(cpulist.read_text()) if cpulist.exists() else []
        if cpus:
            nodes[int(path.name.removeprefix("node"))] = cpus
    return nodes


def gpu_node(bus_id: str, sysfs: Path) -> int | None:
    """The NUMA node sysfs gives for this PCI device, or None (-1: the firmware does not say)."""
    path = sysfs / "bus/pci/devices" / sysfs_bus_id(bus_id) / "numa_node"
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def my_gpu_bus_id() -> str | None:
    """nvidia-smi's PCI bus id of this process's current GPU, or None."""
    index = nvidia_smi.my_gpu_index()
    if index is None:
        return None
    query = ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"]
    for line in nvidia_smi.run(query).splitlines():
        smi_index, _, bus_id = line.partition(",")
        if smi_index.strip() == str(index):
            return bus_id.strip()
    return None


def choose_cpus(
    node: int | None, nodes: dict[int, list[int]], allowed: set[int]
) -> tuple[list[int], str]:
    """The CPUs to bind to ([] to leave the affinity alone) and why."""
    if len(nodes) < 2:
        return [], "one NUMA node"
    if node is None or node not in nodes:
        return [], "the GPU's NUMA node is unknown"
    cpus = [cpu for cpu in nodes[node] if cpu in allowed]
    if not cpus:
        return [], f"none of node {node}'s CPUs is allowed here"
    if set(cpus) == allowed:
        return [], f"already on node {node}'s CPUs"
    return cpus, f"bound to node {node}"


def bind_to_gpu_node(
    bus_id: str | None = None, sysfs: Path = Path("/sys"), enabled: bool = True
) -> NumaBinding:
    """Bind every thread of this process to the allowed CPUs of its GPU's NUMA node (see the
    module docstring); bus_id: the GPU's (default: this process's current GPU, by nvidia-smi).
    enabled False (ProcessConfig.numa_bind) leaves the affinity alone."""
    allowed = os.sched_getaffinity(0)
    if not enabled:
        return NumaBinding(None, tuple(sorted(allowed)), False, "process.numa_bind=false")
    nodes = nodes_with_cpus(sysfs)
    if len(nodes) < 2:  # the common case costs no nvidia-smi call
        return NumaBinding(None, tuple(sorted(allowed)), False, "one NUMA node")
    bus_id = bus_id or my_gpu_bus_id()
    node = gpu_node(bus_id, sysfs) if bus_id else None
    cpus, reason = choose_cpus(node, nodes, allowed)
    if not cpus:
        return NumaBinding(node, tuple(sorted(allowed)), False, reason)
    for thread in os.listdir("/proc/self/task"):  # every thread, not only the calling one
        try:
            os.sched_setaffinity(int(thread), cpus)
        except OSError:  # a thread that has ended meanwhile
            continue
    logger.info("worker pid %d: %s (CPUs %s)", os.getpid(), reason, cpus)
    return NumaBinding(node, tuple(cpus), True, reason)
