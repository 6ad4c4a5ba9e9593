"""Where a mixed step's host time goes on one GPU: decodes beside a prompt chunk, the step that a
colocated server runs whenever a new request arrives. `rayinfer.LLM` on a full-size model with
random weights: --decodes sequences past their prompts of --context tokens decode while a new
prompt of --prompt tokens prefills in chunks of the step budget (--budget), with piecewise graphs
up to --piecewise tokens (0: eager mixed steps). Prints the median wall time of such steps, then
a cProfile of the same steps (Python functions by own time and by cumulative time) and the
torch.profiler table of their ops by CPU time.

    python benchmarks/profile_mixed_step.py --config benchmarks/configs/deepseek-v2-lite \
        --budget 1024 --piecewise 1024
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer import LLM, SamplingParams  # noqa: E402


def start_decodes(llm: LLM, decodes: int, context: int, tokens: int) -> None:
    """`decodes` sequences past their prompts, each with room for `tokens` more."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for index in range(decodes):
        engine.add_request(f"d{index}", [1 + (index + i) % 900 for i in range(context)], params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()


def mixed_steps(llm: LLM, name: str, prompt: int, run) -> list[float]:
    """Adds a prompt and runs `run(step)` over each step until its prefill is done: the wall
    times of those steps (every one carries a chunk of it beside the decodes)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(name, [7 + i % 900 for i in range(prompt)], params)
    walls = []
    while any(r.request_id == name for r in engine.scheduler.waiting) or any(
        s.request_id == name and s.num_computed_tokens < s.num_prompt_tokens
        for s in engine.scheduler.running
    ):
        start = time.perf_counter()
        run(engine.step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - start))
    return walls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens")
    parser.add_argument("--piecewise", type=int, default=1024, help="max_graph_piecewise_tokens")
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--context", type=int, default=3700)
    parser.add_argument("--prompt", type=int, default=3700)
    parser.add_argument("--rows", type=int, default=30, help="rows of each table")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    args = parser.parse_args()
    llm = LLM(args.config, device=args.device, load_format="dummy", max_model_len=8192,
              max_num_batched_tokens=args.budget, max_num_seqs=args.decodes + 1,
              enable_prefix_caching=False, max_graph_piecewise_tokens=args.piecewise)  # fmt: skip
    start_decodes(llm, args.decodes, args.context, tokens=2048)
    mixed_steps(llm, "warm-up", args.prompt, lambda step: step())
    walls = sorted(mixed_steps(llm, "timed", args.prompt, lambda step: step()))
    every = " ".join(f"{w:.1f}" for w in walls)
    print(f"=== budget {args.budget}, piecewise up to {args.piecewise}: {args.decodes} decodes "
          f"beside a {args.prompt}-token prompt: {len(walls)} mixed steps, median "
          f"{walls[len(walls) // 2]:.2f} ms (all: {every})")  # fmt: skip
    profiler = cProfile.Profile()
    steps = mixed_steps(llm, "cprofile", args.prompt, lambda step: profiler.runcall(step))
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.rows)
    stats.sort_stats("cumulative").print_stats(args.rows)
    print(f"=== cProfile over {len(steps)} mixed steps\n{text.getvalue()}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = mixed_steps(llm, "torch", args.prompt, lambda step: step())
    events = prof.key_averages()
    on_gpu = [e for e in events if e.device_type.name == "CUDA"]
    busy_ms = sum(e.self_device_time_total for e in on_gpu) / 1e3 / len(steps)
    launches = sum(e.count for e in on_gpu) / len(steps)
    print(f"=== torch.profiler over {len(steps)} mixed steps: {launches:.0f} kernels/step, "
          f"GPU busy {busy_ms:.2f} ms/step")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                       max_name_column_width=60))  # fmt: skip
    llm.shutdown()


if __name__ == "__main__":
    main()
