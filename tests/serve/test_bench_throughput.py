"""`python -m rayinfer.bench throughput`: the offline baseline the serve bench is compared with,
all at once or N requests in flight as the serve bench's client keeps a server."""

from __future__ import annotations

import json

import pytest

import rayinfer
from rayinfer.bench import throughput

ARGS = ["--num-prompts", "6", "--input-len", "12", "--output-len", "9", "--tokenizer", "tiny"]


@pytest.fixture(scope="module")
def llm():
    return rayinfer.LLM("tiny", max_model_len=128, num_kv_blocks=64)


def in_flight_per_step(llm) -> list[int]:
    """Wrap the engine's step to record how many requests it held at each step."""
    counts, step = [], llm.engine.step

    def counting_step():
        scheduler = llm.engine.scheduler
        counts.append(len(scheduler.waiting) + len(scheduler.running))
        return step()

    llm.engine.step = counting_step
    return counts


@pytest.mark.parametrize("max_concurrency", [None, 2])
def test_requests_in_flight_never_exceed_the_cap(llm, max_concurrency):
    args = throughput.parse_args(ARGS)
    requests = throughput.build_requests(args, 0, llm.tokenizer)
    counts = in_flight_per_step(llm)
    try:
        results, duration_s = throughput.run_all(llm, requests, "t", None, max_concurrency)
    finally:
        del llm.engine.step
    cap = max_concurrency or len(requests)
    assert max(counts) == cap and all(count <= cap for count in counts)
    assert all(result.ok and result.output_tokens == 9 for result in results)
    # Times count from each request's own start: none took longer than the whole pass.
    assert all(0 <= r.ttft_s <= r.latency_s <= duration_s - r.sent_s for r in results)
    if max_concurrency:  # later requests were added after earlier ones finished
        assert results[-1].sent_s >= min(r.latency_s for r in results[:2])


def test_the_command_writes_its_summary_and_says_what_the_cache_holds(tmp_path, capsys):
    """Two blocks of 16 tokens hold one request of 21 tokens at a time: of 3 in flight 2 wait,
    which the run says (and records) rather than calling them concurrent."""
    out = tmp_path / "offline.json"
    assert throughput.main([*ARGS, "--max-concurrency", "3", "--warmup-prompts", "1",
                            "--num-kv-blocks", "2", "--max-model-len", "32", "--json",
                            str(out)]) == 0  # fmt: skip
    record = json.loads(out.read_text())
    assert record["args"]["max_concurrency"] == 3
    assert record["summary"]["completed"] == 6 and record["summary"]["failed"] == 0
    assert record["cache_holds_requests"] == 1
    assert "note: the KV cache holds 1 of these requests at once" in capsys.readouterr().out


def test_on_a_gpu_the_cache_is_sized_as_serve_sizes_it():
    """A served replica fills 0.9 of its GPU with cache; the offline baseline does the same
    unless told otherwise, so both hold as many requests at once."""
    args = throughput.parse_args(ARGS)
    assert throughput.gpu_memory_utilization(args, on_gpu=True) == 0.9
    assert throughput.gpu_memory_utilization(args, on_gpu=False) is None  # LLM's CPU rule
    given = throughput.parse_args([*ARGS, "--gpu-memory-utilization", "0.5"])
    assert throughput.gpu_memory_utilization(given, on_gpu=True) == 0.5
    blocks = throughput.parse_args([*ARGS, "--num-kv-blocks", "64"])
    assert throughput.gpu_memory_utilization(blocks, on_gpu=True) is None  # the count wins
