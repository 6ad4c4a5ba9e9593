"""GQA Mixture-of-Experts families: Qwen3-MoE and Mixtral.

Both are the Llama decoder (`llama.py`: attention with Qwen3's per-head q/k norm, RMSNorms,
residuals) with the shared `layers.moe.MoE` block in place of the dense MLP:
  Qwen3-MoE: softmax router, top-k, renormalized when `norm_topk_prob`; layers listed in
             `mlp_only_layers` (or off the `decoder_sparse_step` grid) keep a dense MLP.
  Mixtral:   softmax router, top-k, always renormalized; checkpoints name the block
             `block_sparse_moe` and the experts' projections `w1` (gate), `w3` (up), `w2` (down).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from rayinfer.config import ModelConfig
from rayinfer.layers.fused_experts import (
    DEFAULT_EXPERT_PROJECTIONS,
    MIXTRAL_EXPERT_PROJECTIONS,
    parse_expert_weight_name,
)
from rayinfer.layers.moe import MoE, RoutingMethod
from rayinfer.layers.parallel import ParallelContext
from rayinfer.models.llama import LlamaForCausalLM, dense_mlp

# Stacked expert parameter -> the per-expert parts it holds, in checkpoint order.
STACKED_EXPERT_PARTS = {".experts.w13": ("gate", "up"), ".experts.w2": ("down",)}


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    expert_projections = DEFAULT_EXPERT_PROJECTIONS

    def make_mlp_factory(self, config: ModelConfig, parallel: ParallelContext):
        routing = self.routing_method(config)

        def make_mlp(layer_idx: int) -> nn.Module:
            if not self.is_sparse_layer(config, layer_idx):
                return dense_mlp(config, parallel)
            return MoE(
                config.hidden_size,
                config.num_experts,
                config.moe_intermediate_size,
                routing,
                parallel=parallel,
            )

        return make_mlp

    @staticmethod
    def routing_method(config: ModelConfig) -> RoutingMethod:
        renormalize = bool(config.hf.get("norm_topk_prob", False))
        return RoutingMethod(config.num_experts_per_tok, "softmax", renormalize=renormalize)

    @staticmethod
    def is_sparse_layer(config: ModelConfig, layer_idx: int) -> bool:
        dense_layers = config.hf.get("mlp_only_layers") or []
        sparse_step = config.hf.get("decoder_sparse_step") or 1
        return layer_idx not in dense_layers and (layer_idx + 1) % sparse_step == 0

    def load_special(self, name: str, loaded: torch.Tensor) -> bool:
        expert = parse_expert_weight_name(name, self.expert_projections)
        if expert is None:
            return False
        moe = self.get_submodule(expert.prefix)
        moe.experts.load_expert_weight(expert.expert_id, expert.part, loaded)
        return True

    def checkpoint_names_of(self, param_name: str) -> list[str]:
        for suffix, parts in STACKED_EXPERT_PARTS.items():
            if param_name.endswith(suffix):
                prefix = param_name[: -len(suffix)]
                return self.expert_checkpoint_names(prefix, parts)
        return super().checkpoint_names_of(param_name)

    def expert_checkpoint_names(self, prefix: str, parts: tuple[str, ...]) -> list[str]:
        """Per-expert checkpoint names of the experts this rank holds under `prefix`."""
        experts = self.get_submodule(prefix).experts
        projection_of = {part: proj for proj, part in self.expert_projections.items()}
        first = experts.first_local_expert
        return [
            f"{prefix}.experts.{expert_id}.{projection_of[part]}.weight"
            for expert_id in range(first, first + experts.num_local_experts)
            for part in parts
        ]


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    expert_projections = MIXTRAL_EXPERT_PROJECTIONS
    checkpoint_block_name, block_name = ".block_sparse_moe.", ".mlp."

    @staticmethod
    def routing_method(config: ModelConfig) -> RoutingMethod:
        return RoutingMethod(config.num_experts_per_tok, "softmax", renormalize=True)

    @staticmethod
    def is_sparse_layer(config: ModelConfig, layer_idx: int) -> bool:
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        old, new = self.checkpoint_block_name, self.block_name
        super().load_weights((name.replace(old, new), loaded) for name, loaded in weights)

    def checkpoint_names_of(self, param_name: str) -> list[str]:
        names = super().checkpoint_names_of(param_name)
        return [n.replace(self.block_name, self.checkpoint_block_name) for n in names]
