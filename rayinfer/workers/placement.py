"""Where each worker of a group sits in a ParallelPlan, and which collective groups it joins.

Workers are numbered rank = dp_rank * tp + tp_rank: a tensor-parallel group is `tp` consecutive
workers (one data-parallel attention replica); an expert-parallel group is `ep` consecutive
workers. When an EP group spans several DP replicas its ranks hold different tokens, so experts
exchange tokens with dispatch/combine; inside one TP group they sum partial outputs instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayinfer.config import ParallelPlan


@dataclass(frozen=True)
class WorkerPlacement:
    rank: int
    plan: ParallelPlan

    @property
    def tp_rank(self) -> int:
        return self.rank % self.plan.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.plan.tp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.plan.ep

    @property
    def ep_group_index(self) -> int:
        return self.rank // self.plan.ep

    @property
    def tokens_differ_across_ep(self) -> bool:
        return self.plan.ep_group_spans_replicas(self.ep_group_index)

    @property
    def ep_peer_replicas(self) -> list[int]:
        """The data-parallel replica of each rank of this worker's expert-parallel group."""
        first = self.ep_group_index * self.plan.ep
        return [(first + i) // self.plan.tp for i in range(self.plan.ep)]

    @property
    def is_dp_leader(self) -> bool:
        """The worker whose sampled tokens stand for its DP replica."""
        return self.tp_rank == 0

    def group_names(self, prefix: str) -> dict[str, str]:
        """Collective groups this worker joins, in the order every worker joins them."""
        names = {}
        if self.plan.tp > 1:
            names["tp"] = f"{prefix}-tp{self.dp_rank}"
        if self.plan.ep > 1:
            names["ep"] = f"{prefix}-ep{self.ep_group_index}"
        return names


def valid_plans(num_workers: int) -> list[ParallelPlan]:
    plans = []
    for tp in range(1, num_workers + 1):
        if num_workers % tp:
            continue
        for ep in range(1, num_workers + 1):
            if num_workers % ep == 0:
                plans.append(ParallelPlan(tp=tp, dp=num_workers // tp, ep=ep))
    return plans
