"""DeepSeek-V4 (`DeepseekV4ForCausalLM`, V4-Flash): compressed sparse attention, mHC residual
streams and hash-routed MoE.

Each layer keeps `hc_mult` residual streams (layers/hyper_connection.py) and runs V4 attention
(layers/v4_attention.py: sliding window, plus pooled entries in compressed layers) then an MoE:
`sqrtsoftplus` router scores (renormalized over the chosen experts whatever norm_topk_prob
says, times routed_scaling_factor, as transformers routes), with the correction bias choosing
the experts in "moe" layers and a fixed `tid2eid[token id]` table choosing them in "hash_moe"
layers; routed and shared experts clamp their SwiGLU inputs at `swiglu_limit`.

A checkpoint shipped with MXFP4 routed experts (`expert_dtype: "fp4"`, models/checkpoint_format.py)
keeps them packed in memory (FusedExperts' "mxfp4" format, run by the MXFP4 fused MoE); every
other weight is dequantized at load.

Checkpoint names are the shipped ones (`embed.weight`, `layers.{i}.attn.wq_a.weight`,
`layers.{i}.ffn.experts.{e}.w1.weight`, `hc_head_fn`, `head.weight`), with or without the
`model.` prefix that transformers' save_pretrained adds to some of them. The multi-token
prediction layer (`mtp.*`) is skipped, as in transformers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from rayinfer.config import ModelConfig
from rayinfer.config_v4 import V4Config
from rayinfer.kernels.moe.moe_routing import MoeRouting, routing_scores
from rayinfer.layers.embedding import LMHead, VocabEmbedding
from rayinfer.layers.forward_context import ForwardContext
from rayinfer.layers.fused_experts import MIXTRAL_EXPERT_PROJECTIONS, parse_expert_weight_name
from rayinfer.layers.hyper_connection import HyperConnection, HyperHead, merge_streams
from rayinfer.layers.mlp import copy_checked
from rayinfer.layers.moe import MoE, RoutingMethod
from rayinfer.layers.norm import RMSNorm
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.layers.v4_attention import V4Attention
from rayinfer.models.checkpoint_format import CheckpointFormat

_SHARED_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.shared_experts)\.(w1|w2|w3)\.weight$")
_SHARED_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# checkpoint name -> parameter name, after the optional "model." prefix is dropped
_RENAMES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$"), r"\1.hc_\2.\3"),
    (re.compile(r"^(layers\.\d+\.ffn\.gate)\.bias$"), r"\1.e_score_correction_bias"),
    (re.compile(r"^(layers\.\d+\.ffn)\.gate\.tid2eid$"), r"\1.tid2eid"),
)
_MTP = re.compile(r"^(model\.)?mtp\.")


def parameter_name(checkpoint_name: str) -> str:
    name = checkpoint_name.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


class V4MoE(MoE):
    """MoE whose "hash_moe" layers choose experts by token id (`tid2eid` [V, K])."""

    def __init__(self, config: ModelConfig, v4: V4Config, layer_idx: int, parallel,
                 expert_format: str | None = None):  # fmt: skip
        is_hash = v4.mlp_layer_types[layer_idx] == "hash_moe"
        routing = RoutingMethod(
            top_k=config.num_experts_per_tok,
            scoring=v4.scoring_func,
            renormalize=True,
            use_correction_bias=not is_hash,
            routed_scaling_factor=v4.routed_scaling_factor,
        )
        shared = config.moe_intermediate_size * config.num_shared_experts
        super().__init__(
            config.hidden_size, config.num_experts, config.moe_intermediate_size, routing,
            shared, parallel, swiglu_limit=v4.swiglu_limit, expert_weight_format=expert_format,
        )  # fmt: skip
        self.tid2eid = None
        if is_hash:
            # until the checkpoint's table loads (or for random weights): token t's k-th expert
            # is (t * K + k) mod E, distinct experts spread evenly
            table = torch.arange(config.vocab_size * config.num_experts_per_tok)
            table = (table % config.num_experts).view(config.vocab_size, -1)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
            self.tid2eid.weight_loader = copy_checked

    def hash_route(self, x: torch.Tensor, input_ids: torch.Tensor) -> MoeRouting:
        """The table's experts for each token, weighted by their renormalized router scores."""
        ids = self.tid2eid[input_ids]  # [T, K]
        scores = routing_scores(self.gate(x), self.routing.scoring).gather(1, ids)
        weights = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return MoeRouting(weights * self.routing.routed_scaling_factor, ids)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        routing = self.hash_route(x, input_ids) if self.tid2eid is not None else None
        return super().forward(x, routing)


class V4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, v4: V4Config, layer_idx: int, parallel,
                 expert_format: str | None = None):  # fmt: skip
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = V4Attention(config, v4, layer_idx)
        self.ffn_norm = RMSNorm(hidden, eps)
        self.ffn = V4MoE(config, v4, layer_idx, parallel, expert_format)
        mixing = (hidden, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, eps)
        self.hc_attn = HyperConnection(*mixing)
        self.hc_ffn = HyperConnection(*mixing)

    def forward(self, streams, positions, input_ids, ctx: ForwardContext):
        """streams [T, N, H] -> [T, N, H]."""
        post, comb, collapsed = self.hc_attn(streams)
        attended = self.attn(positions, self.attn_norm(collapsed), ctx)
        streams = merge_streams(streams, attended, post, comb)
        post, comb, collapsed = self.hc_ffn(streams)
        mixed = self.ffn(self.ffn_norm(collapsed), input_ids)
        return merge_streams(streams, mixed, post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    """See the module docstring and the registry's model contract. Attention is replicated on
    tensor-parallel ranks (one key/value head); the experts follow the parallel plan."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.config, self.parallel = config, parallel
        v4 = self.v4 = V4Config.from_hf(config.hf)
        shipped = CheckpointFormat.from_hf(config.hf)
        is_fp4 = shipped.quant_method is not None and shipped.expert_dtype == "fp4"
        expert_format = "mxfp4" if is_fp4 else None
        self.embed = VocabEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            V4DecoderLayer(config, v4, i, parallel, expert_format) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config.hidden_size, v4.hc_mult, v4.hc_eps, config.rms_norm_eps)
        self.head = LMHead(config.vocab_size, config.hidden_size, parallel)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H]."""
        hidden = self.embed(input_ids)
        streams = hidden[:, None, :].expand(-1, self.v4.hc_mult, -1).contiguous()  # [T, N, H]
        for layer in self.layers:
            streams = layer(streams, positions, input_ids, ctx)
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        return self.head.compute_logits(hidden)

    def expected_checkpoint_names(self) -> set[str]:
        """Every checkpoint tensor this rank's parameters need, named as `parameter_name`
        names them (the loader compares the checkpoint's names so): parameter names, with the
        stacked experts and merged shared-expert projections spelled per tensor."""
        return set(self._checkpoint_names())

    @staticmethod
    def normalize_checkpoint_name(name: str) -> str:
        return parameter_name(name)

    def mxfp4_checkpoint_names(self) -> set[str]:
        """The routed experts' weights this rank keeps packed (none unless MXFP4 is kept)."""
        return {
            name
            for param_name, param in self.named_parameters()
            if param_name.endswith(("experts.w13", "experts.w2")) and param.dtype == torch.uint8
            for name in self._expert_names(param_name, "weight")
        }

    def _expert_names(self, param_name: str, suffix: str) -> Iterable[str]:
        module_name, _, leaf = param_name.rpartition(".")
        experts = self.get_submodule(module_name)
        parts = ("w2",) if leaf.startswith("w2") else ("w1", "w3")
        first = experts.first_local_expert
        for e in range(first, first + experts.num_local_experts):
            yield from (f"{module_name}.{e}.{p}.{suffix}" for p in parts)

    def _checkpoint_names(self) -> Iterable[str]:
        for name, _ in self.named_parameters():
            leaf = name.rpartition(".")[2]
            if leaf in ("w13", "w2", "w13_scale", "w2_scale"):
                yield from self._expert_names(name, "scale" if "scale" in leaf else "weight")
            elif name.endswith("shared_experts.gate_up_proj.weight"):
                prefix = name.removesuffix("gate_up_proj.weight")
                yield from (f"{prefix}w1.weight", f"{prefix}w3.weight")
            elif name.endswith("shared_experts.down_proj.weight"):
                yield name.removesuffix("down_proj.weight") + "w2.weight"
            else:
                yield name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for checkpoint_name, tensor in weights:
            if _MTP.match(checkpoint_name):
                continue
            name = parameter_name(checkpoint_name)
            try:
                loaded.add(self._load_one(name, tensor, params, modules))
            except ValueError as error:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r}: {error}") from error
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint has no tensor for {len(missing)} parameters, e.g. {missing[:3]}"
            )

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict, modules: dict) -> str:
        is_scale = name.endswith(".scale")  # a kept MXFP4 expert's exponents
        weight_name = name.removesuffix(".scale") + ".weight" if is_scale else name
        expert = parse_expert_weight_name(weight_name, MIXTRAL_EXPERT_PROJECTIONS)
        if expert is not None and f"{expert.prefix}.experts" in modules:
            experts = modules[f"{expert.prefix}.experts"]
            experts.load_expert_weight(expert.expert_id, expert.part, tensor, is_scale)
            stacked = "w2" if expert.part == "down" else "w13"
            return f"{expert.prefix}.experts.{stacked}{'_scale' if is_scale else ''}"
        shared = _SHARED_EXPERT.match(name)
        if shared is not None:
            module_name, projection = shared.groups()
            modules[module_name].load_weight(_SHARED_PROJECTIONS[projection], tensor)
            merged = "down_proj" if projection == "w2" else "gate_up_proj"
            return f"{module_name}.{merged}.weight"
        if name not in params:
            raise ValueError(
                f"no such parameter in DeepseekV4ForCausalLM (num_hidden_layers="
                f"{self.config.num_layers}); is config.json the right one?"
            )
        param = params[name]
        getattr(param, "weight_loader", copy_checked)(param, tensor)
        return name
