"""Whether groups of resource demands can all be placed on a cluster's nodes at once.

Each group (one replica's STRICT_PACK placement group, or the ingress actor) needs its whole
demand on one node; several groups may share a node while its resources last. This is bin
packing with one bin per node, solved exactly by a depth-first search: the start-up check
(node_fit.py) has a few phases and replicas and a few nodes, so the search is small. Two pruning
rules keep it so: equal groups take nodes in increasing order (their order does not matter),
and of nodes left with equal resources only the first is tried.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STEPS = 100_000  # placements tried before the search gives up without a verdict
EPSILON = 1e-6  # Ray counts resources in steps of 1e-4; sums of fractions must still fit


class Undecided(Exception):
    """The search ran past MAX_STEPS."""


def fits(demand: dict[str, float], offered: dict[str, float]) -> bool:
    return all(offered.get(name, 0.0) + EPSILON >= amount for name, amount in demand.items())


def fit_together(
    demands: Sequence[dict[str, float]],
    offers: Sequence[dict[str, float]],
    max_steps: int = MAX_STEPS,
) -> bool | None:
    """Whether every demand can be placed on one of the nodes `offers` (each node's resources)
    at the same time; None when the search gave up after `max_steps` placements."""
    remaining = [dict(offer) for offer in offers]
    # The most constrained first: the groups fewest nodes hold, then the largest.
    order = sorted(
        demands,
        key=lambda d: (sum(fits(d, o) for o in offers), -sum(d.values()), sorted(d.items())),
    )
    steps = [0]

    def place(position: int, lowest_node: int) -> bool:
        if position == len(order):
            return True
        demand = order[position]
        seen_states = set()
        for index in range(lowest_node, len(remaining)):
            node = remaining[index]
            state = tuple(sorted(node.items()))
            if state in seen_states or not fits(demand, node):
                continue
            seen_states.add(state)
            steps[0] += 1
            if steps[0] > max_steps:
                raise Undecided
            _take(node, demand, sign=-1.0)
            is_next_equal = position + 1 < len(order) and order[position + 1] == demand
            if place(position + 1, index if is_next_equal else 0):
                return True
            _take(node, demand, sign=1.0)
        return False

    try:
        return place(0, 0)
    except Undecided:
        return None


def _take(node: dict[str, float], demand: dict[str, float], sign: float) -> None:
    for name, amount in demand.items():
        node[name] = node.get(name, 0.0) + sign * amount
