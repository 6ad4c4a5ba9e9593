"""`fp8_weights=True` on CUDA, bf16, on a tiny FP8 block-scaled DeepSeek-V3 (the CPU tests'
routed shapes, tests/models/test_fp8_weights.py): prompt logits against the dequantized model
within the activation quantization's error, and the engine generating with CUDA graphs on (the
default).

    python -m pytest -q -m gpu tests/gpu/test_fp8_weights.py
"""

import pytest
import torch

import rayinfer
from rayinfer.config import ModelConfig
from rayinfer.models.loader import load_model
from tests.gpu.families import greedy_tokens
from tests.models.harness import make_prompts, run_greedy
from tests.models.test_fp8_weights import ROUTED, make_fp8_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    _, path = make_fp8_checkpoint(tmp_path_factory, "routed", ROUTED)
    return path


@torch.no_grad()
def test_fp8_logits_stay_within_activation_quantization_error(fp8_checkpoint):
    """Per position, the relative error of the FP8 model's logits against the same weights
    dequantized, both in bf16 (routing flips included: top-2 of 8 experts)."""
    config = ModelConfig.from_pretrained(fp8_checkpoint)
    prompts = make_prompts(config.vocab_size)
    logits = {}
    for fp8 in (True, False):
        model = load_model(config, torch.bfloat16, "cuda", fp8_weights=fp8)
        run = run_greedy(model, config, prompts, 8, dtype=torch.bfloat16)
        logits[fp8] = torch.cat(run.prompt_logits).float()
    mine, theirs = logits[True], logits[False]
    assert torch.isfinite(mine).all()
    relative = (mine - theirs).norm(dim=-1) / theirs.norm(dim=-1)  # [positions]
    assert relative.median() < 0.15, relative
    assert (mine.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.7


def test_llm_generates_with_fp8_weights(fp8_checkpoint):
    prompts = make_prompts(ModelConfig.from_pretrained(fp8_checkpoint).vocab_size)
    llm = rayinfer.LLM(str(fp8_checkpoint), device="cuda", fp8_weights=True, max_model_len=128)
    assert [len(tokens) for tokens in greedy_tokens(llm, prompts)] == [16] * len(prompts)
