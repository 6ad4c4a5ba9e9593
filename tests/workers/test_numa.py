"""Binding a GPU worker to its GPU's NUMA node (workers/numa.py), on a hand-made sysfs tree."""

import os

import pytest

from rayinfer.workers import numa


def make_sysfs(root, nodes: dict[int, str], gpu_bus: str, gpu_node: int):
    for node, cpulist in nodes.items():
        folder = root / "devices/system/node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpulist + "\n")
    device = root / "bus/pci/devices" / gpu_bus
    device.mkdir(parents=True)
    (device / "numa_node").write_text(f"{gpu_node}\n")
    return root


def test_cpu_lists_and_bus_ids_read_as_sysfs_writes_them():
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.parse_cpulist("") == []
    assert numa.sysfs_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert numa.sysfs_bus_id("0000000A:C1:00.0") == "000a:c1:00.0"


def test_which_cpus():
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert numa.choose_cpus(1, nodes, set(range(8))) == ([4, 5, 6, 7], "bound to node 1")
    assert numa.choose_cpus(1, nodes, {4, 5, 6, 7})[0] == []  # already there
    assert numa.choose_cpus(1, nodes, {0, 1})[0] == []  # none of node 1's CPUs allowed
    assert numa.choose_cpus(1, nodes, {0, 1, 4})[0] == [4]  # only the allowed ones
    assert numa.choose_cpus(None, nodes, set(range(8)))[1] == "the GPU's NUMA node is unknown"
    assert numa.choose_cpus(0, {0: [0, 1]}, {0, 1})[1] == "one NUMA node"


def test_one_node_machines_and_the_switch_leave_the_affinity_alone(tmp_path):
    from rayinfer.config import ConfigError
    from rayinfer.process_config import ProcessConfig

    sysfs = make_sysfs(tmp_path, {0: "0-63"}, "0000:18:00.0", 0)
    two_nodes = make_sysfs(tmp_path / "two", {0: "0-1", 1: "2-3"}, "0000:18:00.0", 1)
    before = os.sched_getaffinity(0)
    assert not numa.bind_to_gpu_node("00000000:18:00.0", sysfs).bound
    off = numa.bind_to_gpu_node("00000000:18:00.0", two_nodes, enabled=False)
    assert not off.bound and off.reason == "process.numa_bind=false"
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ConfigError, match=r"process\.numa_bind='yes'; use one of True, False"):
        ProcessConfig(numa_bind="yes")


def test_two_nodes_bind_every_thread_to_the_gpus_node(tmp_path):
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs to bind to one of them")
    first, last = min(before), max(before)
    sysfs = make_sysfs(tmp_path, {0: str(first), 1: str(last)}, "0000:c1:00.0", 1)
    try:
        binding = numa.bind_to_gpu_node("00000000:C1:00.0", sysfs)
        assert binding.bound and binding.node == 1 and binding.cpus == (last,)
        for thread in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(thread)) == {last}
    finally:
        for thread in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(thread), before)
            except OSError:
                pass
