"""The engine's own host time per decode step, without a model: `rayinfer.LLM` on the CPU with
the built-in tiny model, its executor replaced by one that returns the step's tokens at once, so
only scheduling, batch building, token appending, detokenization and outputs are timed.

    python benchmarks/engine_host_time.py --batch 256 [--profile]

Prints the mean ms per step over --steps decode steps (after the prompts' prefill and a
warm-up), three runs; --profile adds the top functions of a cProfile of one more run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer import LLM, SamplingParams  # noqa: E402
from rayinfer.engine.batch import SampledTokens  # noqa: E402


def decoding_engine(batch: int, steps: int):
    """An engine with `batch` sequences past their prefill and room for `steps` more tokens."""
    llm = LLM("tiny", device="cpu", max_num_seqs=batch, num_kv_blocks=max(batch * 40, 512),
              max_num_batched_tokens=max(2048, batch * 64))  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=4 * steps + 16, temperature=0, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"r{index}", list(range(100, 164)), params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    engine.executor.execute = lambda b: SampledTokens([7] * b.num_sampling)
    for _ in range(5):
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    engine = decoding_engine(args.batch, args.steps)
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        ms = 1e3 * (time.perf_counter() - start) / args.steps
        print(f"batch {args.batch}: {ms:.3f} ms/step host (executor stubbed)", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
