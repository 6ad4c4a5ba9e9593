"""fp8_weights=True split over CPU workers: tensor parallelism slices the FP8 weights and their
128x128 block scales along whole blocks, expert parallelism splits the FP8 experts; both give the
single-worker FP8 greedy tokens."""

import pytest

import rayinfer
from rayinfer import ParallelPlan, SamplingParams
from tests.models.harness import make_prompts
from tests.models.test_deepseek import make_deepseek_checkpoint
from tests.models.test_fp8_weights import FP8_SHAPES, quantize_like_deepseek_v3
from tests.models.test_loader import rewrite_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# every tensor-parallel slice whole 128-blocks at tp=2: q 4 x 64 -> 128, o_proj input 4 x 64 ->
# 128, dense gate/up 256 -> 128, shared experts 2 x 128 -> 128
TP2_SHAPES = dict(FP8_SHAPES, v_head_dim=64, n_shared_experts=2, n_group=4, topk_group=2)


@pytest.fixture(scope="module")
def fp8_path(tmp_path_factory):
    source = make_deepseek_checkpoint(tmp_path_factory.mktemp("ds"), "deepseek_v3", **TP2_SHAPES)
    target = tmp_path_factory.mktemp("ds-fp8") / "ckpt"
    return rewrite_checkpoint(source, target, quantize_like_deepseek_v3)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(128, lengths=(5, 13, 3))


@pytest.fixture(scope="module")
def single_worker_tokens(fp8_path, prompts):
    llm = rayinfer.LLM(str(fp8_path), device="cpu", fp8_weights=True)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize(
    "plan", [ParallelPlan(tp=2), ParallelPlan(dp=2, ep=2)], ids=str
)  # heads and dense layers split / experts exchanged with dispatch and combine
def test_fp8_plan_gives_the_single_worker_tokens(
    ray_cluster, fp8_path, prompts, single_worker_tokens, plan
):
    llm = rayinfer.LLM(str(fp8_path), device="cpu", parallel=plan, fp8_weights=True)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == single_worker_tokens
    finally:
        llm.shutdown()
