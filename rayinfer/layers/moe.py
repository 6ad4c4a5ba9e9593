"""Mixture-of-Experts block shared by every MoE family: router + routed experts + shared experts.

Build one per MoE layer with a `RoutingMethod` that states how the family routes:

  DeepSeek-V3 (`noaux_tc`):   RoutingMethod(top_k=num_experts_per_tok, scoring="sigmoid",
                                  renormalize=norm_topk_prob, num_groups=n_group,
                                  topk_groups=topk_group, use_correction_bias=True,
                                  routed_scaling_factor=routed_scaling_factor)
  DeepSeek-V2 (`group_limited_greedy`; `greedy` is num_groups=1):
                              RoutingMethod(top_k, "softmax", renormalize=norm_topk_prob,
                                  num_groups=n_group, topk_groups=topk_group,
                                  routed_scaling_factor=routed_scaling_factor)
  DeepSeek-V4 (score-routed layers; build MoE(..., swiglu_limit=swiglu_limit)):
                              RoutingMethod(top_k=num_experts_per_tok, scoring="sqrtsoftplus",
                                  renormalize=True, use_correction_bias=True,
                                  routed_scaling_factor=routed_scaling_factor)
  Qwen3-MoE:                  RoutingMethod(top_k=num_experts_per_tok, scoring="softmax",
                                  renormalize=norm_topk_prob)
  Mixtral (softmax over the top-k logits == renormalized softmax):
                              RoutingMethod(top_k=num_experts_per_tok, scoring="softmax",
                                  renormalize=True)

  moe = MoE(hidden_size, num_experts, moe_intermediate_size, routing,
            shared_intermediate_size=moe_intermediate_size * n_shared_experts (0: none),
            parallel=parallel)

Parameter names follow the checkpoints: `gate.weight` [E, H] (and `gate.e_score_correction_bias`
[E]), `experts.w13` / `experts.w2` (stacked), `shared_experts.gate_up_proj` / `.down_proj`.
Routed experts load through `layers/fused_experts.py` (`parse_expert_weight_name`, then
`moe.experts.load_expert_weight(expert_id, part, tensor)`), shared experts through
`GatedMLP.load_weight(projection_name, tensor)` (`layers/mlp.py`).

FP8 weights (`fp8=True`, DeepSeek-V3 checkpoints served with fp8_weights): the routed experts keep
block-scaled float8_e4m3fn weights and run the FP8 fused MoE; the shared experts are FP8 linear
layers. The scales load through the same calls with `is_scale=True` (checkpoint
`...weight_scale_inv`). MXFP4 routed experts (`expert_weight_format="mxfp4"`, DeepSeek-V4-Flash as
shipped) stay packed: e2m1 bytes and UE8M0 byte scales, run by the MXFP4 fused MoE.

Expert parallelism: rank r holds experts [r * E_local, (r + 1) * E_local) of E = ep_size * E_local.
When every EP rank holds the same tokens, each computes its experts' share and the shares are
summed over the EP group; when ranks hold different tokens (`tokens_differ_across_ep`), tokens are
sent to their experts' ranks with `dispatch` and brought back with `combine`. The shared experts,
replicated, run on a side stream while the tokens travel (layers/side_stream.py) and are added
afterwards. With `all_to_all.local_first` and the all-tokens exchange, a rank's experts also run
there on its own tokens, from x; the exchange then carries those tokens to the other ranks only,
and combine adds this share in its summing pass. Tensor
parallelism splits the shared experts' intermediate dimension; routed experts are not split by TP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from rayinfer.comm.moe import sends_all_tokens
from rayinfer.kernels import ops
from rayinfer.layers import side_stream
from rayinfer.layers.fused_experts import FusedExperts
from rayinfer.layers.layer_options import UsesKernelBackends, UsesOverlap
from rayinfer.layers.mlp import GatedMLP, copy_checked
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.layers.side_stream import StartOnce


@dataclass(frozen=True)
class RoutingMethod:
    """How a family turns router logits into top-k experts; see the module docstring."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    use_correction_bias: bool = False
    routed_scaling_factor: float = 1.0


class Router(nn.Module):
    """Router logits in float32: `weight` [E, H], plus the noaux_tc correction bias [E].

    The weight is kept in float32 whatever the model's dtype (a bf16 checkpoint's values are
    upcast once at load): casting it on every call cost a launch per MoE layer and step."""

    def __init__(self, hidden_size: int, num_experts: int, use_correction_bias: bool):
        super().__init__()
        weight = torch.empty(num_experts, hidden_size, dtype=torch.float32)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = copy_checked
        self.e_score_correction_bias = None
        if use_correction_bias:
            bias = torch.zeros(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            self.e_score_correction_bias.weight_loader = copy_checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] float32
        return ops.router_logits(x, self.weight)


# all_to_all.local_first=None runs a rank's experts on its own tokens beside the exchange from
# this many tokens on every rank. `bench parallel` (host:fp8:nolocal against host:fp8:local) on
# 2x H200 host-staged, DeepSeek-V2-Lite shapes, two-batch overlap, in transformers' tok/s per
# GPU, without against with: micro-batches of 16k tokens 1.45x against 1.56x; of 8k a tie, or a
# loss where the step becomes host-bound; of 2k 1.18x against 0.78x (the grouped GEMMs split in
# two halves too small to run well, and the MoE's host work doubles).
LOCAL_FIRST_MIN_TOKENS = 16384
# Inside a prefill CUDA graph the MoE's host work costs nothing, so local_first pays from
# smaller calls: the same benchmark with graphs, 8k prompts (two lanes of 4k tokens) 1.42x
# without against 1.54x with; 4k prompts (lanes of 2k) 1.51x against 1.35x
# (benchmarks/RESULTS.md, prefill thresholds).
LOCAL_FIRST_MIN_TOKENS_IN_GRAPH = 4096


def local_first_min_tokens() -> int:
    """all_to_all.local_first=None's threshold (tokens of every rank's call): lower while a CUDA
    graph is captured (the same on every rank: they capture the same buckets)."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return LOCAL_FIRST_MIN_TOKENS_IN_GRAPH if capturing else LOCAL_FIRST_MIN_TOKENS


class Received(NamedTuple):
    """What `dispatch_tokens` hands to `experts_and_combine`."""

    result: Any  # comm.moe.DispatchResult
    # all_to_all.local_first: the start of this rank's experts on its own tokens, from x (a
    # side_stream handle on their [T, H] share); the exchange carried those tokens to the other
    # ranks only. None otherwise.
    local: StartOnce | None
    shared: StartOnce  # the shared experts' start (see `start_shared_experts`)


def _in_order(*starts: StartOnce | None) -> Callable[[], None]:
    def start_all() -> None:
        for start in starts:
            if start is not None:
                start()

    return start_all


class MoE(UsesKernelBackends, UsesOverlap, nn.Module):
    """Router + routed experts + optional shared experts; see the module docstring."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        routing: RoutingMethod,
        shared_intermediate_size: int = 0,
        parallel: ParallelContext = SINGLE,
        fp8: bool = False,
        swiglu_limit: float | None = None,  # DeepSeek-V4: routed and shared experts both clamp
        expert_weight_format: str | None = None,  # FusedExperts' weight_format ("mxfp4": V4)
    ):
        super().__init__()
        self.routing = routing
        self.parallel = parallel
        self.gate = Router(hidden_size, num_experts, routing.use_correction_bias)
        self.experts = FusedExperts(
            num_experts, hidden_size, intermediate_size, parallel, fp8 and not expert_weight_format,
            swiglu_limit, expert_weight_format,
        )  # fmt: skip
        self.shared_experts = None
        if shared_intermediate_size:
            self.shared_experts = GatedMLP(
                hidden_size, shared_intermediate_size, parallel, fp8, swiglu_limit
            )

    def route(self, x: torch.Tensor) -> ops.MoeRouting:  # [T, H] -> ([T, K], [T, K])
        method = self.routing
        return ops.moe_routing(
            self.gate(x),
            method.top_k,
            scoring=method.scoring,
            renormalize=method.renormalize,
            num_groups=method.num_groups,
            topk_groups=method.topk_groups,
            correction_bias=self.gate.e_score_correction_bias,
            routed_scaling_factor=method.routed_scaling_factor,
            backends=self.kernels,
        )

    def forward(self, x: torch.Tensor, routing: ops.MoeRouting | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; routing: the experts chosen elsewhere (DeepSeek-V4's hash
        layers), else the router's."""
        routing = routing or self.route(x)
        if self.exchanges_tokens:
            return self._exchange_with_experts(x, routing)
        out = self.experts(x, routing.topk_weights, routing.topk_ids)  # [T, H]
        if self.parallel.ep_size > 1:  # every EP rank saw the same tokens: sum the shares
            self.parallel.ep_group.all_reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _exchange_with_experts(self, x: torch.Tensor, routing: ops.MoeRouting) -> torch.Tensor:
        """Send each token once to every EP rank holding one of its experts; sum the results
        and add the shared experts', run while the tokens travel."""
        tokens_per_rank = self.parallel.ep_group.tokens_per_rank
        return self.experts_and_combine(self.dispatch_tokens(x, tokens_per_rank, routing=routing))

    # --- stages for overlapping the exchange with other work (two-batch overlap) ---------------
    # Each stage queues its work on the caller's current stream and returns. The exchanges are
    # stream-ordered (the host-staged transport runs on its own copy streams and makes the
    # caller's stream wait), so work queued on another stream runs while tokens travel.
    @property
    def exchanges_tokens(self) -> bool:
        """Whether forward sends tokens to other ranks (dispatch/combine) and so can overlap."""
        return self.parallel.experts_exchange_tokens

    def dispatch_tokens(
        self,
        x: torch.Tensor,
        tokens_per_rank: list[int] | None = None,
        channel: int = 0,
        shared_beside_dispatch: bool = True,
        routing: ops.MoeRouting | None = None,
    ) -> Received:
        """Route [T, H] tokens (unless `routing` is given) and send each to the EP ranks holding
        its experts; returns what arrived, for `experts_and_combine`. The shared
        experts start once the rows are packed (beside the dispatch), or with
        shared_beside_dispatch=False once the routed experts are queued (beside the combine).
        tokens_per_rank: every EP rank's T for this call, when known (no device sync then);
        channel: the exchange pipeline to queue on (see RayinferGroup.all_to_all)."""
        routing = routing or self.route(x)
        shared = StartOnce(lambda: self.start_shared_experts(x))
        local = self._local_experts(x, routing, tokens_per_rank)
        received = self.parallel.ep_group.dispatch(
            x,
            routing.topk_ids,
            routing.topk_weights,
            num_experts=self.experts.num_experts,
            tokens_per_rank=tokens_per_rank,
            channel=channel,
            on_packed=_in_order(local, shared if shared_beside_dispatch else None),
            skip_self=local is not None,
        )  # .x [R, H]; .topk_ids [R, K] local to this rank, -1 elsewhere
        return Received(received, local, shared)

    def experts_and_combine(self, received: Received, channel: int = 0) -> torch.Tensor:
        """Run this rank's experts on what arrived, start the shared experts if they have not
        started yet, send the results back and sum them with the shared experts' (and, with
        local_first, this rank's own share): the block's output [T, H]. What ran beside is added
        in combine's summing pass."""
        result, local, shared = received
        expert_out = self.experts.run(result.x, result.topk_weights, result.topk_ids)  # [R, H]
        addends = [] if local is None else [local.handle().result()]  # [T, H] each
        shared_handle = shared.handle()
        if shared_handle is not None and shared_handle.runs_beside:
            addends.append(shared_handle.result())  # ready, or nearly: join it here
            shared_handle = None
        combined = self.parallel.ep_group.combine(
            expert_out, result.handle, channel=channel, addends=tuple(addends)
        )
        return self.finish(shared_handle, combined)

    def _local_experts(self, x, routing, tokens_per_rank) -> StartOnce | None:
        """With all_to_all.local_first (True, or None and every rank's call at least
        local_first_min_tokens(): the same choice on every rank) and the all-tokens exchange,
        this rank's experts on its own tokens, to start beside the exchange (which then skips
        this rank); else None."""
        group = self.parallel.ep_group
        options = group.all_to_all
        choice = options.local_first
        if choice is False or tokens_per_rank is None:
            return None
        if choice is None and min(tokens_per_rank) < local_first_min_tokens():
            return None
        top_k, world = routing.topk_ids.shape[1], group.size
        if not sends_all_tokens(
            self.experts.num_experts, top_k, world, tokens_per_rank, options.dedup
        ):
            return None

        def start():
            def own_experts(x):  # [T, H] -> [T, H]: only this rank's experts' share
                return self.experts(x, routing.topk_weights, routing.topk_ids)

            reads = (routing.topk_weights, routing.topk_ids)
            beside_from = self.overlap.shared_experts_beside_from
            return side_stream.later(own_experts, x, True, reads, beside_from)  # no collective

        return StartOnce(start)

    def start_shared_experts(self, x: torch.Tensor):
        """The shared experts' output on [T, H] tokens, as a handle for `finish`: queued now on a
        side stream where they can run while tokens travel (where this layer exchanges tokens
        and no collective runs inside them, tp_size 1; see side_stream.later for the rest), else
        computed in `finish`. None without shared experts."""
        if self.shared_experts is None:
            return None
        may_run_beside = self.exchanges_tokens and self.parallel.tp_size == 1
        beside_from = self.overlap.shared_experts_beside_from
        return side_stream.later(self.shared_experts, x, may_run_beside, beside_from=beside_from)

    def finish(self, shared, combined: torch.Tensor) -> torch.Tensor:
        """`start_shared_experts`'s handle and the combined routed-expert output [T, H] -> the
        block's output [T, H]."""
        return combined if shared is None else combined + shared.result()
