"""rayinfer on CUDA (bf16 and float32, Triton kernels) against transformers (float32) on tiny
random checkpoints of Llama, Qwen3-MoE and DeepSeek-V3 (families.FAMILIES), two checks a case:

- logits: one forward of rayinfer's model over a batch of prompts, the longest split into two
  chunks (chunked prefill over the paged prefix), against transformers' prefill logits of each
  prompt alone. Tolerance: twice transformers' own p99 error in that dtype (its run against its
  float32 run), at least FLOOR.
- generation: `rayinfer.LLM` greedy (mixed prefill chunks and decodes, as the engine schedules
  them at max_num_batched_tokens=64): every generated token is transformers' argmax at that
  position or within the tolerance of it (a near-tie that bf16 may flip), and its
  log-probability (SamplingParams.logprobs) within twice the tolerance of transformers' float32
  log-softmax at the 95th percentile (a bf16 routing flip moves a few further).

On an sm_90 GPU the latent-512 families' bf16 decode steps must reach the Gluon MLA kernel.

    python -m pytest -q -m gpu tests/gpu/test_engine_parity.py
"""

from dataclasses import dataclass

import pytest
import torch

import rayinfer
from rayinfer.config import ModelConfig
from rayinfer.kernels.mla import mla_decode_hopper
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata
from rayinfer.models.loader import load_model
from tests.gpu.families import vocab_size
from tests.models.harness import make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FAMILIES = [
    "llama",
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v3_dims192",
    "llama_dims128",
    "deepseek_v3_latent512_h16",
    "deepseek_v3_latent512_h128",
]
GLUON_MLA_FAMILIES = {"deepseek_v3_latent512_h16", "deepseek_v3_latent512_h128"}
PROMPT_LENGTHS = (5, 37, 130, 300)
MAX_NEW_TOKENS = 24
FLOOR = 5e-3  # float32 on the GPU: Triton's dots use tf32 (10-bit mantissa)
# bf16 MoE: a routing flip moves a logit by more than the p99 noise; the CPU reference path in
# bf16 shows 1 such token of 96 on deepseek_v3, so 5% of the tokens may be off there, none in
# float32.
OFF_TOKENS_ALLOWED = {torch.bfloat16: 0.05, torch.float32: 0.0}


@torch.no_grad()
def rayinfer_prefill_logits(path, prompts, dtype, block_size=16) -> list[torch.Tensor]:
    """Batch prefill with the last prompt in two chunks; per prompt [len, V] float32 logits."""
    config = ModelConfig.from_pretrained(path)
    model = load_model(config, dtype, torch.device("cuda"))
    lengths = [len(p) for p in prompts]
    tables, start = [], 0
    for n in lengths:
        tables.append(list(range(start, start + -(-n // block_size))))
        start += len(tables[-1])
    shape = (start, block_size, *config.kv_shape_per_token(dtype.itemsize))
    caches = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(config.num_layers)]
    first_chunk = lengths[-1] // 2
    steps = [  # (sequences, query_lens, seq_lens)
        (range(len(prompts)), lengths[:-1] + [first_chunk], lengths[:-1] + [first_chunk]),
        ([len(prompts) - 1], [lengths[-1] - first_chunk], [lengths[-1]]),
    ]
    logits = [[] for _ in prompts]
    for seqs, query_lens, seq_lens in steps:
        ids, positions = [], []
        for seq, q, s in zip(seqs, query_lens, seq_lens, strict=True):
            ids += prompts[seq][s - q : s]
            positions += list(range(s - q, s))
        attn = build_attention_metadata(
            query_lens, seq_lens, [tables[i] for i in seqs], block_size, "cuda"
        )
        hidden = model(
            torch.tensor(ids, device="cuda"),
            torch.tensor(positions, device="cuda"),
            ForwardContext(attn, caches),
        )
        out = model.compute_logits(hidden).float().cpu()
        for seq, rows in zip(seqs, out.split(query_lens), strict=True):
            logits[seq].append(rows)
    return [torch.cat(parts) for parts in logits]


@torch.no_grad()
def transformers_logits(path, prompts, dtype):
    """(the transformers model on the GPU, per prompt [len, V] float32 logits of it alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    logits = [model(torch.tensor([p], device="cuda")).logits[0].float().cpu() for p in prompts]
    return model, logits


def p99_error(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """99th percentile of |ours - reference| over every logit of every prompt (the max is
    dominated by the few tokens whose MoE routing flips on a bf16 near-tie)."""
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(ours, reference, strict=True)])
    return diffs.quantile(0.99).item()


@dataclass
class Judged:
    num_exact: int  # the float32 reference's argmax
    num_near_tie: int  # within the tolerance of it
    num_off: int
    p95_logprob_error: float


@torch.no_grad()
def judge_generation(reference, prompts, outputs, tolerance: float) -> Judged:
    """Each generated token against the float32 reference model after the same prefix."""
    gaps, errors = [], []
    for prompt, output in zip(prompts, outputs, strict=True):
        sequence = torch.tensor([prompt + list(output.token_ids)], device="cuda")
        judged = reference(sequence).logits[0, len(prompt) - 1 : -1].float()  # [new, V]
        ids = torch.tensor(list(output.token_ids), device="cuda")[:, None]  # [new, 1]
        gaps.append((judged.max(dim=1).values - judged.gather(1, ids)[:, 0]).cpu())  # [new]
        expected = torch.log_softmax(judged, dim=-1).gather(1, ids)[:, 0].cpu()  # [new]
        ours = torch.tensor([entry.chosen.logprob for entry in output.logprobs])
        errors.append((ours - expected).abs())
    gaps = torch.cat(gaps)
    return Judged(
        num_exact=int((gaps == 0).sum()),
        num_near_tie=int(((gaps > 0) & (gaps <= tolerance)).sum()),
        num_off=int((gaps > tolerance).sum()),
        p95_logprob_error=torch.cat(errors).quantile(0.95).item(),
    )


@pytest.fixture
def gluon_mla_launches(monkeypatch) -> list[int]:
    """[launches of the Gluon MLA decode split kernel] from now until the test ends."""
    launches = [0]
    launch = mla_decode_hopper.mla_decode_ws_launch

    def counted(*args, **kwargs):
        launches[0] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(mla_decode_hopper, "mla_decode_ws_launch", counted)
    return launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_transformers(family, dtype, checkpoint_of, gluon_mla_launches):
    path = checkpoint_of(family)
    prompts = make_prompts(vocab_size(family), lengths=PROMPT_LENGTHS)
    reference, exact_logits = transformers_logits(path, prompts, torch.float32)
    _, reduced_logits = transformers_logits(path, prompts, dtype)
    ours = rayinfer_prefill_logits(path, prompts, dtype)
    logit_error = p99_error(ours, exact_logits)
    tolerance = max(2 * p99_error(reduced_logits, exact_logits), FLOOR)
    assert logit_error <= tolerance, (logit_error, tolerance)

    llm = rayinfer.LLM(
        str(path), device="cuda", dtype=dtype, max_num_batched_tokens=64, max_model_len=1024
    )
    params = rayinfer.SamplingParams(
        max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5
    )
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    judged = judge_generation(reference, prompts, outputs, tolerance)
    assert judged.num_off <= int(OFF_TOKENS_ALLOWED[dtype] * MAX_NEW_TOKENS * len(prompts)), judged
    # a log-probability differs from its logit by the log-sum-exp: up to twice a logit's error
    assert judged.p95_logprob_error <= 2 * max(tolerance, logit_error), (judged, tolerance)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    if family in GLUON_MLA_FAMILIES and dtype == torch.bfloat16 and sm90:
        assert gluon_mla_launches[0] > 0
