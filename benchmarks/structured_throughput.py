"""Offline-engine output tokens/s with and without structured output on, the same prompts,
alternating in one process (the median of --rounds each), so that load from elsewhere on a
shared machine falls on both alike.

    python benchmarks/structured_throughput.py [--num-prompts 64 --input-len 128 --output-len 64]
"""

from __future__ import annotations

import json
import statistics
import sys

from rayinfer.bench.serve_dataset import build_requests
from rayinfer.bench.throughput import make_llm, parse_args, run_all
from rayinfer.engine.structured_output import StructuredOutput

# An unbounded string: the random-weights model stays in it to max_tokens, as an unconstrained
# reply does.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def output_tokens_per_s(llm, requests, tag, structured) -> tuple[float, int]:
    results, duration_s = run_all(llm, requests, tag, structured)
    tokens = sum(r.output_tokens for r in results)
    return tokens / duration_s, tokens


def main() -> None:
    argv = sys.argv[1:]
    rounds = 5
    if "--rounds" in argv:
        at = argv.index("--rounds")
        rounds, argv = int(argv[at + 1]), argv[:at] + argv[at + 2 :]
    args = parse_args(argv or ["--num-prompts", "64", "--input-len", "128", "--output-len", "64"])
    llm = make_llm(args)
    requests = build_requests(args, args.seed, llm.tokenizer)
    structured = StructuredOutput.json_schema(SCHEMA)
    run_all(llm, requests[:4], "warmup-plain")
    run_all(llm, requests[:4], "warmup-structured", structured)
    runs = {"plain": [], "structured": []}
    for round_ in range(rounds):
        for name, grammar in (("plain", None), ("structured", structured)):
            rate, tokens = output_tokens_per_s(llm, requests, f"{name}-{round_}", grammar)
            runs[name].append(rate)
            print(json.dumps({"round": round_, "mode": name, "output_tok_s": round(rate, 1),
                              "output_tokens": tokens}), flush=True)  # fmt: skip
    plain, constrained = (statistics.median(runs[k]) for k in ("plain", "structured"))
    print(json.dumps({"plain_median": round(plain, 1), "structured_median": round(constrained, 1),
                      "ratio": round(constrained / plain, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
