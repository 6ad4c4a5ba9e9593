"""Concurrent streaming requests against a running server, reported as `vllm bench serve` does
(request throughput, input/output tokens/s, TTFT, TPOT and ITL at mean/P50/P95/P99), plus the KV
hand-off: bytes per request, export and import times, and the export's share of TTFT.

    serve run rayinfer.app:build &
    python -m rayinfer.bench serve --url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 8

Prompts are random words (seeded) so the prefix cache cannot serve them; token counts come from
the server's `usage`. Each request sets `ignore_eos` so it generates exactly `--output-len` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp

WORDS = (
    "river mountain garden window teacher market bread apple cheese music letter light engine "
    "cloud winter summer forest library station train city ocean silver paper story number "
    "people morning evening kitchen coffee butter orange planet galaxy telescope desert village"
).split()
PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)  # between streamed chunks
    kv_export_s: float = 0.0
    kv_import_s: float = 0.0
    kv_bytes: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench serve", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128, help="words per prompt")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per reply")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600, help="per request")
    parser.add_argument("--json", default=None, help="write the results to this file")
    return parser.parse_args(argv)


def make_prompts(num: int, num_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=num_words)) for _ in range(num)]


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as reply:
        reply.raise_for_status()
        return (await reply.json())["data"][0]["id"]


async def send_one(session, url: str, model: str, prompt: str, args) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "rayinfer_timings": True,
    }
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last_chunk_at: float | None = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {await reply.text()}"
                return result
            async for raw_line in reply.content:
                line = raw_line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last_chunk_at = record_event(result, json.loads(line[6:]), start, last_chunk_at)
                if result.error:
                    return result
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        result.error = repr(error)
        return result
    result.latency_s = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    return result


def record_event(result: RequestResult, event: dict, start: float, last: float | None):
    """Fold one SSE event into result; returns when the last text chunk arrived."""
    now = time.perf_counter()
    if "error" in event:
        result.error = event["error"]["message"]
    if event.get("choices") and event["choices"][0].get("text"):
        if last is None:
            result.ttft_s = now - start
        else:
            result.chunk_gaps_s.append(now - last)
        last = now
    if event.get("usage"):
        result.prompt_tokens = event["usage"]["prompt_tokens"]
        result.output_tokens = event["usage"]["completion_tokens"]
    timings = event.get("rayinfer_timings") or {}
    result.kv_export_s = timings.get("kv_export_s", result.kv_export_s)
    result.kv_import_s = timings.get("kv_import_s", result.kv_import_s)
    result.kv_bytes = timings.get("kv_bytes", result.kv_bytes)
    return last


async def run(args) -> tuple[list[RequestResult], float, str]:
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await first_model(session, args.url)
        prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
        await send_one(session, args.url, model, prompts[0], args)  # warm-up, not counted
        limit = asyncio.Semaphore(args.max_concurrency)

        async def limited(prompt):
            async with limit:
                return await send_one(session, args.url, model, prompt, args)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return list(results), time.perf_counter() - start, model


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_stats(name: str, values_s: list[float]) -> dict[str, float]:
    values_ms = [v * 1000 for v in values_s]
    stats = {f"mean_{name}_ms": sum(values_ms) / len(values_ms) if values_ms else float("nan")}
    for q in PERCENTILES:
        stats[f"p{q}_{name}_ms"] = percentile(values_ms, q)
    return stats


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    summary |= latency_stats("ttft", [r.ttft_s for r in done])
    summary |= latency_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None])
    summary |= latency_stats("itl", [gap for r in done for gap in r.chunk_gaps_s])
    summary |= latency_stats("kv_export", [r.kv_export_s for r in done])
    summary |= latency_stats("kv_import", [r.kv_import_s for r in done])
    shares = [r.kv_export_s / r.ttft_s for r in done if r.ttft_s > 0]
    summary["mean_kv_bytes"] = sum(r.kv_bytes for r in done) / max(len(done), 1)
    summary["mean_handoff_share_of_ttft_pct"] = 100 * sum(shares) / max(len(shares), 1)
    summary["p50_handoff_share_of_ttft_pct"] = 100 * percentile(shares, 50)
    return summary


def format_report(s: dict[str, float]) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value, digits: int = 2) -> None:
        text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:<10}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Input token throughput (tok/s):", s["input_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    sections = (
        ("Time to First Token", "ttft", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
        ("Inter-token Latency", "itl", "ITL"),
        ("KV hand-off export (prefill, in TTFT)", "kv_export", "export"),
        ("KV hand-off import (decode)", "kv_import", "import"),
    )
    for title, key, short in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", s[f"mean_{key}_ms"])
        for q in PERCENTILES:
            row(f"P{q} {short} (ms):", s[f"p{q}_{key}_ms"])
    lines.append("{s:{c}^{n}}".format(s="KV hand-off through the object store", n=50, c="-"))
    row("Mean KV bytes per request:", s["mean_kv_bytes"], 0)
    row("Mean hand-off share of TTFT (%):", s["mean_handoff_share_of_ttft_pct"])
    row("Median hand-off share of TTFT (%):", s["p50_handoff_share_of_ttft_pct"])
    lines.append("=" * 50)
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    results, duration_s, model = asyncio.run(run(args))
    summary = summarize(results, duration_s)
    print(format_report(summary))
    errors = sorted({r.error for r in results if not r.ok})
    for error in errors[:5]:
        print(f"error: {error}")
    if args.json:
        record = {"model": model, "args": vars(args), "summary": summary}
        record["requests"] = [asdict(r) for r in results]
        with open(args.json, "w") as out:
            json.dump(record, out, indent=1)
    return 0 if not errors else 1
