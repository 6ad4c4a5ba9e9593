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
Loading routed experts: `parse_expert_weight_name(name, projections)` splits a per-expert checkpoint
name (`...mlp.experts.3.gate_proj.weight`; Mixtral: pass `MIXTRAL_EXPERT_PROJECTIONS` for
`w1`/`w3`/`w2`) into (module prefix, expert id, part); then call
`moe.experts.load_expert_weight(expert_id, part, tensor)`. Shared experts load through
`GatedMLP.load_weight(projection_name, tensor)`.

FP8 weights (`fp8=True`, DeepSeek-V3 checkpoints served with fp8_weights): the routed experts keep
`w13`/`w2` in float8_e4m3fn with `w13_scale` [E_local, 2I/128, ceil(H/128)] and `w2_scale`
[E_local, ceil(H/128), I/128] block scales (I must be a multiple of 128: gate and up share one
stacked weight) and run the FP8 fused MoE; the shared experts are FP8 linear layers. The scales
load through the same calls with `is_scale=True` (checkpoint `...weight_scale_inv`).

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

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rayinfer.comm.moe import sends_all_tokens
from rayinfer.config import ConfigError
from rayinfer.kernels import ops
from rayinfer.layers import side_stream
from rayinfer.layers.linear import FP8_BLOCK, ColumnParallelLinear, RowParallelLinear
from rayinfer.layers.parallel import SINGLE, ParallelContext, divide
from rayinfer.layers.side_stream import StartOnce

DEFAULT_EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MIXTRAL_EXPERT_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


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


class ExpertWeightName(NamedTuple):
    prefix: str  # module path holding `experts`, e.g. "model.layers.3.mlp"
    expert_id: int  # global expert id in the checkpoint
    part: str  # "gate", "up" or "down"


def parse_expert_weight_name(
    name: str, projections: dict[str, str] = DEFAULT_EXPERT_PROJECTIONS
) -> ExpertWeightName | None:
    """`<prefix>.experts.<e>.<proj>.weight` -> ExpertWeightName; None for any other name."""
    match = _EXPERT_NAME.match(name)
    if match is None or match["proj"] not in projections:
        return None
    return ExpertWeightName(match["prefix"], int(match["expert"]), projections[match["proj"]])


def copy_checked(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Default weight loader: the whole tensor, with a shape check that names both shapes."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class GatedMLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts): down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext = SINGLE,
        fp8: bool = False,
    ):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], parallel=parallel, fp8=fp8
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, parallel=parallel, fp8=fp8
        )

    def load_weight(self, projection: str, loaded: torch.Tensor, is_scale: bool = False) -> None:
        """Checkpoint `gate_proj` / `up_proj` / `down_proj` weight (or, is_scale, its FP8
        `weight_scale_inv`) -> this rank's slice."""
        module = self.down_proj if projection == "down_proj" else self.gate_up_proj
        param = module.weight_scale_inv if is_scale else module.weight
        if param is None:
            raise ValueError(f"{projection} keeps no FP8 scales here (fp8_weights is off)")
        load = module.scale_loader if is_scale else module.weight_loader
        if projection == "down_proj":
            load(param, loaded)
            return
        load(param, loaded, {"gate_proj": 0, "up_proj": 1}[projection])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


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
        return F.linear(x.float(), self.weight)


class FusedExperts(nn.Module):
    """This rank's routed experts, stacked.

    w13 [E_local, 2I, H]: gate rows then up rows of each expert; w2 [E_local, H, I]: down.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext = SINGLE,
        fp8: bool = False,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.num_local_experts = divide(num_experts, parallel.ep_size, "n_routed_experts")
        self.first_local_expert = parallel.ep_rank * self.num_local_experts
        shape13 = (self.num_local_experts, 2 * intermediate_size, hidden_size)
        shape2 = (self.num_local_experts, hidden_size, intermediate_size)
        dtype = torch.float8_e4m3fn if fp8 else None
        self.w13 = nn.Parameter(torch.empty(shape13, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shape2, dtype=dtype), requires_grad=False)
        self.w13_scale = self.w2_scale = None
        if fp8:
            if intermediate_size % FP8_BLOCK:
                raise ConfigError(
                    f"fp8_weights: moe_intermediate_size={intermediate_size} is not a multiple of "
                    f"{FP8_BLOCK}, so gate and up cannot share one block-scaled w13; "
                    "use fp8_weights=False"
                )
            blocks = lambda n: -(-n // FP8_BLOCK)  # noqa: E731
            scale13 = (self.num_local_experts, blocks(2 * intermediate_size), blocks(hidden_size))
            scale2 = (self.num_local_experts, blocks(hidden_size), blocks(intermediate_size))
            self.w13_scale = nn.Parameter(
                torch.empty(scale13, dtype=torch.float32), requires_grad=False
            )
            self.w2_scale = nn.Parameter(
                torch.empty(scale2, dtype=torch.float32), requires_grad=False
            )

    def load_expert_weight(
        self, expert_id: int, part: str, loaded: torch.Tensor, is_scale: bool = False
    ) -> bool:
        """Copy one expert's `gate`/`up` [I, H] or `down` [H, I] (is_scale: its FP8 block scales
        [I/128, H/128] or [H/128, I/128]); False if the expert is not held on this rank."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} outside n_routed_experts={self.num_experts}")
        local = expert_id - self.first_local_expert
        if not 0 <= local < self.num_local_experts:
            return False
        if is_scale:
            if self.w13_scale is None:
                raise ValueError("these experts keep no FP8 scales (fp8_weights is off)")
            size = self.intermediate_size // FP8_BLOCK
            stacked = (self.w2_scale if part == "down" else self.w13_scale).data
        else:
            size = self.intermediate_size
            stacked = (self.w2 if part == "down" else self.w13).data
        rows = {"gate": slice(0, size), "up": slice(size, 2 * size), "down": slice(None)}[part]
        target = stacked[local, rows]
        if target.shape != loaded.shape:
            what = f"{part} scale" if is_scale else part
            raise ValueError(
                f"expert {expert_id} {what}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        if target.dtype == torch.float8_e4m3fn and loaded.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"expert {expert_id} {part}: checkpoint tensor is {loaded.dtype}, but the experts "
                "keep FP8 block-scaled weights (fp8_weights=True)"
            )
        target.copy_(loaded)
        return True

    def run(self, x, topk_weights, local_ids):
        """The fused MoE over this rank's experts; local_ids [T, K] outside [0, E_local) skip."""
        return ops.fused_moe(
            x, self.w13, self.w2, topk_weights, local_ids, self.w13_scale, self.w2_scale
        )

    def forward(self, x, topk_weights, topk_ids):
        """x [T, H], topk_weights [T, K] float32, topk_ids [T, K] global ids -> [T, H].

        Under expert parallelism the result holds only this rank's experts' share.
        """
        if self.num_local_experts == self.num_experts:  # every expert is here: ids as they are
            return self.run(x, topk_weights, topk_ids)
        local_ids = topk_ids - self.first_local_expert  # [T, K]
        outside = (local_ids < 0) | (local_ids >= self.num_local_experts)
        local_ids = local_ids.masked_fill(outside, -1)  # skipped by fused_moe
        return self.run(x, topk_weights, local_ids)


# all_to_all.local_first=None runs a rank's experts on its own tokens beside the exchange from
# this many tokens on every rank. 2x H200 host-staged, DeepSeek-V2-Lite shapes, two-batch
# overlap (RESULTS, tenth session), in transformers' tok/s per GPU: micro-batches of 16k tokens
# 1.42-1.44x -> 1.54x in three calls; of 8k 1.44x -> 1.46x in one call, 1.44x -> 1.19x in
# another (the step became host-bound); of 2k 1.18x -> 0.78x (the grouped GEMMs split in two
# halves too small to run well, and the MoE's host work doubles).
LOCAL_FIRST_MIN_TOKENS = 16384


@dataclass
class LocalExperts:
    """all_to_all.local_first: this rank's experts run on its own tokens straight from x, beside
    the exchange (they need no transfer); the exchange carries them to the other ranks only, and
    combine adds this share in its summing pass."""

    start: StartOnce  # -> a side_stream handle on the experts' [T, H] output for those tokens


class Received(NamedTuple):
    """What `dispatch_tokens` hands to `experts_and_combine`."""

    result: Any  # comm.moe.DispatchResult
    local: LocalExperts | None
    shared: StartOnce  # the shared experts' start (see `start_shared_experts`)


def _in_order(*starts: StartOnce | None) -> Callable[[], None]:
    def start_all() -> None:
        for start in starts:
            if start is not None:
                start()

    return start_all


class MoE(nn.Module):
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
    ):
        super().__init__()
        self.routing = routing
        self.parallel = parallel
        self.gate = Router(hidden_size, num_experts, routing.use_correction_bias)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, parallel, fp8)
        self.shared_experts = None
        if shared_intermediate_size:
            self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, parallel, fp8)

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
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routing = self.route(x)
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
            on_packed=_in_order(local and local.start, shared if shared_beside_dispatch else None),
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
        addends = [] if local is None else [local.start.handle().result()]  # [T, H] each
        shared_handle = shared.handle()
        if shared_handle is not None and shared_handle.runs_beside:
            addends.append(shared_handle.result())  # ready, or nearly: join it here
            shared_handle = None
        combined = self.parallel.ep_group.combine(
            expert_out, result.handle, channel=channel, addends=tuple(addends)
        )
        return self.finish(shared_handle, combined)

    def _local_experts(self, x, routing, tokens_per_rank) -> LocalExperts | None:
        """With all_to_all.local_first (True, or None and every rank's call at least
        LOCAL_FIRST_MIN_TOKENS: the same choice on every rank) and the all-tokens exchange, this
        rank's experts on its own tokens, to start beside the exchange (which then skips this
        rank); else None."""
        group = self.parallel.ep_group
        options = group.all_to_all
        choice = options.get("local_first")
        if choice is False or tokens_per_rank is None:
            return None
        if choice is None and min(tokens_per_rank) < LOCAL_FIRST_MIN_TOKENS:
            return None
        top_k, world = routing.topk_ids.shape[1], group.size
        if not sends_all_tokens(
            self.experts.num_experts, top_k, world, tokens_per_rank, options.get("dedup")
        ):
            return None

        def start():
            def own_experts(x):  # [T, H] -> [T, H]: only this rank's experts' share
                return self.experts(x, routing.topk_weights, routing.topk_ids)

            reads = (routing.topk_weights, routing.topk_ids)
            return side_stream.later(own_experts, x, True, reads)  # no collective inside

        return LocalExperts(StartOnce(start))

    def start_shared_experts(self, x: torch.Tensor):
        """The shared experts' output on [T, H] tokens, as a handle for `finish`: queued now on a
        side stream where they can run while tokens travel (where this layer exchanges tokens
        and no collective runs inside them, tp_size 1; see side_stream.later for the rest), else
        computed in `finish`. None without shared experts."""
        if self.shared_experts is None:
            return None
        may_run_beside = self.exchanges_tokens and self.parallel.tp_size == 1
        return side_stream.later(self.shared_experts, x, may_run_beside)

    def finish(self, shared, combined: torch.Tensor) -> torch.Tensor:
        """`start_shared_experts`'s handle and the combined routed-expert output [T, H] -> the
        block's output [T, H]."""
        return combined if shared is None else combined + shared.result()
