"""`python -m rayinfer.bench serve`: the arrival schedule, the datasets, SSE events folded into
per-request numbers, goodput and the report; then the flags against a real `serve run` (one
server for all of them)."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
from types import SimpleNamespace

import aiohttp
import pytest

from rayinfer.bench import serve as bench_serve
from rayinfer.bench.serve import arrival_times, strict_json
from rayinfer.bench.serve_client import RequestResult, finish, record_event, request_body
from rayinfer.bench.serve_dataset import (
    SampleRequest,
    load_tokenizer,
    random_requests,
    sharegpt_requests,
)
from rayinfer.bench.serve_metrics import (
    format_report,
    parse_goodput,
    percentile,
    plot_sweep,
    summarize,
)


def dataset_args(**overrides) -> SimpleNamespace:
    fields = dict(num_prompts=200, input_len=100, output_len=20, range_ratio=0.5,
                  dataset_path=None, sharegpt_output_len=None)  # fmt: skip
    return SimpleNamespace(**(fields | overrides))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_poisson_schedule_is_seeded_exponential_with_the_rate():
    times = arrival_times(4000, rate=8.0, seed=3)
    assert times == arrival_times(4000, rate=8.0, seed=3) and times[0] == 0.0
    assert times != arrival_times(4000, rate=8.0, seed=4)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.05)
    # an exponential's standard deviation equals its mean (a fixed interval's would be 0)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)
    assert sum(gap < 1 / 8 for gap in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.03)
    smooth = arrival_times(4000, 8.0, 3, burstiness=16)
    smooth_gaps = [b - a for a, b in zip(smooth, smooth[1:])]
    assert statistics.pstdev(smooth_gaps) / statistics.mean(smooth_gaps) < 0.35  # 1/sqrt(16)
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5


def test_random_lengths_lie_within_the_range_ratio(tokenizer):
    requests = random_requests(dataset_args(), seed=1, tokenizer=tokenizer)
    assert requests == random_requests(dataset_args(), seed=1, tokenizer=tokenizer)
    input_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    assert min(input_lens) >= 50 and max(input_lens) <= 150
    assert min(output_lens) >= 10 and max(output_lens) <= 30
    assert len(set(input_lens)) > 50  # drawn, not fixed
    assert all(len(r.prompt) == r.prompt_len for r in requests)  # token ids: exact
    assert not {t for r in requests for t in r.prompt} & tokenizer.all_special_ids
    fixed = random_requests(dataset_args(range_ratio=0.0), seed=1, tokenizer=tokenizer)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(100, 20)}


def test_random_text_prompts_are_cut_at_the_length_in_tokens(tokenizer):
    requests = random_requests(dataset_args(num_prompts=5), 1, tokenizer, as_text=True)
    for request in requests:
        num_tokens = len(tokenizer.encode(request.prompt, add_special_tokens=False))
        assert abs(num_tokens - request.prompt_len) <= 2  # a cut word may re-merge
    words = random_requests(dataset_args(num_prompts=3), 1, None, words_per_token=0.5)
    assert [len(r.prompt.split()) for r in words] == [round(r.prompt_len / 2) for r in words]


def write_sharegpt(path, num: int) -> None:
    conversations = [
        {"id": "no-reply", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "short", "conversations": [{"from": "human", "value": "hi"},
                                          {"from": "gpt", "value": "yo"}]},
    ]  # fmt: skip
    for i in range(num):
        turns = [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": f"question {i}: " + "tell me about rivers " * (i + 1)},
            {"from": "gpt", "value": "rivers flow to the ocean " * (i + 2)},
            {"from": "human", "value": "and then?"},
        ]
        conversations.append({"id": str(i), "conversations": turns})
    path.write_text(json.dumps(conversations))


def test_sharegpt_takes_the_first_human_turn_and_the_reply_length(tmp_path, tokenizer):
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path, 10)
    args = dataset_args(num_prompts=4, dataset_path=str(path))
    requests = sharegpt_requests(args, seed=0, tokenizer=tokenizer)
    assert requests == sharegpt_requests(args, seed=0, tokenizer=tokenizer)
    assert requests != sharegpt_requests(args, seed=1, tokenizer=tokenizer)
    for request in requests:
        i = int(request.prompt.split(":")[0].removeprefix("question "))
        reply = "rivers flow to the ocean " * (i + 2)
        assert request.output_len == len(tokenizer.encode(reply, add_special_tokens=False))
        assert request.prompt_len == len(tokenizer.encode(request.prompt, add_special_tokens=False))
    estimated = sharegpt_requests(args, seed=0, tokenizer=None)
    assert [r.output_len for r in estimated] == [
        math.ceil(len("rivers flow to the ocean " * (int(r.prompt.split(":")[0][9:]) + 2)) / 4)
        for r in estimated
    ]
    with pytest.raises(SystemExit, match="10 usable conversations"):
        sharegpt_requests(dataset_args(num_prompts=11, dataset_path=str(path)), 0, tokenizer)


def test_request_bodies_speak_each_backend():
    request = SampleRequest([5, 6, 7], 3, 4)
    rayinfer = request_body(request, "tiny", "completions", "rayinfer")
    assert rayinfer["prompt"] == [5, 6, 7] and rayinfer["ignore_eos"]
    assert rayinfer["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert rayinfer["rayinfer_timings"]
    hf = request_body(SampleRequest("hi", 1, 4), "/ckpt", "chat", "transformers")
    assert hf["messages"] == [{"role": "user", "content": "hi"}]
    assert json.loads(hf["generation_config"])["min_new_tokens"] == 4
    assert "ignore_eos" not in hf and "rayinfer_timings" not in hf
    assert (
        "continuous_usage_stats"
        not in request_body(request, "m", "completions", "openai")["stream_options"]
    )


def completion(text: str, usage_tokens: int | None = None) -> dict:
    event = {"choices": [{"text": text}]}
    if usage_tokens is not None:
        event["usage"] = {"prompt_tokens": 7, "completion_tokens": usage_tokens}
    return event


def test_text_events_fill_ttft_itl_usage_and_timings():
    result = RequestResult()
    record_event(result, completion("a"), 0.25)
    record_event(result, completion(""), 0.30)  # no usage per chunk: an empty chunk is not a token
    record_event(result, completion("b"), 0.35)
    handoff = {"kv_export_s": 0.01, "kv_import_s": 0.02, "kv_bytes": 640.0, "kv_put_s": 0.004,
               "kv_path": "shm", "kv_copies": "batched/staged"}  # fmt: skip
    usage = {"prompt_tokens": 7, "completion_tokens": 3}
    record_event(result, {"choices": [], "usage": usage, "rayinfer_timings": handoff}, 0.4)
    finish(result, 0.4, SampleRequest("x", 1, 3))
    assert result.ok and result.ttft_s == 0.25 and result.itl_s == [pytest.approx(0.1)]
    assert (result.prompt_tokens, result.output_tokens) == (7, 3)
    assert (result.kv_export_s, result.kv_import_s, result.kv_bytes) == (0.01, 0.02, 640.0)
    assert result.kv_parts_s == {"kv_put_s": 0.004} and result.kv_path == "shm"
    assert result.kv_copies == "batched/staged"
    record_event(result, {"error": {"message": "boom"}}, 0.5)
    assert result.error == "boom"
    record_event(result, {"error": "transformers says"}, 0.5)  # transformers serve's shape
    assert result.error == "transformers says"


def test_a_token_with_empty_text_sets_ttft_when_chunks_carry_usage():
    result = RequestResult()
    record_event(result, completion("", usage_tokens=1), 0.2)  # first token: half a character
    record_event(result, completion("é", usage_tokens=2), 0.3)
    record_event(result, completion("", usage_tokens=2), 0.35)  # a chunk without a new token
    finish(result, 0.4, SampleRequest("x", 1, 2))
    assert result.has_chunk_usage and result.ttft_s == 0.2
    assert result.itl_s == [pytest.approx(0.1)] and result.tpot_s == pytest.approx(0.2)


def test_chat_role_chunk_is_not_a_token():
    result = RequestResult()
    usage0 = {"prompt_tokens": 3, "completion_tokens": 0}
    record_event(result, {"choices": [{"delta": {"role": "assistant"}}], "usage": usage0}, 0.1)
    usage1 = usage0 | {"completion_tokens": 1}
    record_event(result, {"choices": [{"delta": {"content": ""}}], "usage": usage1}, 0.3)
    assert result.ttft_s == 0.3


def test_all_empty_text_without_chunk_usage_takes_ttft_at_the_first_chunk():
    result = RequestResult()
    record_event(result, completion(""), 0.2)
    record_event(result, completion(""), 0.3)
    record_event(
        result, {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}, 0.3
    )
    finish(result, 0.31, SampleRequest("x", 1, 2))
    assert result.ok and result.ttft_s == 0.2


def recorded(ttft_s, latency_s, output_tokens=5, ok=True) -> RequestResult:
    return RequestResult(ok=ok, prompt_tokens=10, output_tokens=output_tokens, ttft_s=ttft_s,
                         latency_s=latency_s, itl_s=[0.1] * (output_tokens - 1))  # fmt: skip


def test_goodput_counts_requests_within_every_slo():
    results = [
        recorded(0.1, 0.5),  # TPOT 100 ms, E2EL 500 ms
        recorded(0.3, 0.7),  # TTFT over 200 ms
        recorded(0.1, 0.9),  # TPOT 200 ms
        recorded(0.15, 0.15, output_tokens=1),  # one token: TPOT counts as 0
        RequestResult(error="HTTP 503"),
    ]
    slos = parse_goodput(["ttft:200", "tpot:150"])
    summary = summarize(results, duration_s=2.0, slos=slos)
    assert summary["goodput_fraction"] == pytest.approx(2 / 5)
    assert summary["request_goodput"] == pytest.approx(1.0)
    strict = summarize(results, 2.0, parse_goodput(["ttft:200", "tpot:150", "e2el:400"]))
    assert strict["goodput_fraction"] == pytest.approx(1 / 5)
    with pytest.raises(SystemExit, match="NAME:MS"):
        parse_goodput(["latency:5"])


def test_summary_and_report_carry_the_vllm_lines_and_the_handoff_share():
    results = [recorded(0.1, 0.5), recorded(0.2, 0.6), RequestResult(error="HTTP 503")]
    for result, export_s in zip(results, (0.01, 0.02)):
        result.kv_export_s, result.kv_import_s, result.kv_bytes = export_s, 0.02, 1000.0
        result.kv_parts_s = {"kv_get_s": export_s / 2}
    results[0].itl_s[0] = 0.3  # the first gap, where a disaggregated import lands
    results[1].kv_path = "object_store"
    results[0].kv_copies = results[1].kv_copies = "batched/batched"
    summary = summarize(results, duration_s=2.0)
    assert summary["kv_paths"] == {"object_store": 1}
    assert summary["kv_copies"] == {"batched/batched": 2}
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["request_throughput"] == 1.0
    assert summary["input_throughput"] == 10.0 and summary["output_throughput"] == 5.0
    assert summary["mean_tpot_ms"] == pytest.approx(100.0)
    assert summary["mean_e2el_ms"] == pytest.approx(550.0)
    assert summary["mean_handoff_share_of_ttft_pct"] == pytest.approx(25.0)  # (exp + imp) / TTFT
    assert summary["p50_kv_export_share_of_ttft_pct"] == pytest.approx(10.0)  # 10% and 10%
    assert summary["p50_kv_import_share_of_ttft_pct"] == pytest.approx(15.0)  # 20% and 10%
    assert summary["p50_first_itl_ms"] == pytest.approx(200.0)  # 300 and 100 ms
    assert summary["p50_itl_ms"] == pytest.approx(100.0)
    assert summary["mean_kv_get_ms"] == pytest.approx(7.5) and "mean_kv_put_ms" not in summary
    report = format_report(summary, slos={"ttft": 100.0})
    for line in (
        "Request throughput (req/s):",
        "Request goodput (req/s):",
        "Input token throughput (tok/s):",
        "Output token throughput (tok/s):",
        "P99 TTFT (ms):",
        "P95 TPOT (ms):",
        "P50 ITL (ms):",
        "P99 E2EL (ms):",
        "Mean hand-off share of TTFT (%):",
        "Median import share of TTFT (%):",
        "Median first ITL (ms):",
        "Mean / P50 kv_get (ms):",
    ):
        assert line in report
    assert "Requests by hand-off path:" + " " * 14 + "object_store 1" in report
    assert "batched/batched 2" in report.split("Requests by copies (export/import):")[1]


def test_json_has_no_inf_or_nan():
    assert strict_json({"rate": math.inf, "p": [float("nan"), 1.5]}) == {
        "rate": "inf",
        "p": [None, 1.5],
    }


def test_plot_is_written_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    summary = summarize([recorded(0.1, 0.5)], 1.0)
    passes = [{"request_rate": rate, "summary": summary} for rate in (1.0, math.inf)]
    assert plot_sweep(passes, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


# --- against a running server ---


@pytest.fixture(scope="module")
def server(disaggregated_server):
    """The shared `serve run` (disaggregated, max_model_len=512; tests/serve/conftest.py)."""
    return disaggregated_server


async def first_texts(url: str, prompts: list[list[int]]) -> list[str]:
    """Each prompt's first streamed chunk text (of two tokens: a last token is flushed)."""

    async def one(session, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            async for line in reply.content:
                if line.startswith(b"data: {"):
                    return json.loads(line[6:])["choices"][0]["text"]
        return None

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, p) for p in prompts))


@pytest.mark.slow
def test_ttft_is_positive_when_the_first_token_has_no_text(server):
    args = dataset_args(num_prompts=64, input_len=8, range_ratio=0.0)
    candidates = [r.prompt for r in random_requests(args, 5, load_tokenizer("tiny"))]
    texts = asyncio.run(first_texts(server.http_url, candidates))
    empty = [p for p, text in zip(candidates, texts) if text == ""]
    assert empty, f"no prompt's first token was empty text: {texts}"
    request = SampleRequest(empty[0], 8, 6)

    async def send(backend):
        async with aiohttp.ClientSession() as session:
            body = request_body(request, "tiny", "completions", backend)
            return await bench_serve.send_one(
                session, server.http_url, body, request, "completions"
            )

    for backend in ("rayinfer", "openai"):  # usage on every chunk, and not
        result = asyncio.run(send(backend))
        assert result.ok and result.output_tokens == 6, result.error
        assert 0 < result.ttft_s <= result.latency_s
        assert result.has_chunk_usage == (backend == "rayinfer")
    assert result.ttft_s >= result.first_chunk_s  # text only: the empty first chunk is unseen
    result = asyncio.run(send("rayinfer"))
    assert result.ttft_s == result.first_chunk_s  # usage per chunk: the empty token counts


@pytest.mark.slow
def test_sweep_with_every_flag_writes_json_and_plot(server, tmp_path):
    out = tmp_path / "sweep.json"
    argv = ["--url", server.http_url, "--num-prompts", "12", "--input-len", "40", "--output-len",
            "8", "--range-ratio", "0.5", "--request-rate", "20,inf", "--max-concurrency", "4",
            "--goodput", "ttft:600000", "tpot:600000", "--num-warmups", "3", "--json", str(out),
            "--plot", str(tmp_path / "sweep.png")]  # fmt: skip
    assert bench_serve.main(argv) == 0
    record = json.loads(out.read_text())
    assert [p["request_rate"] for p in record["passes"]] == [20.0, "inf"]
    assert record["has_client_tokenizer"] and record["num_warmups"] == 3
    for p in record["passes"]:
        s = p["summary"]
        assert (s["completed"], s["failed"], s["goodput_fraction"]) == (12, 0, 1.0)
        for key in ("request_throughput", "input_throughput", "output_throughput",
                    "mean_ttft_ms", "p50_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "p95_tpot_ms",
                    "p99_itl_ms", "p50_e2el_ms", "request_goodput"):  # fmt: skip
            assert s[key] is not None and s[key] > 0, key
        for request in p["requests"]:
            assert request["ok"] and request["ttft_s"] > 0 and request["has_chunk_usage"]
            assert 20 <= request["prompt_tokens"] <= 60  # token ids: the server counts the same
            assert 4 <= request["output_tokens"] <= 12
    sent = [r["sent_s"] for r in record["passes"][0]["requests"]]
    assert sent[-1] > 0  # Poisson arrivals spread the sends (the inf pass sends at once)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "sweep.png").is_file()


@pytest.mark.slow
def test_sharegpt_chat_against_the_server(server, tmp_path):
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path, 6)
    out = tmp_path / "sharegpt_out.json"
    argv = ["--url", server.http_url, "--endpoint", "chat", "--dataset", "sharegpt",
            "--dataset-path", str(path), "--num-prompts", "4", "--sharegpt-output-len", "6",
            "--json", str(out)]  # fmt: skip
    assert bench_serve.main(argv) == 0
    (only,) = json.loads(out.read_text())["passes"]
    assert only["summary"]["completed"] == 4
    assert all(r["output_tokens"] == 6 and r["ttft_s"] > 0 for r in only["requests"])


@pytest.mark.slow
def test_response_format_puts_structured_output_on_every_request(server, tmp_path):
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    path = tmp_path / "format.json"
    path.write_text(json.dumps({"type": "json_schema",
                                "json_schema": {"name": "reply", "schema": schema}}))  # fmt: skip
    out = tmp_path / "structured.json"
    argv = ["--url", server.http_url, "--endpoint", "chat", "--num-prompts", "4",
            "--input-len", "16", "--output-len", "12", "--response-format", str(path),
            "--json", str(out)]  # fmt: skip
    assert bench_serve.main(argv) == 0
    (only,) = json.loads(out.read_text())["passes"]
    assert only["summary"]["completed"] == 4
    for request in only["requests"]:  # random weights: only the grammar makes it JSON
        assert request["output_tokens"] == 12 and request["text"].startswith('{"text": "')
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--response-format", str(tmp_path / "missing.json")])
