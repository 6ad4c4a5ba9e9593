"""rayinfer on CUDA (bf16, Triton kernels) against transformers (float32) on tiny random checkpoints
of Llama, Qwen3-MoE and DeepSeek-V3.

Two checks per family:
- logits: one forward of rayinfer's model over a batch of prompts, the longest split into two
  chunks (chunked prefill over the paged prefix), vs transformers' prefill logits, each prompt
  alone. bf16 tolerance: max |diff| <= 3% of the reference logits' max |value|.
- generation: `rayinfer.LLM(device=DEVICE)` greedy (mixed prefill chunks and decodes, as the
  engine schedules them with max_num_batched_tokens=64); every generated token must be
  transformers' argmax at that position, or within the logits tolerance of it (a bf16 near-tie),
  and its log-probability (SamplingParams.logprobs) within twice that of transformers' float32
  log-softmax (95% of the tokens: a bf16 routing flip moves a few further).

    python benchmarks/gpu_engine_parity.py [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rayinfer  # noqa: E402
from rayinfer.config import ModelConfig  # noqa: E402
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata  # noqa: E402
from rayinfer.models.loader import load_model  # noqa: E402
from tests.models.harness import make_hf_checkpoint, make_prompts  # noqa: E402

COMMON = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=4096,
)
CASES = {
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
    ),  # fmt: skip
    "deepseek_v3": (
        "deepseek_v3",
        dict(
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
        ),
    ),  # fmt: skip
}
# Production head dims, so that the prefill takes the kernels the real models get: MLA's expanded
# form at qk 128 + 64 rope and v 128 (the warp-specialized Gluon kernel on an H200).
CASES["deepseek_v3_dims192"] = (
    "deepseek_v3",
    dict(CASES["deepseek_v3"][1], qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
         kv_lora_rank=128),
)  # fmt: skip
# And Llama at head dim 128: its prompts' first chunks attend to the step's own K/V through the
# contiguous kernel (the Gluon one on an H200), the later chunks through the paged one.
CASES["llama_dims128"] = ("llama", dict(COMMON, hidden_size=512, num_key_value_heads=2))
# And DeepSeek's decode shapes (latent 512 + rope 64) at 16 and 128 heads: the decode steps take
# the Gluon MLA split kernel on an H200 (tokens-major at 16 heads, heads-major at 128).
for heads in (16, 128):
    CASES[f"deepseek_v3_latent512_h{heads}"] = (
        "deepseek_v3",
        dict(CASES["deepseek_v3_dims192"][1], kv_lora_rank=512, num_attention_heads=heads,
             num_key_value_heads=heads),
    )  # fmt: skip
PROMPT_LENGTHS = (5, 37, 130, 300)
MAX_NEW_TOKENS = 24
FLOOR = 5e-3  # float32 on GPU: Triton's dots use tf32 (10-bit mantissa)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEVICE = "cuda"  # --device cpu runs the same checks through the torch references


@torch.no_grad()
def rayinfer_prefill_logits(path: Path, prompts: list[list[int]], dtype, block_size=16) -> list:
    """Batch prefill with the last prompt in two chunks; per prompt [len, V] float32 logits."""
    config = ModelConfig.from_pretrained(path)
    model = load_model(config, dtype, torch.device(DEVICE))
    lengths = [len(p) for p in prompts]
    tables, start = [], 0
    for n in lengths:
        tables.append(list(range(start, start + -(-n // block_size))))
        start += len(tables[-1])
    shape = (start, block_size, *config.kv_shape_per_token(dtype.itemsize))
    caches = [torch.zeros(shape, dtype=dtype, device=DEVICE)
              for _ in range(config.num_layers)]  # fmt: skip
    first_chunk = lengths[-1] // 2
    steps = [  # (query_lens, seq_lens, token rows of each sequence)
        (lengths[:-1] + [first_chunk], lengths[:-1] + [first_chunk]),
        ([lengths[-1] - first_chunk], [lengths[-1]]),
    ]
    logits = [[] for _ in prompts]
    for step, (query_lens, seq_lens) in enumerate(steps):
        seqs = range(len(prompts)) if step == 0 else [len(prompts) - 1]
        ids, positions = [], []
        for seq, q, s in zip(seqs, query_lens, seq_lens, strict=True):
            ids += prompts[seq][s - q : s]
            positions += list(range(s - q, s))
        attn = build_attention_metadata(query_lens, seq_lens, [tables[i] for i in seqs],
                                        block_size, DEVICE)  # fmt: skip
        hidden = model(torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE),
                       ForwardContext(attn, caches))  # fmt: skip
        out = model.compute_logits(hidden).float().cpu()
        for seq, rows in zip(seqs, out.split(query_lens), strict=True):
            logits[seq].append(rows)
    return [torch.cat(parts) for parts in logits]


def transformers_logits(path: Path, prompts: list[list[int]], dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([p], device=DEVICE)).logits[0].float().cpu() for p in prompts]
    return model, logits


@torch.no_grad()
def judge_generation(reference, prompts, outputs, tolerance: float) -> dict:
    """Each generated token: the float32 reference's argmax (exact), within `tolerance` of it
    (a near-tie that bf16 may flip), or off."""
    counts = dict(tokens_exact=0, tokens_near_tie=0, tokens_off=0)
    errors = []
    for prompt, output in zip(prompts, outputs, strict=True):
        sequence = torch.tensor([prompt + list(output.token_ids)], device=DEVICE)
        judged = reference(sequence).logits[0, len(prompt) - 1 : -1].float()  # [new, V]
        ids = torch.tensor(list(output.token_ids), device=DEVICE)[:, None]
        chosen = judged.gather(1, ids)[:, 0]
        gaps = judged.max(dim=1).values - chosen  # [new]: 0 where ours is the argmax
        counts["tokens_exact"] += int((gaps == 0).sum())
        counts["tokens_near_tie"] += int(((gaps > 0) & (gaps <= tolerance)).sum())
        counts["tokens_off"] += int((gaps > tolerance).sum())
        # SamplingParams.logprobs: ours against the float32 reference's log-softmax
        expected = torch.log_softmax(judged, dim=-1).gather(1, ids)[:, 0].cpu()
        ours = torch.tensor([entry.chosen.logprob for entry in output.logprobs])
        errors.append((ours - expected).abs())
    errors = torch.cat(errors)
    counts["max_logprob_error"] = errors.max().item()
    # as tokens_off may hold 5% of the tokens (a bf16 routing flip), so may these
    counts["p95_logprob_error"] = errors.quantile(0.95).item()
    return counts


def p99_error(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """99th percentile of |ours - reference| over every logit of every prompt (the max is
    dominated by the few tokens whose MoE routing flips on a bf16 near-tie)."""
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(ours, reference, strict=True)])
    return diffs.quantile(0.99).item()


def check_family(name: str, model_type: str, overrides: dict, folder: Path, dtype) -> dict:
    """Tolerance: 2x transformers' own p99 error in `dtype` (its run vs its float32 run)."""
    path = make_hf_checkpoint(folder / name, model_type, **overrides)
    prompts = make_prompts(overrides["vocab_size"], lengths=PROMPT_LENGTHS)
    reference, exact_logits = transformers_logits(path, prompts, torch.float32)
    _, reduced_logits = transformers_logits(path, prompts, dtype)
    ours = rayinfer_prefill_logits(path, prompts, dtype)
    ours_error = p99_error(ours, exact_logits)
    hf_error = p99_error(reduced_logits, exact_logits)
    tolerance = max(2 * hf_error, FLOOR)
    llm = rayinfer.LLM(
        str(path), device=DEVICE, dtype=dtype, max_num_batched_tokens=64, max_model_len=1024
    )
    params = rayinfer.SamplingParams(
        max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5
    )
    tokens = judge_generation(reference, prompts, llm.generate(prompts, params), tolerance)
    logits_ok = ours_error <= tolerance
    # bf16 MoE: a routing flip moves a logit by more than the p99 noise; the CPU reference path
    # in bf16 shows 1 such token of 96 on deepseek_v3, so allow 5% there and none in float32.
    allowed_off = 0 if dtype == torch.float32 else int(0.05 * MAX_NEW_TOKENS * len(prompts))
    # a log-probability differs from its logit by the log-sum-exp: up to 2x a logit error
    logprobs_ok = tokens["p95_logprob_error"] <= 2 * max(tolerance, ours_error)
    return dict(
        family=name,
        dtype=str(dtype),
        p99_logit_error=ours_error,
        max_logit_error=max((a - b).abs().max().item() for a, b in zip(ours, exact_logits)),
        transformers_p99_error=hf_error,
        tolerance=tolerance,
        logits_ok=logits_ok,
        **tokens,
        logprobs_ok=logprobs_ok,
        ok=logits_ok and tokens["tokens_off"] <= allowed_off and logprobs_ok,
    )


@contextlib.contextmanager
def counting_gluon_mla_launches():
    """[launches of the Gluon MLA decode split kernel] while the block runs: whether the engine's
    decode steps reached it (the latent-512 families on an H200 should)."""
    from rayinfer.kernels.mla import mla_decode_hopper

    launches = [0]
    launch = mla_decode_hopper.mla_decode_ws_launch

    def counted(*args, **kwargs):
        launches[0] += 1
        return launch(*args, **kwargs)

    mla_decode_hopper.mla_decode_ws_launch = counted
    try:
        yield launches
    finally:
        mla_decode_hopper.mla_decode_ws_launch = launch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--families", default=",".join(CASES), help="comma-separated")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_engine_parity needs a CUDA GPU")
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.families.split(","):
            model_type, overrides = CASES[name]
            for dtype in args.dtypes.split(","):
                try:
                    with counting_gluon_mla_launches() as launches:
                        row = check_family(name, model_type, overrides, Path(folder), DTYPES[dtype])
                    rows.append({**row, "gluon_mla_decode_launches": launches[0]})
                except Exception as error:  # report every family, then fail
                    error = f"{type(error).__name__}: {error}"
                    rows.append(dict(family=name, dtype=dtype, ok=False, error=error))
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
