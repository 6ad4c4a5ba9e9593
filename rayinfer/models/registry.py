"""Model families by Hugging Face `architectures` name, imported lazily.

Every model class is built as `cls(config: ModelConfig, parallel: ParallelContext)` and offers:
  forward(input_ids [T] int64, positions [T] int64, ctx: ForwardContext) -> hidden [T, H]
  compute_logits(hidden [N, H]) -> logits [N, V] float32
  load_weights(weights: Iterable[tuple[str, Tensor]]) -> None  (checkpoint names, see loader)
"""

from __future__ import annotations

import importlib

from rayinfer.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig

_MODEL_CLASSES = {
    "DeepseekV2ForCausalLM": ("rayinfer.models.deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("rayinfer.models.deepseek", "DeepseekForCausalLM"),
    "DeepseekV32ForCausalLM": ("rayinfer.models.deepseek", "DeepseekForCausalLM"),
    "GlmMoeDsaForCausalLM": ("rayinfer.models.deepseek", "DeepseekForCausalLM"),
    "DeepseekV4ForCausalLM": ("rayinfer.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "Qwen3MoeForCausalLM": ("rayinfer.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("rayinfer.models.qwen3_moe", "MixtralForCausalLM"),
    "LlamaForCausalLM": ("rayinfer.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("rayinfer.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("rayinfer.models.llama", "LlamaForCausalLM"),
}
assert set(_MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


def model_class(config: ModelConfig):
    if config.architecture not in _MODEL_CLASSES:
        raise ConfigError(
            f"architecture {config.architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module_name, class_name = _MODEL_CLASSES[config.architecture]
    return getattr(importlib.import_module(module_name), class_name)
