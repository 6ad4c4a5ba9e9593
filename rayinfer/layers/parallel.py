"""Where a layer sits in a parallel plan: its tensor- and expert-parallel rank and group.

Layers shard their weights by these numbers; with sizes 1 (the default) they are plain layers.
Groups are `LayerGroup`s: the few collectives layers call, over any `ray.util.collective`-style
group (rayinfer's own backend in practice).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rayinfer.exchange_config import AllToAllConfig


class LayerGroup:
    """The collectives layers use, on top of a group with `allreduce`/`allgather` (in place,
    ray.util.collective naming) and, for expert parallelism, `dispatch`/`combine`."""

    def __init__(self, group: Any, rank: int, size: int, all_to_all: AllToAllConfig | None = None):
        self.group = group
        self.rank = rank
        self.size = size
        # Every MoE exchange's options (schedule, transport, use_fp8, dedup; rayinfer.comm.moe),
        # as validated where the user gave them.
        self.all_to_all = all_to_all or AllToAllConfig()
        # Every rank's token count in the current forward, while `tokens_of_step` holds it:
        # MoE layers pass it to dispatch, which then needs no device sync to size the exchange.
        self.tokens_per_rank: list[int] | None = None

    @contextmanager
    def tokens_of_step(
        self, num_tokens: int, device: torch.device, known: list[int] | None = None
    ) -> Iterator[list[int]]:
        """Hold every rank's token count for one forward in `tokens_per_rank`: `known` when the
        caller has it (a WorkerGroup sends it with the step), else learned with one tiny
        all-gather (one host sync, before any of the step's work is queued)."""
        if known is None:
            mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
            known = self.all_gather_concat(mine, 0).tolist()
        elif len(known) != self.size or known[self.rank] != num_tokens:
            raise ValueError(
                f"tokens per rank {known}: rank {self.rank} of {self.size} runs {num_tokens}"
            )
        self.tokens_per_rank = list(known)
        try:
            yield self.tokens_per_rank
        finally:
            self.tokens_per_rank = None

    @contextmanager
    def static_exchange(self, num_tokens: int) -> Iterator[None]:
        """One forward captured in a CUDA graph (or run as one would be): every rank holds
        num_tokens tokens, and the token exchange takes only what a graph can replay: every token
        to every rank (AllToAllConfig.replayable)."""
        configured = self.all_to_all
        self.all_to_all = configured.replayable()
        try:
            with self.tokens_of_step(num_tokens, None, known=[num_tokens] * self.size):
                yield
        finally:
            self.all_to_all = configured

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the group, in place."""
        self.group.allreduce(tensor)

    def all_gather_concat(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's `tensor` (same shape everywhere) along `dim`, in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def dispatch(self, x, topk_ids, topk_weights, num_experts: int, **call):
        """comm's dispatch with this group's AllToAllConfig; `call`: the call's own arguments
        (tokens_per_rank, channel, on_packed, skip_self). local_first is the MoE layer's
        choice, not the exchange's."""
        a2a = self.all_to_all
        return self.group.dispatch(
            x, topk_ids, topk_weights, num_experts=num_experts, use_fp8=a2a.use_fp8,
            dedup=a2a.dedup, schedule=a2a.schedule, transport=a2a.transport, **call,
        )  # fmt: skip

    def combine(self, expert_out, handle, **call):
        """comm's combine over the same all-to-all (it sends the activations' own dtype back,
        as dispatch chose)."""
        a2a = self.all_to_all
        return self.group.combine(
            expert_out, handle, schedule=a2a.schedule, transport=a2a.transport, **call
        )


@dataclass(frozen=True)
class ParallelContext:
    """tp: attention heads and dense layers split; ep: routed experts split.

    `tokens_differ_across_ep` is True when the EP group's ranks hold different tokens (data-
    parallel attention), so experts must exchange tokens (dispatch/combine) rather than sum
    partial outputs of the same tokens (all-reduce).
    """

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: LayerGroup | None = None
    ep_group: LayerGroup | None = None
    tokens_differ_across_ep: bool = False

    @property
    def experts_exchange_tokens(self) -> bool:
        """Whether MoE layers send tokens to other ranks' experts (dispatch/combine)."""
        return self.ep_size > 1 and self.tokens_differ_across_ep

    @property
    def has_collectives(self) -> bool:
        """Whether a forward pass talks to other ranks (so every rank must run it in step)."""
        return self.tp_size > 1 or self.ep_size > 1

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} outside tp_size={self.tp_size}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} outside ep_size={self.ep_size}")


SINGLE = ParallelContext()


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        valid = [d for d in range(1, numerator + 1) if numerator % d == 0]
        raise ValueError(
            f"{what}={numerator} is not divisible by the parallel size {denominator}; "
            f"sizes that divide it: {valid}"
        )
    return numerator // denominator
