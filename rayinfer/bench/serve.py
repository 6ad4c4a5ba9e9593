"""Streaming requests against a running OpenAI-compatible server, reported as `vllm bench serve`
does: request throughput, input/output tokens/s, TTFT, TPOT, ITL and end-to-end latency at
mean/P50/P95/P99, goodput under SLOs; against rayinfer also the KV hand-off (bytes, export and
import times, the export's share of TTFT).

    serve run rayinfer.app:build &
    python -m rayinfer.bench serve --num-prompts 64 --max-concurrency 16
    python -m rayinfer.bench serve --request-rate 1,2,4,inf --goodput ttft:2000 tpot:50 \\
        --json sweep.json --plot sweep.png
    transformers serve --port 8001 &
    python -m rayinfer.bench serve --url http://127.0.0.1:8001 --backend transformers \\
        --model /path/to/checkpoint

Arrivals: `--request-rate R` sends requests as a Poisson process of R requests/s (exponential
gaps from the seeded RNG; `--burstiness B` makes them gamma with shape B); `inf`, the default,
sends them all at once. `--max-concurrency N` caps the requests in flight whatever the rate; by
default there is no cap (as vllm bench serve). A list of rates runs one pass per rate, each on
fresh prompts (seed, seed+1, ...) so the server's prefix cache cannot serve a later pass.

`--response-format` puts structured output (OpenAI's `response_format`, which rayinfer takes on
completions too) on every request, to measure what the grammar costs against a pass without it.

Every request is greedy and generates exactly its output length (`ignore_eos`; for transformers
serve, `min_new_tokens` in its `generation_config`). TTFT is taken at the first chunk that
carries a generated token, even one with empty text (rayinfer/bench/serve_client.py). Datasets
and how lengths count tokens: rayinfer/bench/serve_dataset.py. The offline engine on the same
prompts: `python -m rayinfer.bench throughput`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import asdict

import aiohttp

from rayinfer.bench.serve_client import BACKENDS, ENDPOINTS, request_body, send_one
from rayinfer.bench.serve_dataset import (
    WORDS,
    SampleRequest,
    add_dataset_args,
    build_requests,
    check_dataset_args,
    load_tokenizer,
)
from rayinfer.bench.serve_metrics import (
    format_report,
    format_sweep,
    parse_goodput,
    plot_sweep,
    summarize,
)

NUM_WARMUP_WORDS = 64  # the warm-up prompt, which also measures the server's tokens per word


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--request-rate {text!r}: use numbers or inf, e.g. 1,2,4,inf") from None
    if any(rate <= 0 for rate in rates):
        raise SystemExit(f"--request-rate {text!r}: every rate must be > 0 (inf: all at once)")
    return rates


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m rayinfer.bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument(
        "--model", default=None, help="the request's model (default: the first of /v1/models)"
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="rayinfer",
        help="the server's dialect: rayinfer and vllm take ignore_eos and count tokens on every "
        "chunk; openai sends no extension; transformers: `transformers serve`",
    )
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    parser.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[math.inf],
        help="requests/s, Poisson arrivals; a list (1,2,4,inf) runs a sweep; inf: all at once",
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals")
    parser.add_argument("--max-concurrency", type=int, default=None, help="default: no cap")
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:50 e2el:10000",
    )
    add_dataset_args(parser)
    parser.add_argument(
        "--text-prompts",
        action="store_true",
        help="random prompts as text even where token ids would do (to send a peer that takes "
        "only text the same prompts)",
    )
    parser.add_argument(
        "--num-warmups", type=int, default=0,
        help="requests of the dataset (seed - 1, so not the timed ones) sent untimed first, at "
        "--max-concurrency: a fresh server compiles kernels and fills allocators on them",
    )  # fmt: skip
    parser.add_argument(
        "--response-format", type=parse_response_format, default=None,
        help="structured output on every request: json_object, or a JSON file holding OpenAI's "
        "response_format object (e.g. a json_schema)",
    )  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=600, help="per request")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--plot", default=None, help="write throughput and TTFT to this PNG")
    args = parser.parse_args(argv)
    check_dataset_args(args)
    args.goodput = parse_goodput(args.goodput)
    if args.burstiness <= 0:
        raise SystemExit(f"--burstiness={args.burstiness} must be > 0")
    return args


def parse_response_format(value: str) -> dict:
    """--response-format: "json_object", or the path of a JSON file with the whole object."""
    if value == "json_object":
        return {"type": "json_object"}
    try:
        with open(value) as f:
            response_format = json.load(f)
    except (OSError, ValueError) as error:
        message = f"{value}: not json_object nor a JSON file ({error})"
        raise argparse.ArgumentTypeError(message) from None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise argparse.ArgumentTypeError(f"{value}: needs an object with a 'type'")
    return response_format


def arrival_times(num: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times in seconds from the pass's start: the first at 0, then gaps drawn from a gamma
    distribution of mean 1/rate and shape `burstiness` (1: exponential, a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return times


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as reply:
        reply.raise_for_status()
        models = (await reply.json())["data"]
    if not models:
        raise SystemExit(f"{url}/v1/models lists no model; name one with --model")
    return models[0]["id"]


async def run_pass(session, args, model: str, requests: list[SampleRequest], rate: float):
    """One pass at one request rate: (results in request order, duration in seconds)."""
    send_at = arrival_times(len(requests), rate, args.seed, args.burstiness)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    start = time.perf_counter()

    async def timed(request: SampleRequest, at_s: float):
        await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - start)))
        if limit is not None:
            await limit.acquire()
        try:
            sent_s = time.perf_counter() - start
            body = request_body(request, model, args.endpoint, args.backend, args.response_format)
            result = await send_one(session, args.url, body, request, args.endpoint)
            result.sent_s = sent_s
            return result
        finally:
            if limit is not None:
                limit.release()

    results = await asyncio.gather(*(timed(r, t) for r, t in zip(requests, send_at)))
    return list(results), time.perf_counter() - start


async def warm_up(session, args, model: str) -> float:
    """One request outside the timing; returns the server's words per token (1.0 if unknown)."""
    text = " ".join(random.Random(args.seed - 1).choices(WORDS, k=NUM_WARMUP_WORDS))
    request = SampleRequest(text, NUM_WARMUP_WORDS, 4)
    body = request_body(request, model, args.endpoint, args.backend, args.response_format)
    result = await send_one(session, args.url, body, request, args.endpoint)
    if not result.ok:
        raise SystemExit(f"the warm-up request failed: {result.error}")
    return NUM_WARMUP_WORDS / result.prompt_tokens if result.prompt_tokens else 1.0


async def run(args) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await first_model(session, args.url)
        tokenizer = load_tokenizer(args.tokenizer or args.model or model)
        as_text = args.text_prompts or args.endpoint == "chat" or args.backend == "transformers"
        words_per_token = await warm_up(session, args, model)
        scale = 1.0 if tokenizer else words_per_token
        num_warmed = 0
        if args.num_warmups > 0:
            shape = argparse.Namespace(**{**vars(args), "num_prompts": args.num_warmups})
            warmups = build_requests(shape, args.seed - 1, tokenizer, as_text, scale)
            results, _ = await run_pass(session, args, model, warmups, math.inf)
            failed = [result.error for result in results if not result.ok]
            if failed:
                raise SystemExit(f"{len(failed)} warm-up requests failed: {failed[0]}")
            num_warmed = len(results)
        passes = []
        for index, rate in enumerate(args.request_rate):
            requests = build_requests(args, args.seed + index, tokenizer, as_text, scale)
            results, duration_s = await run_pass(session, args, model, requests, rate)
            summary = summarize(results, duration_s, args.goodput)
            passes.append({"request_rate": rate, "seed": args.seed + index,
                           "summary": summary, "results": results})  # fmt: skip
            title = f"Serving Benchmark Result (rate {rate:g} req/s)"
            print(format_report(summary, title, args.goodput), flush=True)
    return {"model": model, "has_client_tokenizer": tokenizer is not None,
            "num_warmups": num_warmed, "passes": passes}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    record = asyncio.run(run(args))
    passes = record["passes"]
    if len(passes) > 1:
        print(format_sweep(passes))
    errors = sorted({r.error for p in passes for r in p["results"] if not r.ok})
    for error in errors[:5]:
        print(f"error: {error}")
    for p in passes:
        p["requests"] = [asdict(r) | {"tpot_s": r.tpot_s} for r in p.pop("results")]
    if args.plot:
        plot_sweep(passes, args.plot)
    if args.json:
        record["args"] = vars(args)
        with open(args.json, "w") as out:
            json.dump(strict_json(record), out, indent=1)
    return 0 if not errors else 1


def strict_json(value):
    """JSON has no inf or NaN: a rate of inf is written "inf", a statistic of no values null."""
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
