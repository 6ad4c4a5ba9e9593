"""The exact search that decides whether pinned replicas fit the nodes all at once
(rayinfer/deployments/node_packing.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from rayinfer.deployments.node_packing import fit_together


def units(*amounts: float) -> list[dict[str, float]]:
    return [{"x": amount} for amount in amounts]


@pytest.mark.parametrize(
    "demands, offers, expected",
    [
        (units(1, 1), units(1, 1), True),  # one each
        (units(1, 1), units(1), False),  # both want the one node
        (units(), units(1), True),
        (units(1), units(), False),  # no node at all
        (units(0.6, 0.6, 0.6, 0.6, 0.6), units(3), True),  # sums of fractions fit exactly
        # First-fit by size puts 5 and 4 together and strands the 2; only 5+3+2 | 4+3+3 works.
        (units(5, 4, 3, 3, 3, 2), units(10, 10), True),
        (units(5, 4, 3, 3, 3, 3), units(10, 10), False),  # 21 > 20
    ],
)
def test_one_resource(demands, offers, expected):
    assert fit_together(demands, offers) is expected


def test_every_resource_of_a_group_must_fit_on_its_one_node():
    prefill = {"CPU": 0.6, "box": 1.0}
    ingress = {"head": 0.01}
    head = {"CPU": 1.0, "head": 1.0}
    box_node = {"CPU": 0.5, "box": 8.0}  # the box, but too few CPUs for the group
    assert fit_together([prefill, ingress], [head, box_node]) is False
    assert fit_together([prefill, ingress], [head, {**box_node, "CPU": 0.6}]) is True
    assert fit_together([prefill, ingress], [{**head, "box": 1.0}]) is True  # both on the head


def test_groups_that_compete_for_two_resources_of_two_nodes():
    """Decode fits only the node with more CPU; prefill must then take the other."""
    prefill, decode = {"CPU": 1.0, "box": 1.0}, {"CPU": 2.0, "box": 1.0}
    small, large = {"CPU": 1.0, "box": 1.0}, {"CPU": 2.0, "box": 1.0}
    assert fit_together([prefill, decode], [large, small]) is True
    assert fit_together([prefill, decode, {"box": 1.0}], [large, small]) is False


def test_a_search_past_its_step_budget_gives_no_verdict():
    assert fit_together(units(5, 4, 3, 3, 3, 2), units(10, 10), max_steps=3) is None
    assert fit_together(units(1), units(1), max_steps=1) is True


def fits_by_brute_force(demands, offers) -> bool:
    for nodes in itertools.product(range(len(offers)), repeat=len(demands)):
        used = [dict.fromkeys(offer, 0.0) for offer in offers]
        for demand, node in zip(demands, nodes):
            for name, amount in demand.items():
                used[node][name] = used[node].get(name, 0.0) + amount
        if all(
            offer.get(name, 0.0) + 1e-6 >= amount
            for offer, use in zip(offers, used)
            for name, amount in use.items()
        ):
            return True
    return False


@pytest.mark.parametrize("seed", range(40))
def test_the_pruned_search_agrees_with_trying_every_placement(seed):
    rng = random.Random(seed)
    names = ("CPU", "box", "head")
    kinds = [{n: rng.choice((0.5, 1.0, 2.0)) for n in rng.sample(names, 2)} for _ in range(3)]
    demands = [dict(rng.choice(kinds)) for _ in range(rng.randint(1, 6))]
    offers = [{n: float(rng.randint(0, 4)) for n in names} for _ in range(rng.randint(1, 3))]
    assert fit_together(demands, offers) is fits_by_brute_force(demands, offers)
