"""Dense GQA decoder families: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

The attention block, decoder layer and model body here are shared with the MoE families
(`qwen3_moe.py`), which only swap the MLP of each layer through `make_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from rayinfer.config import ModelConfig
from rayinfer.layers.attention import PagedAttention
from rayinfer.layers.embedding import LMHead, VocabEmbedding
from rayinfer.layers.forward_context import ForwardContext
from rayinfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from rayinfer.layers.mlp import GatedMLP, copy_checked
from rayinfer.layers.norm import RMSNorm
from rayinfer.layers.parallel import SINGLE, ParallelContext, divide
from rayinfer.layers.rotary import rotary_from_config

QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Checkpoint projection -> (merged parameter, shard id): q/k/v and gate/up are one matmul each.
PACKED_PROJECTIONS = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}
IGNORED_CHECKPOINT_SUFFIXES = (".rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        tp = parallel.tp_size
        self.num_heads = divide(config.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(config.num_kv_heads, tp, "num_key_value_heads")
        self.head_dim = head_dim = config.head_dim
        hidden = config.hidden_size
        q_size, kv_size = config.num_attention_heads * head_dim, config.num_kv_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(
            hidden, [q_size, kv_size, kv_size], bias=config.attention_bias, parallel=parallel
        )
        # Qwen2 biases q/k/v only; Llama and Qwen3 put `attention_bias` on o_proj too.
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(q_size, hidden, bias=o_bias, parallel=parallel)
        self.q_norm = self.k_norm = None
        if config.architecture in QK_NORM_ARCHITECTURES:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_from_config(config)
        self.attn = PagedAttention(self.num_heads, head_dim, self.num_kv_heads, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext):
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.qkv_proj.output_sizes[:2]
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, ctx)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, mlp: nn.Module, parallel: ParallelContext
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, parallel)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, ctx: ForwardContext):
        """hidden [T, H], residual [T, H] or None -> (mlp output [T, H], residual [T, H])."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def dense_mlp(config: ModelConfig, parallel: ParallelContext) -> nn.Module:
    if config.hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported; rayinfer's MLPs have no bias")
    return GatedMLP(config.hidden_size, config.intermediate_size, parallel)


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        make_mlp: Callable[[int], nn.Module],
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, make_mlp(i), parallel) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def check_full_attention(config: ModelConfig) -> None:
    """Sliding-window attention (Mistral-style configs, Qwen2 `use_sliding_window`) is not built."""
    window = config.hf.get("sliding_window")
    if (
        window
        and config.hf.get("use_sliding_window", True)
        and window < config.max_position_embeddings
    ):
        raise ValueError(
            f"sliding_window={window} is not supported (rayinfer attends to the whole context); "
            "use a checkpoint without a sliding window or set sliding_window to null"
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext = SINGLE):
        super().__init__()
        check_full_attention(config)
        self.config = config
        self.model = LlamaModel(config, parallel, self.make_mlp_factory(config, parallel))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp_factory(self, config, parallel) -> Callable[[int], nn.Module]:
        return lambda layer_idx: dense_mlp(config, parallel)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        return self.lm_head.compute_logits(hidden)

    # Weight loading: checkpoint names <-> parameters.
    def is_ignored(self, name: str) -> bool:
        tied_head = self.config.tie_word_embeddings and name == "lm_head.weight"
        return tied_head or name.endswith(IGNORED_CHECKPOINT_SUFFIXES)

    def load_special(self, name: str, loaded: torch.Tensor) -> bool:
        """Families with extra checkpoint layouts (routed experts) load them here."""
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, loaded in weights:
            if self.is_ignored(name) or self.load_special(name, loaded):
                continue
            param_name, shard_id = packed_parameter(name)
            if param_name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} matches no parameter of "
                    f"{type(self).__name__}; is config.json's architecture right?"
                )
            param = params[param_name]
            weight_loader = getattr(param, "weight_loader", copy_checked)
            weight_loader(param, loaded, shard_id)

    def expected_checkpoint_names(self) -> set[str]:
        """Every checkpoint tensor that must be present to fill every parameter."""
        names: set[str] = set()
        for param_name, _ in self.named_parameters():
            names.update(self.checkpoint_names_of(param_name))
        return names

    def checkpoint_names_of(self, param_name: str) -> list[str]:
        return checkpoint_names_of_packed(param_name)


def packed_parameter(name: str) -> tuple[str, int | None]:
    """Checkpoint name -> (parameter name, shard id of a merged parameter or None)."""
    for checkpoint_part, (param_part, shard_id) in PACKED_PROJECTIONS.items():
        if checkpoint_part in name:
            return name.replace(checkpoint_part, param_part), shard_id
    return name, None


def checkpoint_names_of_packed(param_name: str) -> list[str]:
    sources = [
        param_name.replace(param_part, checkpoint_part)
        for checkpoint_part, (param_part, _) in PACKED_PROJECTIONS.items()
        if param_part in param_name
    ]
    return sources or [param_name]
