"""`ParallelPlan`: how one phase spreads a model over workers (tensor, data and expert
parallel sizes), checked against the model it is to split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayinfer.config_error import ConfigError

if TYPE_CHECKING:
    from rayinfer.config import ModelConfig


@dataclass(frozen=True)
class ParallelPlan:
    """How one phase spreads a model over workers: workers = tp x dp; ep divides workers."""

    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self):
        for key in ("tp", "dp", "ep"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if self.num_workers % self.ep:
            valid = [d for d in range(1, self.num_workers + 1) if self.num_workers % d == 0]
            raise ConfigError(
                f"ep={self.ep} must divide tp*dp={self.num_workers}; valid ep: {valid}"
            )

    @property
    def num_workers(self) -> int:
        return self.tp * self.dp

    @property
    def has_collectives(self) -> bool:
        """Whether the workers talk during a forward (so they must run every step together)."""
        return self.tp > 1 or self.ep > 1

    @property
    def experts_exchange_tokens(self) -> bool:
        """Whether some expert-parallel group spans several data-parallel replicas, whose tokens
        differ, so that MoE layers send tokens between workers."""
        return any(map(self.ep_group_spans_replicas, range(self.num_workers // self.ep)))

    def ep_group_spans_replicas(self, group: int) -> bool:
        """Whether EP group `group` holds workers of several DP replicas (workers are numbered
        dp_rank * tp + tp_rank; an EP group is `ep` consecutive workers)."""
        first = group * self.ep
        return first // self.tp != (first + self.ep - 1) // self.tp

    def check_fits(self, model: ModelConfig, key: str = "parallel") -> None:
        """Fail, naming the key and the sizes that work, when the model cannot be split so."""
        limits = [("tp", self.tp, "num_attention_heads", model.num_attention_heads)]
        if not model.kv_is_replicated:
            limits.append(("tp", self.tp, "num_key_value_heads", model.num_kv_heads))
        if model.is_moe:
            limits.append(("ep", self.ep, "num_experts", model.num_experts))
        for name, size, what, total in limits:
            if total % size:
                valid = [d for d in range(1, total + 1) if total % d == 0]
                raise ConfigError(
                    f"{key}.{name}={size} does not divide {what}={total}; use one of {valid}"
                )
