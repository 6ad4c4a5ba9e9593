"""Where a long prompt's chunked prefill spends its time: the seconds of each chunk (engine
step) of one prompt, and torch.profiler's top GPU kernels over the whole prefill, for a model of
random weights built as `bench long_context` builds it (same arguments).

    python benchmarks/profile_long_prefill.py \\
        --config benchmarks/configs/deepseek-v4-flash-4layer \\
        --lengths 65536 --chunk 16384 --block-size 64 --decode-batch 0

A chunk's time that grows with the context before it names the O(context) work per chunk (the
indexer's scores over every earlier entry grow so; anything else is suspect).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer import SamplingParams  # noqa: E402
from rayinfer.bench import long_context  # noqa: E402


def chunk_seconds(llm, prompt: list[int]) -> list[float]:
    """Each engine step's seconds until the prompt's first token."""
    engine = llm.engine
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        long_context.synchronize(llm)
        steps.append(time.perf_counter() - start)
    return steps


def main() -> None:
    args = long_context.parse_args(sys.argv[1:])
    llm = long_context.build(Path(args.config), args, args.lengths)
    vocab = llm.model_config.vocab_size
    length = max(args.lengths)
    chunk_seconds(llm, long_context.random_prompt(min(args.chunk, 4096), vocab, 0))  # warm-up
    steps = chunk_seconds(llm, long_context.random_prompt(length, vocab, 1))
    print(f"prefill {length} tokens in chunks of {args.chunk}: {sum(steps):.2f} s; per step (s): "
          + " ".join(f"{s:.3f}" for s in steps), flush=True)  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        chunk_seconds(llm, long_context.random_prompt(length, vocab, 2))
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()
