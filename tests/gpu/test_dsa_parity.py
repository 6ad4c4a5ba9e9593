"""DeepSeek-V3.2 and GLM-5 on CUDA through the Triton kernels, against transformers on the CPU
(float32), on tiny random checkpoints whose index_topk (32) is below most prompts:
- float32 on the GPU: greedy tokens equal transformers' (the CPU tests' standard);
- bf16: prefill logits (chunks of 64 over the paged prefix) no further from the float32 ones
  than transformers' own bf16 on the same GPU.

    python -m pytest -q -m gpu tests/gpu/test_dsa_parity.py
"""

import pytest
import torch

from tests.models.harness import (
    DSA_FAMILIES,
    engine_greedy_tokens,
    load_rayinfer,
    make_dsa_checkpoint,
    make_prompts,
    relative_errors,
    run_greedy,
    run_transformers,
)

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
LENGTHS = (7, 40, 130, 300)
NUM_TOKENS = 20


@pytest.fixture(scope="module", params=list(DSA_FAMILIES))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return make_dsa_checkpoint(folder, request.param, **SHAPES, **DSA_FAMILIES[request.param])


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(SHAPES["vocab_size"], lengths=LENGTHS)


def test_float32_on_the_gpu_gives_transformers_tokens(checkpoint, prompts):
    expected = run_transformers(checkpoint, prompts, NUM_TOKENS).token_ids
    assert engine_greedy_tokens(checkpoint, prompts, torch.float32, NUM_TOKENS) == expected


@torch.no_grad()
def test_bf16_prefill_logits_err_no_more_than_transformers_bf16(checkpoint, prompts):
    """A random std-0.1 model amplifies rounding (and bf16 can flip the indexer's choice of a
    near-tied token), so bf16 is judged against transformers' own bf16 on the same GPU: per
    prompt, rayinfer's median relative error from the float32 logits is at most 1.5x (+0.01)
    transformers' bf16 error."""
    from transformers import AutoModelForCausalLM

    reference = run_transformers(checkpoint, prompts, 1).prompt_logits  # float32, CPU
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
    model, config = load_rayinfer(checkpoint, dtype=torch.bfloat16, device="cuda")
    ours = run_greedy(model, config, prompts, 1, block_size=16, chunk_size=64).prompt_logits
    for i, prompt in enumerate(prompts):
        their_logits = theirs(torch.tensor([prompt], device="cuda")).logits[0].cpu()
        our_error = relative_errors(ours[i], reference[i]).median()
        their_error = relative_errors(their_logits, reference[i]).median()
        print(
            f"prompt {len(prompt)}: rayinfer bf16 {our_error:.4f}, transformers {their_error:.4f}"
        )
        assert our_error <= 1.5 * their_error + 0.01, (len(prompt), our_error, their_error)
