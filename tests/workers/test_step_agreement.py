"""What a worker group's driver tells every worker each step, so that ranks that talk agree
without talking first: each expert-parallel rank's token count (no all-gather in the step), and
the options under which a decode graph's token exchange can be replayed."""

import pytest
import torch

from rayinfer.config import ParallelPlan
from rayinfer.exchange_config import AllToAllConfig
from rayinfer.graph_config import graph_blocker
from rayinfer.layers.parallel import LayerGroup
from rayinfer.workers.placement import WorkerPlacement, valid_plans


class GatherCounter:
    """A collective group that only counts the all-gathers asked of it."""

    def __init__(self, counts: list[int]):
        self.counts, self.gathers = counts, 0

    def allgather(self, parts, tensor):
        self.gathers += 1
        for part, count in zip(parts, self.counts):
            part.fill_(count)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_the_plan_and_the_placements_agree_on_who_exchanges_tokens(workers):
    for plan in valid_plans(workers):
        placements = [WorkerPlacement(rank, plan) for rank in range(workers)]
        exchanging = any(p.tokens_differ_across_ep for p in placements)
        assert plan.experts_exchange_tokens == exchanging, plan
        assert plan.has_collectives == (plan.tp > 1 or plan.ep > 1)
        for placement in placements:
            peers = placement.ep_peer_replicas  # the DP replica of each EP rank, in rank order
            first = placement.ep_group_index * plan.ep
            assert peers == [WorkerPlacement(first + i, plan).dp_rank for i in range(plan.ep)]
            assert peers[placement.ep_rank] == placement.dp_rank


def test_known_token_counts_need_no_gather_and_are_checked():
    group = GatherCounter([3, 5])
    layers = LayerGroup(group, rank=1, size=2)
    with layers.tokens_of_step(5, torch.device("cpu"), known=[3, 5]) as tokens:
        assert tokens == [3, 5] and layers.tokens_per_rank == [3, 5]
    assert group.gathers == 0 and layers.tokens_per_rank is None
    with layers.tokens_of_step(5, torch.device("cpu")) as tokens:  # unknown: gathered once
        assert tokens == [3, 5]
    assert group.gathers == 1
    with pytest.raises(ValueError, match=r"tokens per rank \[5, 3\]: rank 1 of 2 runs 5"):
        with layers.tokens_of_step(5, torch.device("cpu"), known=[5, 3]):
            pass


@pytest.mark.parametrize(
    "configured, static",
    [
        ({}, {"dedup": False, "transport": "dist", "schedule": "nccl"}),
        ({"transport": "dist", "use_fp8": True}, {"dedup": False, "transport": "dist",
                                                  "schedule": "nccl", "use_fp8": True}),
        ({"schedule": "pairwise", "dedup": None}, {"dedup": False, "transport": "dist",
                                                   "schedule": "pairwise"}),
        ({"transport": "host"}, {"dedup": False, "transport": "host", "schedule": "nccl"}),
    ],
)  # fmt: skip
def test_a_graph_forward_exchanges_every_token_over_replayable_options(configured, static):
    configured = AllToAllConfig(**configured)
    layers = LayerGroup(GatherCounter([0, 0]), rank=0, size=2, all_to_all=configured)
    with layers.static_exchange(8):
        assert layers.all_to_all == AllToAllConfig(**static)
        assert layers.tokens_per_rank == [8, 8]
    assert layers.all_to_all == configured and layers.tokens_per_rank is None


def test_graph_blocker_names_the_options_that_cannot_be_replayed():
    ep = ParallelPlan(dp=2, ep=2)
    host, dedup = AllToAllConfig(transport="host"), AllToAllConfig(dedup=True)
    assert graph_blocker(ep) is None
    assert graph_blocker(ep, host) is None  # replays with two-state flags
    assert "decode.all_to_all.dedup=true" in graph_blocker(ep, dedup, prefix="decode.")
    assert graph_blocker(ParallelPlan(tp=2, ep=2), dedup) is None  # all-reduce
    cpu_driven = AllToAllConfig.of({"transport": "host", "host": {"protocol": "cpu"}})
    assert "all_to_all.host.protocol=cpu" in graph_blocker(ep, cpu_driven)
    dist_cpu = AllToAllConfig.of({"transport": "dist", "host": {"protocol": "cpu"}})
    assert graph_blocker(ep, dist_cpu) is None
