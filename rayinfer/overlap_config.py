"""How the two-batch overlap splits a step and where the shared experts run beside the token
exchange (layers/two_batch_overlap.py, layers/side_stream.py): `OverlapConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rayinfer.config import ConfigError
from rayinfer.exchange_config import check_choice

# Where each lane's shared experts start, as (lane A beside its combine, lane B beside its
# combine); else beside the lane's dispatch. Per layer the GPU has one lane's compute to put
# under each exchange: B's attention under A's dispatch, A's experts under B's dispatch, B's
# experts under A's combine, and only A's next attention (the smaller half of a cut prompt's: it
# reads its own half alone) under B's combine, the largest transfer.
SHARED_EXPERTS_PLACES = {
    "dispatch": (False, False),
    "second-at-combine": (False, True),
    "combine": (True, True),
}
SHARED_EXPERTS_NAMES = tuple(SHARED_EXPERTS_PLACES)
# From how many tokens per rank a prefill captured in a CUDA graph
# (workers/runner/prefill_graphs.py) runs as two micro-batches. A replay queues no host work, so
# the eager threshold's reason (two lanes double the host's launches,
# layers/two_batch_overlap.MIN_TOKENS_TO_OVERLAP_ON_CUDA) is gone: 2x H200, DeepSeek-V2-Lite
# shapes, dp=2 ep=2 host-staged FP8, a 4k prompt from a graph runs 1.43x transformers with the
# overlap and 1.25x without it (benchmarks/RESULTS.md, prefill thresholds).
DEFAULT_GRAPH_OVERLAP_FROM = 2048
# Decode-sized calls keep the plain order: the side stream was measured on prefill only.
DEFAULT_BESIDE_FROM_TOKENS = 256


def _check_tokens(key: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"{key}={value!r}; use a number of tokens >= 0, or None (never)")


@dataclass(frozen=True)
class OverlapConfig:
    """first_share: the first micro-batch's share of a step's tokens, in (0, 1) (causal
    attention makes halves unequal: the second half of a long prompt attends to the whole
    prompt, 3/4 of the attention work); every rank must run with the same share.
    graph_overlap_from: tokens per rank from which a prefill captured in a graph splits into two
    lanes (None: never).
    shared_experts: where each lane's shared experts start: "dispatch" (beside its dispatch),
    "second-at-combine" (the second lane's beside its combine) or "combine" (both).
    shared_experts_beside_from: the fewest tokens with which the shared experts run on a side
    stream beside the exchange (None: never, the plain order everywhere)."""

    # The Serve app's config (pydantic) validates this dataclass field by field and forbids
    # unknown keys; __post_init__ checks it either way.
    __pydantic_config__ = {"extra": "forbid"}

    first_share: float = 0.5
    graph_overlap_from: int | None = DEFAULT_GRAPH_OVERLAP_FROM
    shared_experts: Literal[SHARED_EXPERTS_NAMES] = "dispatch"
    shared_experts_beside_from: int | None = DEFAULT_BESIDE_FROM_TOKENS

    def __post_init__(self):
        share = self.first_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise ConfigError(
                f"overlap.first_share={share!r}; use a fraction between 0 and 1 (e.g. 0.5)"
            )
        _check_tokens("overlap.graph_overlap_from", self.graph_overlap_from)
        check_choice("overlap.shared_experts", self.shared_experts, SHARED_EXPERTS_NAMES)
        _check_tokens("overlap.shared_experts_beside_from", self.shared_experts_beside_from)

    def first_micro_batch_tokens(self, num_tokens: int) -> int:
        """How many of a T-token step's tokens (in order) the first micro-batch takes."""
        return int(num_tokens * self.first_share)

    def micro_batch_sizes(self, num_tokens: int) -> tuple[int, int]:
        """Tokens each micro-batch of a T-token step computes (an empty one computes one
        placeholder token): every rank derives its peers' micro-batch sizes from their step
        sizes."""
        first = self.first_micro_batch_tokens(num_tokens)
        return max(first, 1), max(num_tokens - first, 1)

    def overlaps_in_graph(self, num_tokens: int) -> bool:
        """Whether a captured prefill of num_tokens tokens per rank splits into two lanes."""
        return self.graph_overlap_from is not None and num_tokens >= self.graph_overlap_from

    @property
    def shared_experts_beside_combine(self) -> tuple[bool, bool]:
        """Per lane, whether its shared experts start beside its combine (else its dispatch)."""
        return SHARED_EXPERTS_PLACES[self.shared_experts]


DEFAULT_OVERLAP = OverlapConfig()
