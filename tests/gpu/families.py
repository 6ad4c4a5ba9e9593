"""The tiny random checkpoints the GPU tests share (made by transformers with std-0.1 weights,
tests/models/harness.py), the mark of the tests that need two GPUs, and greedy generation."""

import pytest
import torch

import rayinfer
from tests.models.harness import TINY_MLA

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

COMMON = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=4096,
)
DEEPSEEK_V3 = dict(
    COMMON,
    num_key_value_heads=4,
    kv_lora_rank=64,
    q_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
# Production head dims, so that prefill takes the kernels the real models get: MLA's expanded
# form at qk 128 + 64 rope and v 128 (the warp-specialized Gluon kernel on an H200).
DEEPSEEK_V3_DIMS192 = dict(
    DEEPSEEK_V3, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=128
)
# family name -> (transformers model_type, config overrides)
FAMILIES = {
    "llama": ("llama", dict(COMMON, num_key_value_heads=2)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            COMMON,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
        ),
    ),
    "deepseek_v3": ("deepseek_v3", DEEPSEEK_V3),
    "deepseek_v3_dims192": ("deepseek_v3", DEEPSEEK_V3_DIMS192),
    # Llama at head dim 128: a prompt's first chunk attends to the step's own K/V through the
    # contiguous kernel (the Gluon one on an H200), the later chunks through the paged one.
    "llama_dims128": ("llama", dict(COMMON, hidden_size=512, num_key_value_heads=2)),
    # DeepSeek's decode shapes (latent 512 + rope 64) at 16 and 128 heads: decode steps take the
    # Gluon MLA split kernel on an H200 (tokens-major at 16 heads, heads-major at 128).
    **{
        f"deepseek_v3_latent512_h{heads}": (
            "deepseek_v3",
            dict(
                DEEPSEEK_V3_DIMS192,
                kv_lora_rank=512,
                num_attention_heads=heads,
                num_key_value_heads=heads,
            ),
        )
        for heads in (16, 128)
    },
    # The multi-GPU checks' MoE models: DeepSeek-V3 at the CPU tests' MLA shapes (hidden 64,
    # random routing correction biases) and a Qwen3-MoE with a 512-token vocabulary.
    "deepseek_v3_h64": ("deepseek_v3", TINY_MLA),
    "qwen3_moe_v512": (
        "qwen3_moe",
        dict(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
}
WITH_ROUTING_BIASES = {"deepseek_v3_h64"}  # made by harness.make_deepseek_checkpoint


def vocab_size(family: str) -> int:
    return FAMILIES[family][1]["vocab_size"]


def greedy_tokens(llm: rayinfer.LLM, prompts, max_tokens=16) -> list[list[int]]:
    """Greedy token ids of every prompt (`max_tokens` an int or one per prompt); shuts `llm`
    down."""
    counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    params = [rayinfer.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in counts]
    try:
        return [output.token_ids for output in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
