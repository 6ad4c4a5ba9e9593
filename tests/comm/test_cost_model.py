"""The cost model's picks on hand-made topologies, with the reason for each expectation."""

import math

import pytest

from rayinfer.comm.cost_model import Choice, choose, predict
from rayinfer.comm.published_topologies import pcie_gen4_8gpu
from rayinfer.comm.topology import Topology

ROW_BYTES = 7168 * 2  # one bf16 token of DeepSeek-V3


def uniform_matrix(world_size: int, tokens_per_rank: int) -> list[list[int]]:
    return [[tokens_per_rank // world_size] * world_size for _ in range(world_size)]


def two_nodes_of_four(one_shot_efficiency: float) -> Topology:
    """Two islands of 4 GPUs (fast links inside, 100 GB/s, 5 us) joined by one slow link
    (10 GB/s per pair, 30 us, 16 GB/s shared by all cross traffic); no shared host memory."""
    same = lambda i, j: i // 4 == j // 4
    return Topology.from_matrix(
        [[100.0 if same(i, j) else 10.0 for j in range(8)] for i in range(8)],
        latency_us=[[5.0 if same(i, j) else 30.0 for j in range(8)] for i in range(8)],
        cross_gbps={"0,1": 16.0},
        one_shot_efficiency=one_shot_efficiency,
        is_host_staged_available=False,
    )


@pytest.mark.parametrize("tokens", [128, 1024, 16384])
def test_uniform_fast_links_pick_the_one_shot_exchange(tokens):
    """All pairs at 150 GB/s (NVLink-like): one round pays one latency and no extra hop, and
    the host links (50 GB/s) are slower than the direct ones, so nccl/dist wins everywhere."""
    topo = Topology.from_matrix([[150.0] * 8] * 8, latency_us=5.0, host_gbps=50.0)
    choice = choose(topo, uniform_matrix(8, tokens), ROW_BYTES)
    assert (choice.schedule, choice.transport) == ("nccl", "dist"), choice.reason


@pytest.mark.parametrize("tokens", [8, 128, 1024, 16384])
def test_two_islands_with_a_collapsing_slow_link_pick_hierarchical(tokens):
    """With all-pairs traffic over the slow link collapsing to 30%, one-shot loses; pairwise
    pays 7 rounds of 30 us and leaves the shared link half idle in most rounds; hierarchical
    crosses once per island pair with aggregated messages that fill the link."""
    choice = choose(two_nodes_of_four(0.3), uniform_matrix(8, tokens), ROW_BYTES)
    assert choice.schedule == "hierarchical", choice.reason


def test_two_islands_without_collapse_keep_the_one_shot_exchange():
    """Same islands, but if all-pairs traffic does not collapse, hierarchical's extra hop
    inside the islands costs more than it saves."""
    choice = choose(two_nodes_of_four(1.0), uniform_matrix(8, 1024), ROW_BYTES)
    assert choice.schedule == "nccl", choice.reason


def test_pcie_without_p2p_stages_large_messages_through_host_memory():
    """2 GPUs without P2P: NCCL's shared-memory path moves 23.8 GB/s, each GPU's own host link
    55 GB/s in both directions (shared/device/README.md), so big exchanges go host-staged."""
    topo = Topology.from_matrix([[23.8] * 2] * 2, latency_us=50.0, host_gbps=55.0)
    choice = choose(topo, uniform_matrix(2, 16384), ROW_BYTES)
    assert choice.transport == "host", choice.reason


@pytest.mark.parametrize("tokens", [128, 1024, 4096, 16384])
def test_pcie8_published_figures_predictions(tokens):
    """Every schedule gets a finite prediction on the 8-GPU PCIe box. Dense one-shot P2P is the
    slowest from 1,024 tokens (its collapse), and host staging, which uses every GPU's own
    host link at once, the fastest; the numbers are in benchmarks/RESULTS.md."""
    times = predict(pcie_gen4_8gpu(), uniform_matrix(8, tokens), ROW_BYTES)
    assert set(times) == {
        f"{s}/{t}" for s in ("nccl", "pairwise", "hierarchical") for t in ("dist", "host")
    }
    assert all(math.isfinite(t) and t > 0 for t in times.values())
    if tokens >= 1024:
        assert max(times, key=times.get) == "nccl/dist"
        assert min(times, key=times.get).endswith("/host")


def test_islands_of_the_published_box_are_its_sockets():
    """25 and 18 GB/s are within 60% of the fastest link, 9 GB/s is not."""
    assert pcie_gen4_8gpu().islands == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_caller_choice_overrides_auto():
    auto = choose(two_nodes_of_four(0.3), uniform_matrix(8, 128), ROW_BYTES)
    forced = auto.override(schedule="pairwise")
    assert isinstance(forced, Choice)
    assert (forced.schedule, forced.transport) == ("pairwise", auto.transport)
    assert auto.override() is auto


def test_unequal_islands_rule_out_hierarchical():
    topo = Topology.from_matrix([[10.0] * 3] * 3, islands=[[0, 1], [2]])
    assert not any(k.startswith("hierarchical") for k in predict(topo, uniform_matrix(3, 30), 8))


def test_two_ranks_do_not_penalise_the_one_shot_exchange():
    """With two ranks pairwise and one-shot move the same single message; a fitted one-shot
    efficiency below 1 (0.81 on 2x H200 NVLink) must not make auto leave NCCL."""
    topo = Topology.from_matrix([[300.0] * 2] * 2, latency_us=20.0, one_shot_efficiency=0.81)
    choice = choose(topo, uniform_matrix(2, 4096), ROW_BYTES)
    assert (choice.schedule, choice.transport) == ("nccl", "dist"), choice.reason
