"""End to end: the real `serve run rayinfer.app:build` CLI on a private cluster, driven over HTTP
with the openai client, through Python handles, and watched through `serve status` and Prometheus.

One server for the module (starting one costs ~40 s on 2 cores). Its decode deployment autoscales
between 1 and 2 replicas with short delays so the autoscaling test fits in CI (its load also
serves the decode worker's death: two replicas are up then), and it runs two prefill replicas,
so that a prefill worker's death has a replica to fail over to. The tests that kill things run
after the rest; the KV-loss test, which kills a prefill worker, runs last.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from rayinfer.bench.polling import wait_for
from rayinfer.bench.serve_cluster import REPO_ROOT, ServeCluster
from tests.serve.offline_reference import metric_samples, offline_replies, served_replies

pytestmark = pytest.mark.slow

APP_ARGS = [
    "disaggregate=true",
    "max_model_len=256",
    "health_check_period_s=2",
    "prefill.autoscaling.min_replicas=2",
    "prefill.autoscaling.max_replicas=2",
    "decode.autoscaling.max_replicas=2",
    "decode.autoscaling.target_ongoing_requests=1",
    "decode.autoscaling.upscale_delay_s=1",
    "decode.autoscaling.downscale_delay_s=3",
    "decode.autoscaling.look_back_period_s=2",
    "decode.autoscaling.metrics_interval_s=0.5",
]
PROMPT = "The quick brown fox"
PHASES = ("prefill", "decode")


@pytest.fixture(scope="module")
def server():
    with ServeCluster(APP_ARGS) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=120)


def chat(client, stream: bool, max_tokens: int = 12):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about the river."}],
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
    )


def test_models_and_health(server, client):
    assert server.get_json("/health") == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_stream_equals_whole(client):
    whole = chat(client, stream=False)
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in chat(client, stream=True) if chunk.choices
    )
    assert whole.choices[0].message.content
    assert streamed == whole.choices[0].message.content
    assert whole.usage.completion_tokens <= 12
    assert whole.choices[0].finish_reason in ("stop", "length")


def test_completion_equals_offline_llm(client):
    import rayinfer

    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    offline = rayinfer.LLM("tiny", max_model_len=256).generate(
        PROMPT, rayinfer.SamplingParams(max_tokens=16, temperature=0)
    )[0]
    assert reply.choices[0].text == offline.text
    assert reply.usage.completion_tokens == len(offline.token_ids)
    assert reply.choices[0].finish_reason == offline.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_text_of_several_prompts_equals_the_offline_engine(server, stream):
    """As the colocated server must (test_colocated_serve.py): both modes stream the same."""
    assert served_replies(server.http_url, stream=stream) == offline_replies()


def test_logprobs_over_http_equal_the_offline_llm(client):
    """Completions' logprobs (the first token from prefill, the rest from decode) equal the
    offline engine's; chat's streamed logprobs cover every generated token."""
    import rayinfer

    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    params = rayinfer.SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    offline = rayinfer.LLM("tiny", max_model_len=256).generate(PROMPT, params)[0]
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [entry.chosen.token for entry in offline.logprobs]
    expected = [entry.chosen.logprob for entry in offline.logprobs]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about the river."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.logprobs is not None:
                content += choice.logprobs.content
    assert usage is not None and len(content) == usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)


def test_echo_scores_the_prompt_like_an_eval_harness(client):
    """lm-eval's loglikelihood request: context + continuation as the prompt, echo, logprobs=1,
    max_tokens=1; the prompt tokens' log-probabilities equal the offline engine's."""
    import rayinfer

    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = reply.choices[0]
    assert choice.text.startswith(PROMPT)
    params = rayinfer.SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    offline = rayinfer.LLM("tiny", max_model_len=256).generate(PROMPT, params)[0]
    num_prompt = len(offline.prompt_logprobs)
    assert reply.usage.prompt_tokens == num_prompt
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == num_prompt + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [entry.chosen.logprob for entry in offline.prompt_logprobs[1:]]
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(expected, abs=1e-4)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_n_choices_each_equal_a_single_request_with_the_next_seed(client):
    sampled = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9)
    reply = client.completions.create(**sampled, seed=11, n=3)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    singles = [client.completions.create(**sampled, seed=11 + i) for i in range(3)]
    assert [c.text for c in reply.choices] == [s.choices[0].text for s in singles]
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    question = [{"role": "user", "content": "Tell me about the river."}]
    chat_args = dict(model="tiny", messages=question, max_tokens=6, temperature=0.9, seed=5, n=2)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**chat_args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    whole = client.chat.completions.create(**chat_args)
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_serve_status_and_handoff_metric(server, client):
    def deployments() -> dict:  # the dashboard's REST API, what `serve status` reads
        return server.serve_details()["applications"]["default"]["deployments"]

    listed = server.serve_status()["applications"]["default"]["deployments"]  # the CLI
    assert {"Ingress", "Prefill", "Decode"} <= set(listed)
    # the tests before may have scaled decode up (n > 1 runs choices concurrently): wait for it
    # (polled through the API: a `serve status` process costs ~3 s of CPU on 2 busy cores)
    wait_for(
        lambda: all(d["status"] == "HEALTHY" for d in deployments().values()),
        timeout_s=90,
        what="every deployment HEALTHY",
    )
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "rayinfer_timings": True}  # fmt: skip
    reply = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60).json()
    # On one node the KV goes through the prefill worker's shared-memory arena by default.
    timings = reply["rayinfer_timings"]
    assert timings["kv_path"] == "shm" and timings["kv_put_s"] == 0.0
    # copied out during the prefill step, layer by layer; a CPU cache on both sides
    assert timings["kv_copies"] == "layers/host"
    assert timings["kv_bytes"] > 0 and timings["kv_import_s"] > 0
    wait_for(
        lambda: server.metric_sum("ray_rayinfer_kv_handoff_bytes_total") > 0,
        timeout_s=60,
        what="a non-zero ray_rayinfer_kv_handoff_bytes_total",
    )
    name = "ray_rayinfer_kv_handoff_seconds_count"

    def observed() -> bool:  # the export (phase=prefill) and the import, both by the arena
        text = server.metrics_text()
        return all(sum(metric_samples(text, name, phase=p, path="shm")) for p in PHASES)

    wait_for(observed, timeout_s=60, what=f"{name} of both phases with path=shm")
    assert not metric_samples(server.metrics_text(), name, path="object_store")


def test_prometheus_lists_rayinfer_metrics(server):
    wait_for(
        lambda: server.metric_sum("ray_rayinfer_time_to_first_token_seconds_count") > 0,
        timeout_s=60,
        what="a non-zero TTFT count",
    )
    text = server.metrics_text()
    for name in ("requests_total", "kv_cache_usage", "queue_length", "generation_tokens_total"):
        assert f"ray_rayinfer_{name}" in text
    for phase in ("prefill", "decode"):  # the CPU rule: max(4 x 256, 16384) tokens per replica
        capacity = metric_samples(text, "ray_rayinfer_kv_cache_capacity_tokens", phase=phase)
        assert capacity and set(capacity) == {16384.0}
    wait_for(
        lambda: server.metric_sum("ray_rayinfer_engine_steps_total") > 0,
        timeout_s=30,
        what="engine steps counted (mode=eager on the CPU: no graphs there by default)",
    )


def test_32_concurrent_streams_complete(server):
    async def one(client, index: int) -> tuple[int, int, str]:
        max_tokens = 8 + index % 5
        stream = await client.completions.create(
            model="tiny",
            prompt=f"{PROMPT} number {index}",
            max_tokens=max_tokens,
            temperature=0.8,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish_reason = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish_reason = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return max_tokens, usage.completion_tokens, finish_reason

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="x", timeout=180)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    for wanted, got, finish_reason in results:
        assert (got, finish_reason) == (wanted, "length")


BAD_BODIES = {
    "missing messages": ("chat", {"model": "tiny"}, "messages"),
    "empty prompt": ("completions", {"model": "tiny", "prompt": ""}, "prompt"),
    "max_tokens=-1": ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    "temperature=hot": ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    "top_p=7": ("completions", {"prompt": "hi", "top_p": 7}, "top_p"),
    "prompt too long": ("completions", {"prompt": "fox " * 400}, "prompt"),
    "messages not a list": ("chat", {"messages": "hi"}, "messages"),
    "top_logprobs=50": (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
        "top_logprobs",
    ),
    "logit_bias": ("completions", {"prompt": "hi", "logit_bias": {"100000": 5}}, "logit_bias"),
    "seed=2**64": ("completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    "seed=-1": ("chat", {"messages": [{"role": "user", "content": "hi"}], "seed": -1}, "seed"),
    "content null": (
        "chat",
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content",
    ),
    "no content": ("chat", {"messages": [{"role": "system"}]}, "messages[0].content"),
    "five stops": ("completions", {"prompt": "hi", "stop": list("abcde")}, "stop"),
    "empty body": ("chat", None, "messages"),
    "200,000 words": ("completions", {"prompt": "fox " * 200_000}, "prompt"),
}
LEAKS = ("Traceback", "actor_id", "pid=", "\x1b", "\\u001b")


def assert_clean_error(reply: httpx.Response) -> dict:
    """An OpenAI error body with a short message and the request id, and no internals."""
    for leak in LEAKS:
        assert leak not in reply.text, reply.text
    error = reply.json()["error"]
    assert error["message"] and len(error["message"]) <= 500 and "\n" not in error["message"]
    assert error["request_id"].startswith(("req-", "cmpl-", "chatcmpl-"))
    return error


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_input_is_400_naming_the_field(server, case):
    route, body, field = BAD_BODIES[case]
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    reply = httpx.post(server.http_url + path, json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = assert_clean_error(reply)
    assert error["param"] == field
    assert field in error["message"]


@pytest.mark.parametrize("seed", [2**63, 2**64 + 5, -1])
def test_a_bad_seed_is_400_and_the_next_request_succeeds(client, seed):
    """A bad seed once broke the whole engine step and the requests after it."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, seed=seed)
    assert caught.value.body["param"] == "seed"
    assert f"seed={seed} must be in 0..9223372036854775807" in caught.value.body["message"]
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.8, seed=2**63 - 1
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


def test_malformed_json_and_unknown_model_then_still_serving(server, client):
    url = server.http_url + "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    broken = httpx.post(url, content=b'{"messages": [', headers=headers, timeout=30)
    assert broken.status_code == 400
    assert "JSON" in broken.json()["error"]["message"]
    unknown = httpx.post(
        url, json={"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]}
    )
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert chat(client, stream=False, max_tokens=3).choices[0].message.content is not None


def test_client_disconnect_aborts_the_request(server):
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.http_url + "/v1/completions", json=body, timeout=60) as reply:
        chunks = reply.iter_lines()
        for _ in range(3):
            next(chunks)
    wait_for(
        lambda: aborted_requests(server, "decode") > 0,
        timeout_s=60,
        what="an aborted decode request",
    )


def aborted_requests(server, phase: str) -> float:
    total = 0.0
    for line in server.metrics_text().splitlines():
        if line.startswith("ray_rayinfer_requests_total{") and f'phase="{phase}"' in line:
            if 'status="abort"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_bench_serve_against_the_server(server):
    output = server.run_python(
        "-m",
        "rayinfer.bench",
        "serve",
        "--url",
        server.http_url,
        "--num-prompts",
        "8",
        "--max-concurrency",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "6",
    )
    assert "Successful requests:                    8" in output
    assert "Total generated tokens:                 48" in output
    assert "Mean hand-off share of TTFT (%):" in output


def test_python_handle_example(server):
    output = server.run_python(str(REPO_ROOT / "examples" / "handle_client.py"))
    report = json.loads(output.strip().splitlines()[-1])
    assert report["whole"] and report["whole"] == report["streamed"]
    assert report["chat"]
    assert len(report["logprobs"]) == 4 and all(lp <= 0 for lp in report["logprobs"])


def run_worker_death(server, phase: str) -> None:
    """Six clients keep greedy completions going (half streamed) while one worker of a replica
    of `phase` dies (worker_death_client.py): the replica leaves at once, what it held is retried
    or resumed on the other one, Serve starts a replacement, and every request answers the text
    a quiet server gave, the ones in flight at the kill and the ones sent after it."""
    client = ("-m", "rayinfer.bench.worker_death_client", server.http_url, phase)
    report = json.loads(server.run_python(*client, timeout_s=300).strip().splitlines()[-1])
    requests, killed_at = report["requests"], report["killed_at"]
    assert [r for r in requests if r["status"] != 200] == []
    assert [r for r in requests if r["text"] != report["references"][r["prompt"]]] == []
    assert any(r["began"] < killed_at < r["ended"] for r in requests), "none was in flight"
    assert any(r["began"] > killed_at for r in requests), "none was sent after the kill"
    assert report["replica_dead_s"] < 5 and report["replacement_started_s"] < 30, report


def test_decode_scales_with_load_and_a_dead_worker_costs_no_request(server):
    """The clients' load scales decode from 1 to 2 replicas (the client waits for both), one
    decode worker dies by ray.kill (see run_worker_death), and decode scales back to 1 after."""
    wait_for(lambda: server.running_replicas("Decode") == 1, timeout_s=90, what="1 decode replica")
    run_worker_death(server, "decode")
    wait_for(lambda: server.running_replicas("Decode") == 1, timeout_s=90, what="back to 1")


def test_decode_replica_death_mid_stream_resumes_elsewhere(server):
    output = server.run_python(str(REPO_ROOT / "tests" / "serve" / "decode_death_client.py"))
    report = json.loads(output.strip().splitlines()[-1])
    assert report["killed"], "no Decode replica was found to kill"
    assert report["token_ids"] == report["reference_token_ids"]
    assert report["text"] == report["reference_text"]
    assert report["finish_reason"] == "length"


def test_a_dead_prefill_worker_costs_no_request(server):
    """Of the two prefill replicas, one loses its worker to a SIGKILL (see run_worker_death)."""
    run_worker_death(server, "prefill")


def logged_with_traceback(server, request_id: str) -> bool:
    """Whether a log of the cluster (serve run's, the replicas') has the id and a traceback."""
    for path in server.temp_dir.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".err", ".out"):
            text = path.read_text(errors="replace")
            if request_id in text and "Traceback" in text[text.index(request_id) :]:
                return True
    return False


def test_lost_kv_is_recomputed(server, client):
    output = server.run_python(
        str(REPO_ROOT / "tests" / "serve" / "lost_kv_client.py"), server.http_url
    )
    report = json.loads(output.strip().splitlines()[-1])
    # With its one worker dead, the Prefill replica fails requests until it is replaced: a 5xx
    # whose body names no actor, pid or traceback; the server log has them under the request id.
    # Where Serve had already started the replacement, the ingress's one retry lands there and
    # every request in the window succeeds instead (the failure policy's other outcome).
    during = report["http_while_prefill_worker_dead"]
    statuses = report["statuses_while_prefill_worker_dead"]
    assert statuses, "no request was sent while the Prefill replica's worker was dead"
    if during is None:
        assert set(statuses) == {200}, statuses
    else:
        reply = httpx.Response(during["status"], text=during["text"])
        error = assert_clean_error(reply)
        assert error["type"] == "internal_server_error" or during["status"] == 503
        assert error["request_id"].startswith("cmpl-")
        wait_for(
            lambda: logged_with_traceback(server, error["request_id"]),
            timeout_s=30,
            what="the failed request's id and traceback in the server's logs",
        )
    assert report["was_recomputed"] and report["kv_in_arena"]
    assert report["token_ids"] == report["reference_token_ids"]
    assert report["text"] == report["reference_text"]
    assert report["finish_reason"] == "length"
    wait_for(
        lambda: server.metric_sum("ray_rayinfer_kv_recomputes_total") > 0,
        timeout_s=60,
        what="a counted KV recompute",
    )
    # The Prefill replica whose worker died is replaced; the server keeps serving.
    wait_for(lambda: chat(client, stream=False, max_tokens=3), timeout_s=90, what="recovery")
