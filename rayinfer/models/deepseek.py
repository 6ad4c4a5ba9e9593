"""DeepSeek V2, V3 and V3.2, GLM-5: MLA attention over a latent cache (V3.2 and GLM-5 with
DeepSeek Sparse Attention, layers/dsa.py), routed + shared experts.

Layer i is an MoE layer when the config has routed experts and (ModelConfig.is_moe_layer)
`mlp_layer_types[i]` is "sparse", or without that list i >= first_k_dense_replace and
i % moe_layer_freq == 0; the others use a dense SwiGLU MLP. Routing:
- V3, V3.2, GLM-5 (`noaux_tc`): sigmoid scores, correction bias for selection, groups scored
  by their top-2 sum;
- V2 (`greedy` / `group_limited_greedy`): softmax scores, groups scored by their best expert.
Both renormalize when `norm_topk_prob` is set and then multiply by `routed_scaling_factor` (vLLM's
reading of V2; the released V2 checkpoints all have norm_topk_prob false, where readings agree).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.layers.dsa import DSAAttention
from rayinfer.layers.embedding import LMHead, VocabEmbedding
from rayinfer.layers.forward_context import ForwardContext
from rayinfer.layers.fused_experts import parse_expert_weight_name
from rayinfer.layers.mla import MLAAttention
from rayinfer.layers.mlp import GatedMLP, copy_checked
from rayinfer.layers.moe import MoE, RoutingMethod
from rayinfer.layers.norm import RMSNorm
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.models.fp8 import SCALE_SUFFIX

_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")
_MLP_PROJECTION = re.compile(
    r"^(.*(?:\.mlp|\.shared_experts))\.(gate_proj|up_proj|down_proj)\.weight$"
)


def routing_method(config: ModelConfig) -> RoutingMethod:
    """V3 (and V3.2, GLM-5) always route `noaux_tc` with sigmoid scores; V2 softmax, `greedy`
    or grouped."""
    hf = config.hf
    if config.architecture != "DeepseekV2ForCausalLM":
        topk_method = "noaux_tc"
    else:
        topk_method = hf.get("topk_method") or "greedy"
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(
                f"topk_method={topk_method!r} is not a DeepSeek-V2 routing; "
                "use 'greedy' or 'group_limited_greedy'"
            )
    num_groups = (hf.get("n_group") or 1) if topk_method != "greedy" else 1
    return RoutingMethod(
        top_k=config.num_experts_per_tok,
        scoring="sigmoid" if topk_method == "noaux_tc" else "softmax",
        renormalize=bool(hf.get("norm_topk_prob", False)),
        num_groups=num_groups,
        topk_groups=(hf.get("topk_group") or num_groups) if num_groups > 1 else 1,
        use_correction_bias=topk_method == "noaux_tc",
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, parallel: ParallelContext, fp8: bool = False
    ):
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        attention = DSAAttention if config.is_dsa else MLAAttention
        self.self_attn = attention(config, layer_idx, parallel, fp8)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(
                hidden,
                config.num_experts,
                config.moe_intermediate_size,
                routing_method(config),
                config.moe_intermediate_size * config.num_shared_experts,
                parallel,
                fp8,
            )
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, parallel, fp8)

    def forward(self, positions, hidden, residual, ctx: ForwardContext):
        """hidden, residual [T, H] (residual None at the first layer) -> (hidden, residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext, fp8: bool = False):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, parallel, fp8) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekForCausalLM(nn.Module):
    """`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM` and the DSA models on V3's layers,
    `DeepseekV32ForCausalLM` and `GlmMoeDsaForCausalLM` (see the registry's model contract).

    fp8_weights: keep the checkpoint's FP8 block-scaled weights (attention projections but
    kv_b_proj, dense MLPs, shared and routed experts); the router, embeddings, lm_head, norms and
    kv_b_proj stay in the model dtype. The loader then hands over `...weight_scale_inv` tensors too.
    """

    def __init__(
        self, config: ModelConfig, parallel: ParallelContext = SINGLE, fp8_weights: bool = False
    ):
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.fp8_weights = fp8_weights
        self.model = DeepseekModel(config, parallel, fp8_weights)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, parallel)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint (name, tensor) pairs -> parameters; experts are stacked into FusedExperts.

        Skips `rotary_emb.inv_freq` and the multi-token-prediction layers that V3 checkpoints
        store as `model.layers.{N}` for N >= num_hidden_layers.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self._is_skipped(name):
                continue
            try:
                loaded.add(self._load_one(name, tensor, params, modules))
            except ValueError as error:
                raise ValueError(f"checkpoint tensor {name!r}: {error}") from error
        if self.config.tie_word_embeddings and "lm_head.weight" not in loaded:
            self.lm_head.weight.data.copy_(self.model.embed_tokens.weight.data)
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint has no tensor for {len(missing)} parameters, e.g. {missing[:3]}; "
                "is the checkpoint complete and its config.json the one it was saved with?"
            )

    def expected_checkpoint_names(self) -> set[str]:
        """Every checkpoint tensor needed to fill this rank's parameters (for the loader)."""
        names: set[str] = set()
        for param_name, _ in self.named_parameters():
            names.update(self._checkpoint_names_of(param_name))
        return names

    def fp8_checkpoint_names(self) -> set[str]:
        """Checkpoint weights this rank keeps in FP8 (their `weight_scale_inv` loads too); every
        other FP8 checkpoint weight is dequantized to the model dtype by the loader."""
        names: set[str] = set()
        for param_name, param in self.named_parameters():
            if param.dtype == torch.float8_e4m3fn:
                names.update(self._checkpoint_names_of(param_name))
        return names

    def _checkpoint_names_of(self, param_name: str) -> list[str]:
        module_name, _, leaf = param_name.rpartition(".")
        if leaf in ("w13", "w2", "w13_scale", "w2_scale"):  # FusedExperts: per expert and part
            experts = self.get_submodule(module_name)
            projections = ("down_proj",) if leaf.startswith("w2") else ("gate_proj", "up_proj")
            suffix = ".weight" + (SCALE_SUFFIX if leaf.endswith("_scale") else "")
            first, count = experts.first_local_expert, experts.num_local_experts
            return [
                f"{module_name}.{e}.{p}{suffix}"
                for e in range(first, first + count)
                for p in projections
            ]
        for leaf_name in ("gate_up_proj.weight", "gate_up_proj.weight" + SCALE_SUFFIX):
            if param_name.endswith(leaf_name):
                prefix, tail = (
                    param_name.removesuffix(leaf_name),
                    leaf_name.removeprefix("gate_up_"),
                )
                return [f"{prefix}gate_{tail}", f"{prefix}up_{tail}"]
        if param_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return []
        return [param_name]

    def _is_skipped(self, name: str) -> bool:
        layer = _LAYER_PREFIX.match(name)
        is_mtp = layer is not None and int(layer.group(1)) >= self.config.num_layers
        return is_mtp or name.endswith("rotary_emb.inv_freq")

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict, modules: dict) -> str:
        """Load one checkpoint tensor; returns the name of the parameter it filled.

        `<weight>_scale_inv` (FP8 block scales, only handed over with fp8_weights) goes where its
        weight goes: the experts' w13_scale / w2_scale, or the linear layer's weight_scale_inv."""
        is_scale = name.endswith(SCALE_SUFFIX)
        weight_name = name.removesuffix(SCALE_SUFFIX)
        scale = "_scale" if is_scale else ""
        expert = parse_expert_weight_name(weight_name)
        if expert is not None and f"{expert.prefix}.experts" in modules:
            experts = modules[f"{expert.prefix}.experts"]
            experts.load_expert_weight(expert.expert_id, expert.part, tensor, is_scale)
            return f"{expert.prefix}.experts.{'w2' if expert.part == 'down' else 'w13'}{scale}"
        projection = _MLP_PROJECTION.match(weight_name)
        if projection is not None and projection.group(1) in modules:
            module_name, projection_name = projection.groups()
            modules[module_name].load_weight(projection_name, tensor, is_scale)
            merged = "down_proj" if projection_name == "down_proj" else "gate_up_proj"
            return f"{module_name}.{merged}.weight{SCALE_SUFFIX if is_scale else ''}"
        if name not in params:
            raise ValueError(
                f"no such parameter in {self.config.architecture} "
                f"(num_hidden_layers={self.config.num_layers}); is config.json the right one?"
            )
        param = params[name]
        getattr(param, "weight_loader", copy_checked)(param, tensor)
        return name
