"""Decode CUDA graphs on one GPU: greedy parity with the eager engine, decode speed, capture time.

1. correctness: greedy tokens with `cuda_graphs=True` vs `False` on tiny random checkpoints of
   Llama, Qwen3-MoE and DeepSeek-V3 (made here through transformers), five prompts whose
   max_tokens differ so that the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1 (buckets 8, 4, 2, 1,
   padding rows included). float32 must be exact; a bf16 mismatch is reported with its first
   differing position and the float32 transformers logit gap between the two tokens there.
2. speed: decode tokens/s of the `--config` model (random weights, load_format="dummy") at batch
   1, 8 and 64 with the graphs off and on in the same process (one LLM: its runner's graphs are
   switched off for the eager runs), 32 decode steps after a 32-token prompt, median of 3 after
   one warm-up run; plus the LLM start time and the warm-up + capture time of the graphs.

    PYTHONPATH=$PWD python benchmarks/gpu_cuda_graphs.py \
        --config benchmarks/configs/deepseek-v2-lite --out $OUT/cuda_graphs.json
    python benchmarks/gpu_cuda_graphs.py --smoke   # CPU, tiny models: the script's own check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rayinfer  # noqa: E402
from tests.models.harness import make_hf_checkpoint, make_prompts  # noqa: E402

COMMON = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=4096,
)
FAMILIES = {
    "llama": ("llama", dict(COMMON, num_key_value_heads=2)),
    "qwen3_moe": ("qwen3_moe", dict(COMMON, num_key_value_heads=2, head_dim=64, num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=128)),
    "deepseek_v3": ("deepseek_v3", dict(COMMON, num_key_value_heads=4, kv_lora_rank=64,
                                        q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                        v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=128, first_k_dense_replace=1,
                                        n_group=1, topk_group=1)),
}  # fmt: skip
PROMPT_LENGTHS = (5, 37, 130, 11, 60)
MAX_TOKENS = (40, 30, 20, 10, 5)  # the batch shrinks as requests finish
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SPEED_BATCHES = (1, 8, 64)
DECODE_STEPS = 32
PROMPT_TOKENS = 32
REPEATS = 3


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- 1. correctness ----------------------------------------------------------------------------
def generate(path: Path, device: str, dtype, cuda_graphs: bool, prompts) -> list[list[int]]:
    llm = rayinfer.LLM(str(path), device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                       max_num_seqs=8, max_model_len=1024)  # fmt: skip
    params = [
        rayinfer.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS
    ]
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    llm.shutdown()
    return tokens


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return position
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


@torch.no_grad()
def logit_gap(path: Path, device: str, context: list[int], token_a: int, token_b: int) -> float:
    """|logit(a) - logit(b)| of the float32 transformers model after `context`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    logits = model(torch.tensor([context], device=device)).logits[0, -1].float()
    return abs(float(logits[token_a] - logits[token_b]))


def check_family(name: str, folder: Path, device: str, dtypes: list[str]) -> list[dict]:
    model_type, overrides = FAMILIES[name]
    path = make_hf_checkpoint(folder / name, model_type, **overrides)
    prompts = make_prompts(overrides["vocab_size"], lengths=PROMPT_LENGTHS)
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        eager = generate(path, device, dtype, False, prompts)
        graphs = generate(path, device, dtype, True, prompts)
        mismatches = []
        for index, (prompt, ours, theirs) in enumerate(zip(prompts, graphs, eager)):
            position = first_difference(ours, theirs)
            if position is None:
                continue
            mismatch = dict(prompt=index, position=position, of=len(theirs))
            if position < min(len(ours), len(theirs)):
                context = prompt + theirs[:position]
                mismatch.update(graph_token=ours[position], eager_token=theirs[position])
                mismatch["fp32_logit_gap"] = logit_gap(
                    path, device, context, ours[position], theirs[position]
                )
            mismatches.append(mismatch)
        ok = not mismatches or dtype == torch.bfloat16  # bf16: reported, judged by the gaps
        rows.append(dict(family=name, dtype=dtype_name, tokens=sum(map(len, eager)),
                         mismatches=mismatches, ok=ok))  # fmt: skip
        log(f"parity {name} {dtype_name}: {'exact' if not mismatches else mismatches}")
    return rows


# --- 2. speed ----------------------------------------------------------------------------------
def decode_tokens_per_s(llm: rayinfer.LLM, batch: int, tag: str) -> float:
    """`batch` requests prefilled together, then DECODE_STEPS pure-decode steps timed."""
    engine = llm.engine
    params = rayinfer.SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)
    request_ids = [f"{tag}-{i}" for i in range(batch)]
    for i, request_id in enumerate(request_ids):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(PROMPT_TOKENS)]
        engine.add_request(request_id, prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running
    ):
        engine.step()  # prefill (samples the first token)
    _synchronize(llm)
    start = time.perf_counter()
    steps = 0
    while scheduler.running or scheduler.waiting:
        engine.step()
        steps += 1
    _synchronize(llm)
    elapsed = time.perf_counter() - start
    for request_id in request_ids:
        engine.abort(request_id)  # no-op for finished requests; frees anything left
    return batch * steps / elapsed


def _synchronize(llm: rayinfer.LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize()


def measure_speed(config: str, device: str, batches: tuple[int, ...]) -> dict:
    start = time.perf_counter()
    llm = rayinfer.LLM(config, device=device, load_format="dummy", cuda_graphs=True,
                       max_num_seqs=max(batches), max_model_len=8192,
                       enable_prefix_caching=False)  # fmt: skip
    start_s = time.perf_counter() - start
    graphs = llm.engine.executor.runner.decode_graphs
    log(f"speed model up in {start_s:.1f} s (graphs captured in {llm.graph_capture_seconds:.1f} s"
        f", batch sizes {graphs.sizes})")  # fmt: skip
    rows = []
    for batch in batches:
        row = dict(batch=batch)
        for mode, enabled in (("eager", False), ("graphs", True)):
            graphs.enabled = enabled
            decode_tokens_per_s(llm, batch, f"warm-{mode}-{batch}")  # compiles, warms caches
            runs = [decode_tokens_per_s(llm, batch, f"{mode}-{batch}-{r}") for r in range(REPEATS)]
            row[f"{mode}_tok_s"] = statistics.median(runs)
            row[f"{mode}_runs"] = runs
        row["speedup"] = row["graphs_tok_s"] / row["eager_tok_s"]
        log(f"batch {batch}: eager {row['eager_tok_s']:.1f} tok/s, graphs "
            f"{row['graphs_tok_s']:.1f} tok/s ({row['speedup']:.2f}x)")  # fmt: skip
        rows.append(row)
    graphs.enabled = True
    return dict(config=config, start_s=start_s, capture_s=llm.graph_capture_seconds,
                graph_batch_sizes=graphs.sizes, rows=rows)  # fmt: skip


# --- main --------------------------------------------------------------------------------------
def print_table(results: dict) -> None:
    print("\n| check | dtype | result |\n|---|---|---|")
    for row in results.get("parity", []):
        if "error" in row:
            result = f"ERROR {row['error']}"
        elif not row["mismatches"]:
            result = f"exact ({row['tokens']} tokens)"
        else:
            result = "; ".join(
                f"prompt {m['prompt']} differs at {m['position']}/{m['of']}"
                + (f" (fp32 gap {m['fp32_logit_gap']:.2e})" if "fp32_logit_gap" in m else "")
                for m in row["mismatches"]
            )
        print(f"| {row['family']} graphs vs eager | {row['dtype']} | {result} |")
    speed = results.get("speed")
    if speed:
        print(f"\ncapture: {speed['capture_s']:.1f} s for batch sizes {speed['graph_batch_sizes']}"
              f" (LLM start incl. capture {speed['start_s']:.1f} s)")  # fmt: skip
        print("\n| batch | eager tok/s | graphs tok/s | speed-up |\n|---|---|---|---|")
        for row in speed["rows"]:
            print(f"| {row['batch']} | {row['eager_tok_s']:.1f} | {row['graphs_tok_s']:.1f} | "
                  f"{row['speedup']:.2f}x |")  # fmt: skip
    if "speed_error" in results:
        print(f"\nspeed: ERROR {results['speed_error']}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/deepseek-v2-lite",
                        help="folder with config.json for the speed part")  # fmt: skip
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models only")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_cuda_graphs needs a CUDA GPU (or --smoke)")
        return 2
    results: dict = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    out = Path(args.out) if args.out else None

    def save() -> None:
        if out is not None:
            out.write_text(json.dumps(results, indent=1))

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        if not args.skip_parity:
            results["parity"] = []
            dtypes = ["float32"] if args.smoke else ["bfloat16", "float32"]
            for name in FAMILIES:
                try:
                    results["parity"] += check_family(name, Path(folder), device, dtypes)
                except Exception as error:  # report every family, then fail
                    error = f"{type(error).__name__}: {error}"
                    row = dict(family=name, dtype=",".join(dtypes), ok=False, error=error)
                    results["parity"].append(row)
                save()
        if not args.skip_speed:
            speed_config = args.config
            batches = SPEED_BATCHES
            if args.smoke:  # the tiny DeepSeek-V3 checkpoint stands in for the full model
                speed_config = str(make_hf_checkpoint(Path(folder) / "speed", "deepseek_v3",
                                                      **FAMILIES["deepseek_v3"][1]))  # fmt: skip
                batches = (1, 8)
            try:
                results["speed"] = measure_speed(speed_config, device, batches)
            except Exception as error:
                results["speed_error"] = f"{type(error).__name__}: {error}"
    results["wall_s"] = time.perf_counter() - started
    save()
    print(f"\nwall {results['wall_s']:.0f} s")
    print_table(results)
    ok = all(row["ok"] for row in results.get("parity", [])) and "speed_error" not in results
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
