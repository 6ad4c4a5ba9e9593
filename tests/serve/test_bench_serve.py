"""`python -m rayinfer.bench serve`: SSE events folded into per-request numbers, and the report."""

from __future__ import annotations

import pytest

from rayinfer.bench.serve import (
    RequestResult,
    format_report,
    percentile,
    record_event,
    summarize,
)


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_events_fill_ttft_gaps_usage_and_timings():
    result = RequestResult(ok=False)
    text = {"choices": [{"text": "a"}]}
    last = record_event(result, text, start=0.0, last=None)
    assert result.ttft_s > 0 and last is not None
    last = record_event(result, text, start=0.0, last=last)
    assert len(result.chunk_gaps_s) == 1
    record_event(
        result,
        {
            "choices": [],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2},
            "rayinfer_timings": {"kv_export_s": 0.01, "kv_import_s": 0.02, "kv_bytes": 640.0},
        },
        start=0.0,
        last=last,
    )
    assert (result.prompt_tokens, result.output_tokens) == (7, 2)
    assert (result.kv_export_s, result.kv_import_s, result.kv_bytes) == (0.01, 0.02, 640.0)
    record_event(result, {"error": {"message": "boom"}}, start=0.0, last=last)
    assert result.error == "boom"


def test_summary_and_report_carry_the_vllm_lines_and_the_handoff_share():
    results = [
        RequestResult(
            True,
            "",
            10,
            5,
            ttft_s=0.1,
            latency_s=0.5,
            chunk_gaps_s=[0.1] * 4,
            kv_export_s=0.01,
            kv_import_s=0.02,
            kv_bytes=1000,
        ),
        RequestResult(
            True,
            "",
            20,
            5,
            ttft_s=0.2,
            latency_s=0.6,
            chunk_gaps_s=[0.1] * 4,
            kv_export_s=0.02,
            kv_import_s=0.02,
            kv_bytes=2000,
        ),
        RequestResult(False, "HTTP 503"),
    ]
    summary = summarize(results, duration_s=2.0)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["request_throughput"] == 1.0
    assert summary["input_throughput"] == 15.0 and summary["output_throughput"] == 5.0
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)
    assert summary["mean_handoff_share_of_ttft_pct"] == pytest.approx(10.0)
    report = format_report(summary)
    for line in (
        "Request throughput (req/s):",
        "Input token throughput (tok/s):",
        "Output token throughput (tok/s):",
        "P99 TTFT (ms):",
        "P95 TPOT (ms):",
        "P50 ITL (ms):",
        "Mean hand-off share of TTFT (%):",
    ):
        assert line in report
