"""End to end, colocated (`disaggregate=false`): the real `serve run rayinfer.app:build` with one
Engine deployment whose replicas prefill and decode in mixed batches, driven with the openai
client, httpx and Python handles; plus a server of random weights (`load_format=dummy`) from a
folder holding only config.json. (The disaggregated twin of these checks is test_server.py.)"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from rayinfer.bench.polling import wait_for
from rayinfer.bench.serve_cluster import REPO_ROOT
from tests.serve.offline_reference import (
    PROMPTS,
    metric_samples,
    offline_replies,
    served_replies,
)

pytestmark = pytest.mark.slow

APP_ARGS = [
    "disaggregate=false",
    "max_model_len=256",
    "health_check_period_s=2",
    "ingress.num_replicas=2",
]
CAPACITY = "ray_rayinfer_kv_cache_capacity_tokens"


@pytest.fixture(scope="module")
def server(serve_app):
    """The first app on the cluster that test_new_families_serve.py and test_overload.py then
    redeploy theirs on (tests/serve/conftest.py): fresh, for the gauge and log checks below."""
    return serve_app(APP_ARGS)


def test_one_engine_deployment_serves(server):
    deployments = server.serve_status()["applications"]["default"]["deployments"]
    assert set(deployments) == {"Ingress", "Engine"}
    assert server.running_replicas("Engine") == 1
    assert server.running_replicas("Ingress") == 2


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_text_equals_the_offline_engine(server, stream):
    assert served_replies(server.http_url, stream=stream) == offline_replies()


def test_python_handles_generate_and_stream(server):
    output = server.run_python(str(REPO_ROOT / "examples" / "handle_client.py"))
    report = json.loads(output.strip().splitlines()[-1])
    assert report["whole"] and report["whole"] == report["streamed"]
    assert report["chat"]
    assert len(report["logprobs"]) == 4 and all(lp <= 0 for lp in report["logprobs"])


def test_echo_carries_the_prompts_logprobs_once(server):
    """Colocated, the prompt's log-probabilities come with the first token (not only at the
    end), so an echoed multi-token completion scores each prompt token once."""
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}
    reply = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60).json()
    logprobs = reply["choices"][0]["logprobs"]
    num_prompt = reply["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == num_prompt + reply["usage"]["completion_tokens"]
    assert logprobs["token_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])


def test_kv_capacity_is_logged_and_exported_with_the_cpu_rule(server):
    """On the CPU the cache keeps max(4 x max_model_len, 16384) tokens: 1024 blocks of 16."""
    wait_for(
        lambda: metric_samples(server.metrics_text(), CAPACITY, phase="engine") == [16384.0],
        timeout_s=60,
        what="ray_rayinfer_kv_cache_capacity_tokens{phase=engine} = 16384",
    )
    line = "engine KV cache: 1024 blocks of 16 tokens = 16384 tokens"
    wait_for(lambda: logged(server, line), timeout_s=30, what="the capacity line in the logs")


def test_engine_metrics_and_client_disconnect_abort(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.http_url + "/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        for _ in range(3):
            next(lines)

    def total(name: str, **tags) -> float:
        return sum(metric_samples(server.metrics_text(), f"ray_rayinfer_{name}", **tags))

    wait_for(
        lambda: total("requests_total", phase="engine", status="abort"),
        timeout_s=60,
        what="an aborted engine request",
    )
    assert total("time_to_first_token_seconds_count", phase="ingress") > 0
    assert total("time_to_first_token_seconds_count", phase="engine") > 0
    assert total("generation_tokens_total", phase="engine") > 0


def logged(server, text: str) -> bool:
    for path in server.temp_dir.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".err", ".out"):
            if text in path.read_text(errors="replace"):
                return True
    return False


def test_random_weights_serve_from_a_folder_with_only_config_json(serve_app, tmp_path):
    """load_format=dummy: the workers draw the weights (seeded), so the server answers what the
    offline engine with the same random weights does; the tokenizer comes from elsewhere. Its
    app replaces the one above on the shared cluster (a new serve run, replicas and workers)."""
    from rayinfer.engine.model_source import resolve_model_path

    tiny = resolve_model_path("tiny")
    folder = tmp_path / "shapes-only"
    folder.mkdir()
    shutil.copy(tiny / "config.json", folder / "config.json")
    args = [f"model={folder}", "load_format=dummy", f"tokenizer={tiny}", "max_model_len=256",
            "disaggregate=false", "engine.num_kv_blocks=64"]  # fmt: skip
    cluster = serve_app(args)
    served = served_replies(cluster.http_url, model="shapes-only")
    expected = offline_replies(str(folder), load_format="dummy", tokenizer=str(tiny))
    assert served == expected
    assert served["completions"][0][0]  # the tiny tokenizer decodes the random tokens
    wait_for(
        lambda: metric_samples(cluster.metrics_text(), CAPACITY, phase="engine") == [1024.0],
        timeout_s=60,
        what="a capacity of engine.num_kv_blocks=64 x 16 tokens",
    )
