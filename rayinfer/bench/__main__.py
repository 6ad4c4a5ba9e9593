"""`python -m rayinfer.bench COMMAND [options]` (COMMANDS below): each prints a table and can
write JSON (and a PNG plot where it has one)."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "engine": "offline engine prefill and decode tokens/s",
    "serve": "streaming HTTP requests against a running server (vllm bench serve style)",
    "throughput": "the serve bench's requests through the offline engine, all at once",
    "comm": "all-to-all schedules and transports against NCCL",
    "kernels": "Triton kernels against their torch baselines",
    "parallel": "prefill/decode per parallel plan across GPUs vs transformers on one GPU",
    "long_context": "one long prompt's prefill and long contexts' decode, DSA vs dense MLA",
    "handoff": "the KV hand-off's copies between two actors, chunked vs per-layer",
    "soak": "a running server's parts killed one by one under load: what each fault cost",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        lines = [f"  {name:12s} {what}" for name, what in COMMANDS.items()]
        print("usage: python -m rayinfer.bench COMMAND [options]\n" + "\n".join(lines))
        return 2
    module = importlib.import_module(f"rayinfer.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
