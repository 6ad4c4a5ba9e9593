"""DeepSeek-V4 on CUDA against transformers on the CPU (float32), on a tiny random checkpoint with
every layer type, a window and compression rates the prompts cross, and index_topk below the
entries of the longer prompts:
- float32 on the GPU: greedy tokens equal transformers' (the CPU tests' standard);
- bf16: prefill logits (chunks of 64 over the paged prefix) no further from the float32 ones
  than transformers' own bf16 on the same GPU (skipped where transformers' V4 cannot run in
  bf16, as 5.17's cannot; tests/models/test_deepseek_v4.py then holds the CPU's bf16 to the same
  standard, and tests/gpu/test_v4_kernels.py the GPU kernels to the reference).

    python -m pytest -q -m gpu tests/gpu/test_v4_parity.py
"""

import pytest
import torch

from tests.models.harness import (
    engine_greedy_tokens,
    load_rayinfer,
    make_prompts,
    make_v4_checkpoint,
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
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    head_dim=64,
    q_lora_rank=128,
    partial_rotary_factor=0.25,
    n_routed_experts=8,
    num_experts_per_tok=2,
    sliding_window=32,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    o_groups=4,
    o_lora_rank=64,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=16,
    max_position_embeddings=4096,
)
LENGTHS = (7, 40, 130, 300)
NUM_TOKENS = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4"), **SHAPES)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(SHAPES["vocab_size"], lengths=LENGTHS)


def test_float32_on_the_gpu_gives_transformers_tokens(checkpoint, prompts):
    expected = run_transformers(checkpoint, prompts, NUM_TOKENS).token_ids
    assert engine_greedy_tokens(checkpoint, prompts, torch.float32, NUM_TOKENS) == expected


@torch.no_grad()
def test_bf16_prefill_logits_err_no_more_than_transformers_bf16(checkpoint, prompts):
    """Judged against transformers' own bf16 on the same GPU, as for DSA
    (tests/gpu/test_dsa_parity.py): per prompt, rayinfer's median relative error from the
    float32 logits is at most 1.5x (+0.01) transformers' bf16 error."""
    from transformers import AutoModelForCausalLM

    reference = run_transformers(checkpoint, prompts, 1).prompt_logits  # float32, CPU
    model, config = load_rayinfer(checkpoint, dtype=torch.bfloat16, device="cuda")
    ours = run_greedy(model, config, prompts, 1, block_size=16, chunk_size=64).prompt_logits
    errors = [relative_errors(o, r).median().item() for o, r in zip(ours, reference)]
    print("rayinfer bf16 median relative logit errors:", [f"{e:.4f}" for e in errors])
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda().eval()
    try:
        theirs(torch.tensor([prompts[0]], device="cuda"))
    except RuntimeError as error:  # transformers 5.17: float32 mHC output into bf16 weights
        pytest.skip(f"transformers' DeepSeek-V4 does not run in bf16 here: {error}")
    for i, prompt in enumerate(prompts):
        their_logits = theirs(torch.tensor([prompt], device="cuda")).logits[0].cpu()
        our_error = relative_errors(ours[i], reference[i]).median()
        their_error = relative_errors(their_logits, reference[i]).median()
        print(
            f"prompt {len(prompt)}: rayinfer bf16 {our_error:.4f}, transformers {their_error:.4f}"
        )
        assert our_error <= 1.5 * their_error + 0.01, (len(prompt), our_error, their_error)
