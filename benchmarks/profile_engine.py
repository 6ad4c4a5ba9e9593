"""Where a step's time goes on one GPU: torch.profiler over decode steps (batch 1 and 64) and one
prefill (4,096 tokens, or --prefill-tokens) of a full-size model with random weights. Prints the
top ops by CUDA and by CPU time and the kernel launches per decode step, the numbers that say
whether decode is bound by launches and Python (the case for CUDA graphs) or by kernels.

    python benchmarks/profile_engine.py --config benchmarks/configs/deepseek-v2-lite
    python benchmarks/profile_engine.py --config ... --skip-prefill --batches 32 --context 8192
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer import LLM, SamplingParams  # noqa: E402


def decode_steps(llm: LLM, batch: int, steps: int, context: int) -> None:
    """Decode steps of `batch` sequences over prompts of `context` tokens (prefilled first)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 96, temperature=0, ignore_eos=True)
    prompt = [100 + i % 1000 for i in range(context)]
    for index in range(batch):
        engine.add_request(f"p{batch}-{index}", prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill
    for _ in range(4):
        engine.step()  # warm-up decodes
    torch.cuda.synchronize()
    walls = []
    for _ in range(16):  # without the profiler: the step as the engine runs it
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    wall_ms = 1e3 * sorted(walls)[8]
    print(f"\n=== decode batch {batch}, context {context}: wall {wall_ms:.2f} ms/step (median)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for request_id in [f"p{batch}-{index}" for index in range(batch)]:
        engine.abort(request_id)
    report(prof, f"decode batch {batch}, context {context}, {steps} steps", steps)


def report(prof, title: str, steps: int) -> None:
    events = prof.key_averages()
    on_gpu = [e for e in events if e.device_type.name == "CUDA"]
    launches = sum(e.count for e in on_gpu) / steps
    busy_ms = sum(e.self_device_time_total for e in on_gpu) / 1e3 / steps
    print(f"\n=== {title}: {launches:.0f} kernels/step, GPU busy {busy_ms:.2f} ms/step")
    print(events.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="the profiled prompt")
    args = parser.parse_args()
    largest = max(args.batches)
    per_seq = args.context + 256  # the prompt, the steps and the block table's slack
    prompt_len = args.prefill_tokens
    llm = LLM(args.config, device="cuda", load_format="dummy",
              max_model_len=max(8192, per_seq, prompt_len + 16),
              max_num_batched_tokens=max(4096, prompt_len),
              enable_prefix_caching=False, max_num_seqs=max(64, largest),
              num_kv_blocks=max(8192 * 4, largest * per_seq) // 16)  # fmt: skip
    if not args.skip_prefill:
        first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate([list(range(prompt_len))], first)  # warm-up at the measured shape
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([list(range(1, prompt_len + 1))], first)
            torch.cuda.synchronize()
        report(prof, f"prefill {prompt_len} tokens", 1)
    for batch in args.batches:
        decode_steps(llm, batch, 8, args.context)


if __name__ == "__main__":
    main()
