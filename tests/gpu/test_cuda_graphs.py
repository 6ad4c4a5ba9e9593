"""CUDA graphs against eager steps on a GPU, greedy tokens:

- decode graphs on one GPU (Llama, Qwen3-MoE, DeepSeek-V3): five prompts whose max_tokens differ,
  so that the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1 (buckets 8, 4, 2, 1, padding rows
  included). float32 is exact; in bf16 a sequence may part only on a near-tie (the float32
  transformers logits of the two tokens closer than NEAR_TIE);
- prefill graphs on one GPU: every new prompt prefilled from a graph (padded to a token bucket),
  float32, exact against eager prefill;
- piecewise graphs on one GPU: prompt chunks beside decodes replayed in pieces with attention
  eager between them, float32, exact against eager steps;
- with two GPUs, float32, exact against one GPU: decode steps replayed from graphs with NCCL
  inside (dp=2 ep=2, an idle replica, tp=2 ep=2) and prefill from graphs across dp=2 ep=2 (NCCL
  and host-staged exchanges, local_first forced on).

    python -m pytest -q -m gpu tests/gpu/test_cuda_graphs.py
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
]

SHRINKING_LENGTHS = (5, 37, 130, 11, 60)
SHRINKING_MAX_TOKENS = (40, 30, 20, 10, 5)  # the decode batch shrinks as requests finish
NEAR_TIE = 0.25  # float32 logit gap that bf16 rounding may flip (their p99 error is 0.12-0.44)
PROMPT_LENGTHS = (5, 37, 130, 300)
FLOAT32 = dict(device="cuda", dtype="float32", max_model_len=512)


def shrinking_batch_tokens(path, dtype, cuda_graphs: bool, prompts) -> list[list[int]]:
    llm = rayinfer.LLM(
        str(path),
        device="cuda",
        dtype=dtype,
        cuda_graphs=cuda_graphs,
        max_num_seqs=8,
        max_model_len=1024,
    )
    return greedy_tokens(llm, prompts, SHRINKING_MAX_TOKENS)


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return position
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


@torch.no_grad()
def float32_logit_gap(path, context: list[int], token_a: int, token_b: int) -> float:
    """|logit(a) - logit(b)| of the float32 transformers model after `context`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    logits = model(torch.tensor([context], device="cuda")).logits[0, -1]
    return abs(float(logits[token_a] - logits[token_b]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_decode_graphs_give_the_eager_tokens(family, dtype, checkpoint_of):
    path = checkpoint_of(family)
    prompts = make_prompts(vocab_size(family), lengths=SHRINKING_LENGTHS)
    eager = shrinking_batch_tokens(path, dtype, False, prompts)
    graphs = shrinking_batch_tokens(path, dtype, True, prompts)
    for prompt, ours, theirs in zip(prompts, graphs, eager, strict=True):
        position = first_difference(ours, theirs)
        if position is None:
            continue
        assert dtype == torch.bfloat16, (len(prompt), position, ours, theirs)
        assert position < min(len(ours), len(theirs)), (ours, theirs)
        gap = float32_logit_gap(path, prompt + theirs[:position], ours[position], theirs[position])
        assert gap <= NEAR_TIE, (len(prompt), position, gap)


def count_prefill_replays(llm: rayinfer.LLM) -> list[int]:
    """A one-GPU LLM's prefill-graph runs from now on: the token bucket of each."""
    graphs, buckets = llm.engine.executor.runner.prefill_graphs, []
    run = graphs.run
    graphs.run = lambda requests, bucket: buckets.append(bucket) or run(requests, bucket)
    return buckets


@pytest.mark.parametrize("family", ["deepseek_v3_h64", "qwen3_moe_v512"])
def test_prefill_graphs_give_the_eager_tokens(family, checkpoint_of):
    path = str(checkpoint_of(family))
    prompts = make_prompts(vocab_size(family), lengths=PROMPT_LENGTHS)
    one_at_a_time = dict(FLOAT32, max_num_seqs=1)
    expected = greedy_tokens(rayinfer.LLM(path, cuda_graphs=False, **one_at_a_time), prompts)
    llm = rayinfer.LLM(path, cuda_graphs=True, **one_at_a_time)
    buckets = count_prefill_replays(llm)
    assert greedy_tokens(llm, prompts) == expected
    assert len(buckets) == len(prompts), buckets


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_piecewise_graphs_give_the_eager_tokens(family, checkpoint_of):
    """Five prompts chunked beside each other's decodes (a 64-token budget), their max_tokens
    differing so the mixes change as they finish; float32, exact against eager steps."""
    path = str(checkpoint_of(family))
    prompts = make_prompts(vocab_size(family), lengths=SHRINKING_LENGTHS)
    mixed = dict(FLOAT32, max_num_seqs=8, max_num_batched_tokens=64, max_graph_prefill_tokens=0)
    expected = greedy_tokens(rayinfer.LLM(path, cuda_graphs=False, **mixed), prompts,
                             SHRINKING_MAX_TOKENS)  # fmt: skip
    llm = rayinfer.LLM(path, cuda_graphs=True, **mixed)
    graphs, buckets = llm.engine.executor.runner.piecewise_graphs, []
    run = graphs.run
    graphs.run = lambda requests, bucket: buckets.append(bucket) or run(requests, bucket)
    assert greedy_tokens(llm, prompts, SHRINKING_MAX_TOKENS) == expected
    assert len(buckets) >= 3, buckets  # the steps that mixed


@pytest.fixture(scope="module")
def one_gpu_tokens(checkpoint_of):
    """one_gpu_tokens(family, max_num_seqs) -> greedy tokens of PROMPT_LENGTHS on one GPU, eager."""
    made = {}

    def tokens(family: str, max_num_seqs: int):
        if (family, max_num_seqs) not in made:
            path = str(checkpoint_of(family))
            prompts = make_prompts(vocab_size(family), lengths=PROMPT_LENGTHS)
            llm = rayinfer.LLM(path, cuda_graphs=False, max_num_seqs=max_num_seqs, **FLOAT32)
            made[family, max_num_seqs] = greedy_tokens(llm, prompts)
        return made[family, max_num_seqs]

    return tokens


# Decode steps from graphs across workers: NCCL kernels captured (the all-tokens exchange,
# all-reduces); every replica replays the bucket its driver agreed on, an idle one on padding.
@needs_two_gpus
@pytest.mark.parametrize("transport", ["auto", "host"])
@pytest.mark.parametrize(
    "family,plan,chosen",
    [
        ("deepseek_v3_h64", ParallelPlan(dp=2, ep=2), slice(None)),
        ("deepseek_v3_h64", ParallelPlan(dp=2, ep=2), slice(1, 2)),  # one prompt: a replica idles
        ("qwen3_moe_v512", ParallelPlan(dp=2, ep=2), slice(None)),
        ("qwen3_moe_v512", ParallelPlan(tp=2, ep=2), slice(None)),
    ],
    ids=["deepseek-dp2", "deepseek-dp2-idle-replica", "qwen3-dp2", "qwen3-tp2"],
)
def test_decode_graphs_across_gpus_give_one_gpus_tokens(
    family, plan, chosen, transport, checkpoint_of, one_gpu_tokens, ray_cluster
):
    prompts = make_prompts(vocab_size(family), lengths=PROMPT_LENGTHS)[chosen]
    llm = rayinfer.LLM(
        str(checkpoint_of(family)),
        parallel=plan,
        cuda_graphs=True,
        all_to_all={"transport": transport},
        max_num_seqs=8,
        **FLOAT32,
    )
    steps = llm.engine.executor.step_counts
    assert greedy_tokens(llm, prompts) == one_gpu_tokens(family, 8)[chosen]
    assert steps["graph"] > 0, steps


@needs_two_gpus
@pytest.mark.parametrize(
    "exchange",
    [
        {"transport": "dist"},
        {"transport": "host"},
        {"transport": "host", "dedup": False, "local_first": True},
    ],
    ids=["nccl", "host", "host-local-first"],
)
@pytest.mark.parametrize(
    "chosen", [slice(0, 2), slice(2, 3), slice(None)], ids=["two", "one-idle-replica", "four"]
)
def test_prefill_graphs_across_gpus_give_one_gpus_tokens(
    exchange, chosen, checkpoint_of, one_gpu_tokens, ray_cluster
):
    """dp=2 ep=2 with one prompt per replica a step (max_num_seqs=2)."""
    family = "deepseek_v3_h64"
    prompts = make_prompts(vocab_size(family), lengths=PROMPT_LENGTHS)[chosen]
    llm = rayinfer.LLM(
        str(checkpoint_of(family)),
        parallel=ParallelPlan(dp=2, ep=2),
        cuda_graphs=True,
        all_to_all=exchange,
        max_num_seqs=2,
        **FLOAT32,
    )
    steps = llm.engine.executor.step_counts
    assert greedy_tokens(llm, prompts) == one_gpu_tokens(family, 2)[chosen]
    assert steps["prefill_graph"] > 0, steps
