"""Topology: hand-written matrices, islands, JSON, and `nvidia-smi topo -m` parsing."""

import pytest

from rayinfer.comm import nvidia_smi
from rayinfer.comm.probe import hardware_key, islands_from_links
from rayinfer.comm.topology import Topology, find_islands

TOPO_M = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tPIX\tSYS\tSYS\t0-31\t0\t\tN/A
GPU1\tPIX\t X \tSYS\tSYS\t0-31\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tNV4\t32-63\t1\t\tN/A
GPU3\tSYS\tSYS\tNV4\t X \t32-63\t1\t\tN/A

Legend:
  X    = Self
"""


P2P_R = """\
 \tGPU0\tGPU1\tGPU2\tGPU3\t
 GPU0\tX\tOK\tNS\tNS\t
 GPU1\tOK\tX\tNS\tNS\t
 GPU2\tNS\tNS\tX\tOK\t
 GPU3\tNS\tNS\tOK\tX\t

Legend:
  X    = Self
"""


def test_parse_topo_matrix_and_islands():
    table = nvidia_smi.parse_gpu_matrix(TOPO_M)
    assert table["GPU0"]["GPU1"] == "PIX" and table["GPU2"]["GPU3"] == "NV4"


def test_links_and_peer_access_of_the_ranks_gpus(monkeypatch):
    """Ranks 0..2 on GPUs 3, 1, 0: tables are re-indexed by rank."""
    fake = {"-m": TOPO_M, "-p2p": P2P_R}
    monkeypatch.setattr(nvidia_smi, "run", lambda cmd: fake[cmd[2]])
    links = nvidia_smi.links_between([3, 1, 0])
    assert links == (("X", "SYS", "SYS"), ("SYS", "X", "PIX"), ("SYS", "PIX", "X"))
    assert islands_from_links(links) == [[0], [1, 2]]
    access = nvidia_smi.peer_access([3, 1, 0])
    assert access == ((False, False, False), (False, False, True), (False, True, False))
    assert nvidia_smi.links_between([7]) is None  # a GPU nvidia-smi does not list


def test_find_islands_groups_fast_links():
    bw = [[0, 25, 9, 9], [25, 0, 9, 9], [9, 9, 0, 24], [9, 9, 24, 0]]
    assert find_islands(bw) == [[0, 1], [2, 3]]
    assert find_islands([[0, 20, 19], [20, 0, 18], [19, 18, 0]]) == [[0, 1, 2]]


def test_json_round_trip():
    topo = Topology.from_matrix([[10.0, 5.0], [5.0, 10.0]], cross_gbps={"0,1": 4.0}, note="x")
    assert Topology.from_json(topo.to_json()) == topo


def test_islands_must_cover_every_rank_once():
    with pytest.raises(ValueError, match="cover ranks"):
        Topology.from_matrix([[1.0] * 3] * 3, islands=[[0, 1]])


def test_hardware_key_depends_on_world_size_and_nccl_settings(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    plain = hardware_key(2)
    assert hardware_key(4) != plain
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert hardware_key(2) != plain
