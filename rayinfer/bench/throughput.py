"""The serve bench's requests through the offline engine, all at once (as `vllm bench
throughput`) or N at a time (`--max-concurrency`, as the serve bench's client keeps them):
requests/s, input and output tokens/s, and each request's TTFT and TPOT counted from when it
was added. Same dataset flags and seed as `python -m rayinfer.bench serve`, so both see the
same prompts (a serve pass at --seed S sends what this sends at --seed S).

    python -m rayinfer.bench throughput --model DIR --num-prompts 64 --input-len 3700 \\
        --output-len 128 --max-num-batched-tokens 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rayinfer import LLM, SamplingParams
from rayinfer.bench.serve import strict_json
from rayinfer.bench.serve_client import RequestResult, mark_token
from rayinfer.bench.serve_dataset import add_dataset_args, build_requests, check_dataset_args
from rayinfer.bench.serve_metrics import format_report, summarize
from rayinfer.deployments.runtime import DEFAULT_GPU_MEMORY_UTILIZATION
from rayinfer.engine.model_source import resolve_device
from rayinfer.engine.structured_output import StructuredOutput
from rayinfer.workers.runner.step_timeline import KEPT_STEPS


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m rayinfer.bench throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--load-format", default="safetensors", help="dummy: random weights")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="on a GPU, fill this share of its memory with KV cache (default: 0.9 as `serve "
        "run` sizes its cache, unless --num-kv-blocks is given; LLM's own default, a cache of "
        "max(4 x max_model_len, 16384) tokens, held 8 of 16 V2-Lite requests of 3.8k tokens, "
        "so the rest waited in the queue)",
    )  # fmt: skip
    parser.add_argument(
        "--max-graph-piecewise-tokens", type=int, default=None,
        help="LLM's max_graph_piecewise_tokens (0: mixed steps run eagerly; default: LLM's)",
    )  # fmt: skip
    add_dataset_args(parser)
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument(
        "--warmup-prompts", type=int, default=None,
        help="prompts run untimed first, another seed's (default: as many as --num-prompts, so "
        "the timed pass runs the batch shapes it will meet after they have been compiled; with "
        "2, the V2-Lite pass of 64 x 3.7k prompts on an H200 read a third of the offline "
        "figure issue 28 recorded, a cause not yet confirmed)",
    )  # fmt: skip
    parser.add_argument(
        "--max-concurrency", type=int, default=None,
        help="requests in flight at most, the next added as one finishes (as `bench serve "
        "--max-concurrency`, so both schedule alike); default: all at once",
    )  # fmt: skip
    parser.add_argument(
        "--json-schema", default=None,
        help="a JSON schema (text) every reply must match: structured output on",
    )  # fmt: skip
    args = parser.parse_args(argv)
    check_dataset_args(args)
    return args


def gpu_memory_utilization(args, on_gpu: bool) -> float | None:
    """The cache's share of GPU memory: as asked, else as `serve run` sizes a replica's cache on
    GPUs, so an offline run and a served one hold as many requests (None: LLM's rule)."""
    if args.gpu_memory_utilization is not None or args.num_kv_blocks is not None or not on_gpu:
        return args.gpu_memory_utilization
    return DEFAULT_GPU_MEMORY_UTILIZATION


def make_llm(args) -> LLM:
    piecewise = args.max_graph_piecewise_tokens
    options = {} if piecewise is None else {"max_graph_piecewise_tokens": piecewise}
    on_gpu = resolve_device(args.device).type == "cuda"
    return LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer if args.tokenizer != "tiny" else None,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=gpu_memory_utilization(args, on_gpu),
        load_format=args.load_format,
        **options,
    )


def run_all(
    llm: LLM,
    requests,
    tag: str,
    structured: StructuredOutput | None = None,
    max_concurrency: int | None = None,
) -> tuple[list[RequestResult], float]:
    """Every request added at once, or with `max_concurrency` that many in flight, the next
    added as one finishes (what `bench serve --max-concurrency` keeps a server at); then engine
    steps until all finish. A request's times count from when it was added. With `structured`,
    a reply ends where its grammar is complete (EOS) or at its length."""
    results = {f"{tag}-{i}": RequestResult() for i in range(len(requests))}
    waiting = list(zip(results, requests))[::-1]  # popped from the end: in order
    limit = max_concurrency or len(requests)
    unfinished: set[str] = set()  # added, not yet finished
    start = time.perf_counter()

    def add_next() -> None:
        request_id, request = waiting.pop()
        params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True,
                                structured_output=structured)  # fmt: skip
        results[request_id].sent_s = time.perf_counter() - start
        llm.engine.add_request(request_id, request.prompt, params)
        unfinished.add(request_id)

    while waiting and len(unfinished) < limit:
        add_next()
    while unfinished:
        for output in llm.engine.step():
            result = results.get(output.request_id)
            if result is None or output.request_id not in unfinished:
                continue
            elapsed = time.perf_counter() - start - result.sent_s
            if output.new_token_ids:
                mark_token(result, elapsed)
            if output.finished:
                unfinished.discard(output.request_id)
                result.ok = output.finish_reason in ("stop", "length")
                result.error = output.error or ""
                result.latency_s = elapsed
                result.prompt_tokens = len(output.prompt_token_ids)
                result.output_tokens = len(output.token_ids)
                if waiting:
                    add_next()
    return list(results.values()), time.perf_counter() - start


def step_times(timelines: dict, max_num_seqs: int) -> dict:
    """Median times (ms) of the timed run's last steps on the first rank, pure decodes (at most
    max_num_seqs tokens) apart from steps with prompt tokens: the whole step, until its forward
    was queued (wall and the thread's CPU time) and on the GPU."""
    steps = timelines["ranks"][0] if timelines["ranks"] else []
    kinds = {"decode": [s for s in steps if s["num_tokens"] <= max_num_seqs]}
    kinds["prompt"] = [s for s in steps if s["num_tokens"] > max_num_seqs]
    phases = {
        "step": lambda s: 1e3 * (s["finished"] - s["received"]),
        "queued": lambda s: 1e3 * (s["queued"] - s["received"]),
        "queue_cpu": lambda s: s["queue_cpu_ms"],
        "gpu": lambda s: s["gpu_ms"] or 0.0,
        "tokens": lambda s: s["num_tokens"],
    }
    return {
        kind: {name: statistics.median(map(phase, chosen)) for name, phase in phases.items()}
        for kind, chosen in kinds.items()
        if chosen
    }


def requests_the_cache_holds(llm: LLM, requests) -> int:
    """How many of the longest of `requests` (prompt and output) the engine's KV cache holds at
    once: past it the rest wait, whatever --max-concurrency says."""
    cache_tokens = sum(len(m.blocks) * m.block_size for m in llm.engine.block_managers)
    longest = max(r.prompt_len + r.output_len for r in requests)
    return cache_tokens // max(longest, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    llm = make_llm(args)
    requests = build_requests(args, args.seed, llm.tokenizer)
    num_warmup = args.num_prompts if args.warmup_prompts is None else args.warmup_prompts
    warmup = build_requests(args, args.seed - 1, llm.tokenizer)[: max(num_warmup, 1)]
    structured = None
    if args.json_schema is not None:
        structured = StructuredOutput.json_schema(json.loads(args.json_schema))
    concurrency = args.max_concurrency
    held = requests_the_cache_holds(llm, requests)
    if held < min(concurrency or len(requests), len(requests)):
        print(f"note: the KV cache holds {held} of these requests at once; the rest wait "
              "(--gpu-memory-utilization or --num-kv-blocks)")  # fmt: skip
    run_all(llm, warmup, "warmup", structured, concurrency)  # compiles, captures graphs
    llm.engine.executor.drain_step_timelines()
    results, duration_s = run_all(llm, requests, "timed", structured, concurrency)
    summary = summarize(results, duration_s)
    shape = "all at once" if concurrency is None else f"{concurrency} at once"
    print(format_report(summary, f"Offline engine ({args.model}, {shape})"))
    steps = step_times(llm.engine.executor.drain_step_timelines(), args.max_num_seqs)
    for kind, times in steps.items():
        print(f"{kind} steps (last {KEPT_STEPS} at most), median ms: " + ", ".join(
            f"{name} {value:.1f}" for name, value in times.items()))  # fmt: skip
    if args.json:
        record = {"model": args.model, "args": vars(args), "summary": summary, "steps": steps,
                  "cache_holds_requests": held}  # fmt: skip
        with open(args.json, "w") as out:
            json.dump(strict_json(record), out, indent=1)
    return 0 if summary["failed"] == 0 else 1
