"""Prefill and decode on different Ray nodes: `prefill.resources` / `decode.resources` pin each
phase to the node offering its resource; the KV crosses nodes through the object store.

The e2e tests run a real two-node cluster on this one machine (rayinfer/bench/serve_cluster.py:
a head offering `prefill_box`, a second `ray start` offering `decode_box`), then kill the decode
node. Before them, fast tests of the parts: the build-time check of the nodes
(deployments/node_fit.py) against made-up `ray.nodes()` listings, the keys, the bundles, and
the ingress's bound on a call no replica takes (pipeline.until_taken).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rayinfer.app import phase_options
from rayinfer.bench.serve_cluster import REPO_ROOT, NodeSpec, ServeCluster, wait_for
from rayinfer.config import ConfigError
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.node_fit import check_nodes_fit
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.pipeline import until_taken
from tests.serve.offline_reference import offline_replies, served_replies

HEAD_NODE = {"NodeID": "aa" * 28, "Alive": True, "NodeManagerAddress": "10.0.0.1",
             "Resources": {"CPU": 16.0, "prefill_box": 8.0, "node:10.0.0.1": 1.0,
                           "memory": 1e11}}  # fmt: skip
DECODE_NODE = {"NodeID": "bb" * 28, "Alive": True, "NodeManagerAddress": "10.0.0.2",
               "Resources": {"CPU": 2.0, "decode_box": 2.0}}  # fmt: skip
DEAD_NODE = {**DECODE_NODE, "NodeID": "cc" * 28, "Alive": False,
             "Resources": {"CPU": 64.0, "gpu_box": 8.0}}  # fmt: skip
NODES = [HEAD_NODE, DECODE_NODE, DEAD_NODE]


def check(args: dict) -> None:
    config = AppConfig.from_args({"disaggregate": "true", **args})
    check_nodes_fit(config, ("prefill", "decode"), use_gpus=False, nodes=NODES)


def test_phases_pinned_to_nodes_that_hold_them_pass():
    pinned = {"prefill.resources.prefill_box": "1", "decode.resources.decode_box": "1"}
    check({**pinned, "prefill.tp": "2", "ingress.resources.prefill_box": "0.01"})


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"decode.resources.gpu_box": "1"}, "decode.resources.gpu_box=1: no alive Ray node"),
        ({"ingress.resources.nowhere": "1"}, "ingress.resources.nowhere=1: no alive Ray node"),
        (  # each node offers one of the two, none both
            {"decode.resources.decode_box": "1", "decode.resources.prefill_box": "1"},
            "decode.resources=decode_box=1, prefill_box=1: no alive Ray node holds a whole",
        ),
        (  # 3 workers x 1 decode_box > 2; or 3 x 0.5 + 0.1 CPUs > 2
            {"decode.resources.decode_box": "1", "decode.tp": "3"},
            "no alive Ray node holds a whole replica (3 workers, CPU=1.6, decode_box=3 on one",
        ),
    ],
)
def test_a_phase_no_alive_node_holds_fails_naming_the_key_and_the_nodes(args, expected):
    with pytest.raises(ConfigError) as error:
        check(args)
    message = str(error.value)
    assert expected in message
    assert "10.0.0.1 (aaaaaaaa): CPU=16, prefill_box=8" in message
    assert "10.0.0.2 (bbbbbbbb): CPU=2, decode_box=2" in message
    assert "gpu_box" not in message.split("offer:")[1]  # the dead node is not offered


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"decode.resources.decode_box": "-1"}, "decode.resources.decode_box='-1': Input should "
         "be greater than 0"),
        ({"prefill.resources.box": "many"}, "prefill.resources.box='many': Input should be a "
         "valid number"),
        ({"engine.resources.GPU": "1"}, "'GPU' is not a custom resource"),
        ({"decode.resources": "box"}, "decode.resources='box': use a JSON object"),
    ],
)  # fmt: skip
def test_bad_resources_name_the_key(args, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        AppConfig.from_args(args)


def test_each_worker_bundle_asks_for_the_phase_resources():
    config = AppConfig.from_args(
        {"decode.resources": '{"decode_box": 1}', "decode.tp": "2", "ingress.resources.a": "1"}
    )
    bundles = phase_options(config, config.decode, use_gpus=False)["placement_group_bundles"]
    assert bundles == [{"CPU": 0.1}] + [{"CPU": 0.5, "decode_box": 1.0}] * 2
    assert phase_options(config, config.prefill, use_gpus=False)["placement_group_bundles"] == [
        {"CPU": 0.1},
        {"CPU": 0.5},
    ]


class Unrouted:
    """A handle call that no replica ever takes (Serve's router holding it)."""

    by_reference = True
    cancelled = False

    async def _to_object_ref(self):
        await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True


def test_a_call_no_replica_takes_is_cancelled_and_answered_503():
    response = Unrouted()
    with pytest.raises(OpenAIError) as error:
        asyncio.run(until_taken(response, "decode", wait_s=0.05))
    assert error.value.status == 503 and error.value.code == "replica_unavailable"
    assert "no decode replica took this request within 0.05 s" in error.value.message
    assert response.cancelled


APP_ARGS = [
    "disaggregate=true",
    "max_model_len=256",
    "health_check_period_s=1",
    "prefill.resources.prefill_box=1",
    "decode.resources.decode_box=1",
    "ingress.resources.node:__internal_head__=0.01",  # on the head, beside its HTTP proxy
    "ingress.max_replica_wait_s=5",
]
# The GCS declares a node dead after 5 failed checks 1 s apart (default: 3 s apart); a killed
# raylet fails each at once, a busy one keeps the default 10 s to answer.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000"}
PROMPT = "The quick brown fox"
ACTORS_BY_NODE = """
import json, ray
from ray.util.state import list_actors
ray.init(address="auto", log_to_driver=False)
nodes = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
actors = [(a.name, a.node_id) for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
          if (a.name or "").startswith("rayinfer-")]
print(json.dumps({"nodes": nodes, "actors": actors}))
"""


@pytest.fixture(scope="module")
def server():
    cluster = ServeCluster(
        APP_ARGS,
        num_cpus=3,
        head_resources={"prefill_box": 1},
        nodes=[NodeSpec(num_cpus=1, resources={"decode_box": 1})],
        extra_env=FAST_NODE_DEATH,
    )
    with cluster:
        yield cluster


@pytest.mark.slow
def test_prefill_and_decode_workers_sit_on_the_nodes_offering_their_resources(server):
    report = json.loads(server.run_python("-c", ACTORS_BY_NODE).strip().splitlines()[-1])
    nodes, actors = report["nodes"], report["actors"]
    assert len(nodes) == 2
    prefill = {node for name, node in actors if name.startswith("rayinfer-prefill-")}
    decode = {node for name, node in actors if name.startswith("rayinfer-decode-")}
    assert len(prefill) == 1 and len(decode) == 1 and prefill != decode, actors
    assert "prefill_box" in nodes[prefill.pop()] and "decode_box" in nodes[decode.pop()]


@pytest.mark.slow
def test_greedy_text_across_nodes_equals_the_offline_engine(server):
    assert served_replies(server.http_url, stream=True) == offline_replies()
    # The prefill worker's arena is on the other node: decode asks for it through the store.
    body = {"model": "tiny", "prompt": "The river", "max_tokens": 2, "rayinfer_timings": True}
    timings = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60).json()
    assert timings["rayinfer_timings"]["kv_path"] == "arena_via_object_store"


@pytest.mark.slow
def test_serve_run_pinning_decode_to_a_missing_resource_fails_at_start(server):
    command = ["serve", "run", "rayinfer.app:build", "disaggregate=true",
               "decode.resources.gpu_box=1"]  # fmt: skip
    result = subprocess.run(command, env=server.env(), capture_output=True, text=True,
                            timeout=120, cwd=REPO_ROOT)  # fmt: skip
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "decode.resources.gpu_box=1: no alive Ray node offers the resource 'gpu_box'" in output
    assert "decode_box=1" in output and "prefill_box=1" in output  # what the nodes offer


def stream_completion(url: str, index: int, outcome: dict) -> None:
    """A long greedy stream; `outcome` gets its status, chunks and how it ended: "done",
    "error" (an in-band error event) or the client's exception (a timeout is a hang)."""
    body = {"model": "tiny", "prompt": f"{PROMPT} {index}", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    outcome.update(chunks=0, end=None)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
            outcome["status"] = reply.status_code
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome["end"] = outcome["end"] or "done"
                    break
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    outcome.update(end="error", error=event["error"])
                else:
                    outcome["chunks"] += 1
    except httpx.HTTPError as error:
        outcome["end"] = type(error).__name__
    outcome["ended_at"] = time.monotonic()


@pytest.mark.slow
def test_the_decode_node_dies_and_the_server_keeps_answering(server):
    """Streams in flight when the decode node dies end (an error event, or done where resumed
    elsewhere), none hangs; new requests then get a completion or a clean 5xx error body in a
    bound: with no other node offering decode_box, no Decode replica can take them."""
    outcomes = [{} for _ in range(3)]
    threads = [
        threading.Thread(target=stream_completion, args=(server.http_url, i, outcome))
        for i, outcome in enumerate(outcomes)
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(o.get("chunks", 0) >= 3 for o in outcomes), 60, 0.1, "streams going")
    killed_at = time.monotonic()
    assert server.kill_node(0)
    assert not any(o["end"] for o in outcomes), "a stream ended before the kill"
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads), "an in-flight stream hung"
    for outcome in outcomes:
        assert outcome["status"] == 200 and outcome["end"] in ("done", "error"), outcome
        if outcome["end"] == "error":
            assert outcome["error"]["message"] and outcome["error"]["request_id"], outcome
    print("in flight:", [(o["end"], round(o["ended_at"] - killed_at, 1)) for o in outcomes])
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(complete_once, [server.http_url] * 3))
    print("after the death:", [(reply.status_code, seconds) for reply, seconds in answers])
    for reply, seconds in answers:
        assert reply.status_code in (200, 500, 503) and seconds < 30, (reply.text, seconds)
        if reply.status_code == 503:
            assert reply.headers["Retry-After"]
        if reply.status_code != 200:
            error = reply.json()["error"]
            assert error["message"] and error["request_id"].startswith("cmpl-"), error
    assert server.get_json("/health") == {"status": "ok"}


def complete_once(url: str) -> tuple[httpx.Response, float]:
    sent = time.monotonic()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    return reply, time.monotonic() - sent
