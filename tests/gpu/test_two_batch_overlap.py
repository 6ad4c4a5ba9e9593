"""Expert parallelism across two GPUs (dp=2 ep=2), two-batch overlap on two CUDA streams off and
on, every exchange: greedy tokens in float32 equal one GPU's, on DeepSeek-V3 and Qwen3-MoE.

    python -m pytest -q -m gpu tests/gpu/test_two_batch_overlap.py
"""

import pytest
import torch

import rayinfer
from rayinfer.config import ParallelPlan
from tests.gpu.families import greedy_tokens, needs_two_gpus, vocab_size
from tests.models.harness import make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    needs_two_gpus,
]

FAMILIES = ["deepseek_v3_h64", "qwen3_moe_v512"]
PROMPT_LENGTHS = (5, 37, 130, 300)
FLOAT32 = dict(device="cuda", dtype="float32", max_model_len=512)
EXCHANGES = {
    "nccl": {"transport": "dist"},
    "host": {"transport": "host"},
    # every token to every rank, no device sync in the layers (the tiny models' 8 experts top-2
    # would pick the deduplicated exchange on their own), with and without a rank's experts
    # applied to its own tokens beside the exchange
    "host-all-tokens": {"transport": "host", "dedup": False, "local_first": False},
    "host-all-tokens-local-first": {"transport": "host", "dedup": False, "local_first": True},
}


@pytest.fixture(scope="module")
def one_gpu_tokens(checkpoint_of):
    made = {}

    def tokens(family: str):
        if family not in made:
            prompts = make_prompts(vocab_size(family), lengths=PROMPT_LENGTHS)
            made[family] = greedy_tokens(
                rayinfer.LLM(str(checkpoint_of(family)), **FLOAT32), prompts
            )
        return made[family]

    return tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
@pytest.mark.parametrize("exchange", list(EXCHANGES))
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_gives_one_gpus_tokens(
    family, exchange, overlap, checkpoint_of, one_gpu_tokens, ray_cluster
):
    prompts = make_prompts(vocab_size(family), lengths=PROMPT_LENGTHS)
    llm = rayinfer.LLM(
        str(checkpoint_of(family)),
        parallel=ParallelPlan(dp=2, ep=2),
        two_batch_overlap=overlap,
        all_to_all=EXCHANGES[exchange],
        **FLOAT32,
    )
    assert greedy_tokens(llm, prompts) == one_gpu_tokens(family)
