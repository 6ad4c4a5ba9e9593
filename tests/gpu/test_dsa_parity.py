"""DeepSeek-V3.2 and GLM-5 on CUDA through the Triton kernels, against transformers on the CPU
(float32), on tiny random checkpoints whose index_topk (32) is below most prompts:
- float32 on the GPU: greedy tokens equal transformers' (the CPU tests' standard);
- bf16: prefill logits within 3% of the reference's largest value, and every generated token
  transformers' argmax after the same prefix, or within that tolerance of it (a bf16 near-tie).

    python -m pytest -q -m gpu tests/gpu/test_dsa_parity.py
"""

import pytest
import torch

import rayinfer
from tests.models.harness import make_dsa_checkpoint, make_prompts, run_transformers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    index_topk=32,
    index_head_dim=64,
    index_n_heads=16,
)
FAMILIES = {
    "deepseek_v32": dict(n_group=4, topk_group=2),
    "glm_moe_dsa": dict(n_group=1, topk_group=1, indexer_types=["full", "shared", "full"]),
}
LENGTHS = (7, 40, 130, 300)
NUM_TOKENS = 20
BF16_TOLERANCE = 0.03


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return make_dsa_checkpoint(folder, request.param, **SHAPES, **FAMILIES[request.param])


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(SHAPES["vocab_size"], lengths=LENGTHS)


def generate(checkpoint, prompts, dtype):
    llm = rayinfer.LLM(
        str(checkpoint), device="cuda", dtype=dtype, max_num_batched_tokens=64, max_model_len=512
    )
    params = rayinfer.SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    try:
        return [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def test_float32_on_the_gpu_gives_transformers_tokens(checkpoint, prompts):
    expected = run_transformers(checkpoint, prompts, NUM_TOKENS).token_ids
    assert generate(checkpoint, prompts, torch.float32) == expected


@torch.no_grad()
def test_bf16_tokens_are_transformers_argmax_or_a_near_tie(checkpoint, prompts):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokens = generate(checkpoint, prompts, torch.bfloat16)
    for prompt, generated in zip(prompts, tokens):
        sequence = torch.tensor([prompt + generated])
        logits = reference(sequence).logits[0, len(prompt) - 1 : -1]  # [NUM_TOKENS, V]
        tolerance = BF16_TOLERANCE * logits.abs().max()
        chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
        assert bool((logits.max(-1).values - chosen <= tolerance).all()), (prompt, generated)
