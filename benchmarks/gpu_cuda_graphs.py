"""Decode CUDA graphs on one GPU: decode speed and capture time (tests/gpu/test_cuda_graphs.py
checks that the graphs give the eager tokens).

Decode tokens/s of the `--config` model (random weights, load_format="dummy") at batch 1, 8 and
64 with the graphs off and on in the same process (one LLM: its runner's graphs are switched off
for the eager runs), 32 decode steps after a 32-token prompt, median of 3 after one warm-up run;
plus the LLM start time and the warm-up + capture time of the graphs.

    PYTHONPATH=$PWD python benchmarks/gpu_cuda_graphs.py \
        --config benchmarks/configs/deepseek-v2-lite --out $OUT/cuda_graphs.json
    python benchmarks/gpu_cuda_graphs.py --smoke   # CPU, the built-in tiny model: a quick run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rayinfer  # noqa: E402

SPEED_BATCHES = (1, 8, 64)
DECODE_STEPS = 32
PROMPT_TOKENS = 32
REPEATS = 3


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


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


def print_table(speed: dict) -> None:
    print(f"\ncapture: {speed['capture_s']:.1f} s for batch sizes {speed['graph_batch_sizes']}"
          f" (LLM start incl. capture {speed['start_s']:.1f} s)")  # fmt: skip
    print("\n| batch | eager tok/s | graphs tok/s | speed-up |\n|---|---|---|---|")
    for row in speed["rows"]:
        print(f"| {row['batch']} | {row['eager_tok_s']:.1f} | {row['graphs_tok_s']:.1f} | "
              f"{row['speedup']:.2f}x |")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="benchmarks/configs/deepseek-v2-lite",
                        help="folder with config.json")  # fmt: skip
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--smoke", action="store_true", help="CPU, the built-in tiny model")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_cuda_graphs needs a CUDA GPU (or --smoke)")
        return 2
    started = time.perf_counter()
    config, batches = ("tiny", (1, 8)) if args.smoke else (args.config, SPEED_BATCHES)
    speed = measure_speed(config, device, batches)
    results = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        speed=speed,
        wall_s=time.perf_counter() - started,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nwall {results['wall_s']:.0f} s")
    print_table(speed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
