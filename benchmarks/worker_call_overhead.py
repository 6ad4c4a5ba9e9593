"""What a worker group's step costs on the host around the model: the engine, sending the step
to the workers (pickling and Ray's call) and the results' way back, from the step timelines, on
the CPU with the built-in tiny model, for decode steps of many long-context requests (where the
block tables dominate what is sent).

    python benchmarks/worker_call_overhead.py [--batch 256] [--context 512] [--steps 8]

block_size 1 makes every token its own block, so a 512-token context is a 512-block table, as
an 8k-token context is at block_size 16.
"""

from __future__ import annotations

import argparse
import json

import rayinfer
from rayinfer import ParallelPlan, SamplingParams


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    llm = rayinfer.LLM(
        "tiny",
        device="cpu",
        parallel=ParallelPlan(dp=2, ep=2),
        block_size=1,
        max_model_len=args.context + args.steps + 8,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.batch * args.context,
        num_kv_blocks=args.batch * (args.context + args.steps + 8),
        enable_prefix_caching=False,
    )
    try:
        vocab = llm.model_config.vocab_size
        prompts = [[(7 * i + j) % vocab for j in range(args.context)] for i in range(args.batch)]
        params = SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True)
        llm.engine.executor.drain_step_timelines()
        llm.generate(prompts, params)
        timelines = llm.engine.executor.drain_step_timelines()
    finally:
        llm.shutdown()
    ms = 1e3
    rows = []
    for index, call in enumerate(timelines["driver"]):
        steps = [rank[index] for rank in timelines["ranks"]]
        rows.append({
            "tokens": sum(s["num_tokens"] for s in steps) // 2,  # TP-free plan: each rank's own
            "send_ms": ms * (max(s["received"] for s in steps) - call["sent"]),
            "return_ms": ms * (call["results"] - max(s["finished"] for s in steps)),
        })  # fmt: skip
    decode = rows[1:]  # the first step is the prefill
    send = sorted(r["send_ms"] for r in decode)
    back = sorted(r["return_ms"] for r in decode)
    print(f"decode steps of {args.batch} x {args.context}-block tables on 2 CPU workers: send "
          f"median {send[len(send) // 2]:.2f} ms (first decode step {decode[0]['send_ms']:.2f}), "
          f"return median {back[len(back) // 2]:.2f} ms")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
