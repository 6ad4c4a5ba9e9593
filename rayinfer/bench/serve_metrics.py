"""A pass's numbers as `vllm bench serve` reports them (throughput, TTFT/TPOT/ITL/E2EL at
mean/P50/P95/P99, goodput under SLOs), plus the KV hand-off's, the report and the sweep's plot."""

from __future__ import annotations

import math
from collections import Counter

from rayinfer.bench.serve_client import HANDOFF_PARTS, RequestResult

PERCENTILES = (50, 95, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:2000', 'tpot:50'] -> {'ttft': 2000.0, 'tpot': 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise SystemExit(f"--goodput {item!r}: use NAME:MS with NAME one of {SLO_METRICS}")
        slos[name] = float(value)
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """A completed request within every SLO; a one-token reply's TPOT counts as 0 (as vllm)."""
    if not result.ok:
        return False
    values_ms = {
        "ttft": result.ttft_s * 1000,
        "tpot": (result.tpot_s or 0.0) * 1000,
        "e2el": result.latency_s * 1000,
    }
    return all(values_ms[name] <= limit for name, limit in slos.items())


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


def summarize(
    results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None
) -> dict[str, float]:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    num_good = sum(meets_slos(r, slos) for r in results) if slos else len(done)
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
        "request_goodput": num_good / duration_s,
        "goodput_fraction": num_good / max(len(results), 1),
    }
    summary |= latency_stats("ttft", [r.ttft_s for r in done])
    summary |= latency_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None])
    summary |= latency_stats("itl", [gap for r in done for gap in r.itl_s])
    # The gap between the first and second tokens: where a disaggregated request's import lands
    # (the first token streams from the prefill before its KV moves), against the ITL above.
    summary |= latency_stats("first_itl", [r.itl_s[0] for r in done if r.itl_s])
    summary |= latency_stats("e2el", [r.latency_s for r in done])
    summary |= latency_stats("kv_export", [r.kv_export_s for r in done])
    summary |= latency_stats("kv_import", [r.kv_import_s for r in done])
    for part in HANDOFF_PARTS:
        values = [r.kv_parts_s[part] for r in done if part in r.kv_parts_s]
        if values:
            summary |= latency_stats(part.removesuffix("_s"), values)
    # Export and import together against TTFT: the export now ends after the first token has
    # streamed, so this bounds what the hand-off could add to a request's first tokens.
    timed = [r for r in done if r.ttft_s > 0]
    shares = [(r.kv_export_s + r.kv_import_s) / r.ttft_s for r in timed]
    for part in ("export", "import"):  # each on its own, as the targets of issue 28 read
        part_shares = [getattr(r, f"kv_{part}_s") / r.ttft_s for r in timed]
        summary[f"p50_kv_{part}_share_of_ttft_pct"] = 100 * percentile(part_shares, 50)
    summary["mean_kv_bytes"] = sum(r.kv_bytes for r in done) / max(len(done), 1)
    summary["kv_paths"] = dict(Counter(r.kv_path for r in done if r.kv_path))
    summary["kv_copies"] = dict(Counter(r.kv_copies for r in done if r.kv_copies))
    summary["mean_handoff_share_of_ttft_pct"] = 100 * sum(shares) / max(len(shares), 1)
    summary["p50_handoff_share_of_ttft_pct"] = 100 * percentile(shares, 50)
    return summary


SECTIONS = (
    ("Time to First Token", "ttft", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
    ("Inter-token Latency", "itl", "ITL"),
    ("End-to-end Latency", "e2el", "E2EL"),
)
HANDOFF_SECTIONS = (
    ("KV hand-off export (prefill, in TTFT)", "kv_export", "export"),
    ("KV hand-off import (decode)", "kv_import", "import"),
)


def format_report(s: dict, title: str = "Serving Benchmark Result", slos=None) -> str:
    lines = [f" {title} ".center(50, "=")]

    def row(label: str, value, digits: int = 2) -> None:
        text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:<10}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if slos:
        row("Request goodput (req/s):", s["request_goodput"])
        row("Requests within every SLO (%):", 100 * s["goodput_fraction"])
    row("Input token throughput (tok/s):", s["input_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    has_handoff = s["mean_kv_bytes"] > 0
    for heading, key, short in SECTIONS + (HANDOFF_SECTIONS if has_handoff else ()):
        lines.append(heading.center(50, "-"))
        row(f"Mean {short} (ms):", s[f"mean_{key}_ms"])
        for q in PERCENTILES:
            row(f"P{q} {short} (ms):", s[f"p{q}_{key}_ms"])
    if has_handoff:
        lines.append("KV hand-off".center(50, "-"))
        paths = ", ".join(f"{path} {count}" for path, count in s.get("kv_paths", {}).items())
        row("Requests by hand-off path:", paths or "-")
        copies = ", ".join(f"{way} {count}" for way, count in s.get("kv_copies", {}).items())
        row("Requests by copies (export/import):", copies or "-")
        for part in HANDOFF_PARTS:
            key = part.removesuffix("_s")
            if f"mean_{key}_ms" in s:
                row(
                    f"Mean / P50 {key} (ms):",
                    f"{s[f'mean_{key}_ms']:.2f} / {s[f'p50_{key}_ms']:.2f}",
                )
        row("Mean KV bytes per request:", s["mean_kv_bytes"], 0)
        row("Mean hand-off share of TTFT (%):", s["mean_handoff_share_of_ttft_pct"])
        row("Median hand-off share of TTFT (%):", s["p50_handoff_share_of_ttft_pct"])
        row("Median export share of TTFT (%):", s["p50_kv_export_share_of_ttft_pct"])
        row("Median import share of TTFT (%):", s["p50_kv_import_share_of_ttft_pct"])
        row("Median first ITL (ms):", s["p50_first_itl_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def format_sweep(passes: list[dict]) -> str:
    """One line per request rate."""
    lines = [
        "rate req/s | done | req/s | in tok/s | out tok/s | TTFT P50/P95 ms | TPOT P50 ms | good %",
    ]
    for p in passes:
        s = p["summary"]
        lines.append(
            f"{p['request_rate']:>10g} | {s['completed']:>4} | {s['request_throughput']:5.2f} | "
            f"{s['input_throughput']:8.1f} | {s['output_throughput']:9.1f} | "
            f"{s['p50_ttft_ms']:7.1f}/{s['p95_ttft_ms']:7.1f} | {s['p50_tpot_ms']:11.2f} | "
            f"{100 * s['goodput_fraction']:6.1f}"
        )
    return "\n".join(lines)


def plot_sweep(passes: list[dict], path: str) -> bool:
    """Throughput and P50/P95 TTFT against the request rate, as a PNG; False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{p['request_rate']:g}" for p in passes]  # 'inf' has no place on a numeric axis
    positions = range(len(passes))
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, name in (("output_throughput", "output"), ("input_throughput", "input")):
        left.plot(positions, [p["summary"][key] for p in passes], "o-", label=f"{name} tok/s")
    left.set_ylabel("tokens/s")
    left.set_yscale("log")  # input and output tokens/s differ by 10-100x
    for q in (50, 95):
        ttft = [p["summary"][f"p{q}_ttft_ms"] for p in passes]
        right.plot(positions, [t if not math.isnan(t) else None for t in ttft], "o-",
                   label=f"P{q} TTFT")  # fmt: skip
    right.set_ylabel("TTFT (ms)")
    for axis in (left, right):
        axis.set_xticks(list(positions), labels)
        axis.set_xlabel("request rate (req/s)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    print(f"plot: {path}")
    return True
