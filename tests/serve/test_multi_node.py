"""Prefill and decode on different Ray nodes: `prefill.resources` / `decode.resources` pin each
phase to the node offering its resource; the KV crosses nodes through the object store (the
prefill worker puts it there from its shared-memory arena when decode asks).

The e2e tests run one real cluster of four `ray start` nodes on this one machine
(rayinfer/bench/serve_cluster.py): a head for the HTTP proxy and the ingress, a node offering
`prefill_box` and two offering `decode_box`. The app is deployed onto it with `serve deploy`
of examples/serve_config_nodes.yaml, as onto several machines. The tests run in file order and
the last two kill nodes: the decode node (a replacement decode starts on the other one), then
the prefill node while it owns a hand-off's KV (decode recomputes it; prefill is then gone).
Before them, fast tests of the parts: the build-time check of the nodes
(deployments/node_fit.py), phases competing for one node included, against made-up
`ray.nodes()` listings, the keys, the bundles, and the ingress's bound on a call no replica
takes (pipeline.until_taken).
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
import yaml

from rayinfer.app import phase_options
from rayinfer.bench.cluster_processes import cluster_process_ids
from rayinfer.bench.polling import wait_for
from rayinfer.bench.serve_cluster import REPO_ROOT, NodeSpec, ServeCluster
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


# One node offering a single `box`: phases pinned to it compete for it (and for its CPUs).
BOX_NODE = {"NodeID": "dd" * 28, "Alive": True, "NodeManagerAddress": "10.0.0.4",
            "Resources": {"CPU": 4.0, "box": 1.0, "node:10.0.0.4": 1.0}}  # fmt: skip


def check(args: dict, nodes: list[dict] = NODES, phases=("prefill", "decode")) -> None:
    disaggregate = "true" if phases == ("prefill", "decode") else "false"
    config = AppConfig.from_args({"disaggregate": disaggregate, **args})
    check_nodes_fit(config, phases, use_gpus=False, nodes=nodes)


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
    "args",
    [
        {"prefill.resources.box": "0.5", "decode.resources.box": "0.5"},
        {"prefill.resources.box": "0.3", "decode.resources.box": "0.1",
         "ingress.resources.box": "0.3", "decode.tp": "4"},  # box 0.3 + 4 x 0.1 + 0.3, 2.7 CPUs
    ],
)  # fmt: skip
def test_phases_sharing_one_node_that_holds_them_all_pass(args):
    check(args, nodes=[BOX_NODE])


@pytest.mark.parametrize(
    "args, nodes, phases, expected",
    [
        (  # each alone takes the one box
            {"prefill.resources.box": "1", "decode.resources.box": "1"}, [BOX_NODE],
            ("prefill", "decode"),
            "prefill.resources (1 x CPU=0.6, box=1) and decode.resources (1 x CPU=0.6, box=1) "
            "each fit a node alone but not all at once: together they need CPU=1.2, box=2",
        ),
        (  # the ingress too; its actor takes no CPU
            {"prefill.resources.box": "0.4", "decode.resources.box": "0.4",
             "ingress.resources.box": "0.4"}, [BOX_NODE], ("prefill", "decode"),
            "and ingress.resources (1 x box=0.4) each fit a node alone but not all at once: "
            "together they need CPU=1.2, box=1.2",
        ),
        (  # the box would do, the CPUs not: 2 x (0.1 + 4 x 0.5) = 4.2 > 4
            {"prefill.resources.box": "0.1", "decode.resources.box": "0.1", "prefill.tp": "4",
             "decode.tp": "4"}, [BOX_NODE], ("prefill", "decode"),
            "together they need CPU=4.2, box=0.8",
        ),
        (  # the colocated Engine's two starting replicas and the ingress
            {"engine.resources.box": "0.5", "engine.autoscaling.min_replicas": "2",
             "engine.autoscaling.max_replicas": "2", "ingress.resources.box": "0.5"},
            [BOX_NODE], ("engine",),
            "engine.resources (2 x CPU=0.6, box=0.5) and ingress.resources (1 x box=0.5)",
        ),
        (  # three starting decode replicas on a node holding two
            {"decode.resources.decode_box": "1", "decode.autoscaling.initial_replicas": "3",
             "decode.autoscaling.max_replicas": "3"}, NODES, ("prefill", "decode"),
            "decode.resources (3 x CPU=0.6, decode_box=1) each fit a node alone but not all",
        ),
    ],
)  # fmt: skip
def test_phases_competing_for_one_node_fail_naming_the_keys_and_what_it_offers(
    args, nodes, phases, expected
):
    with pytest.raises(ConfigError) as error:
        check(args, nodes, phases)
    message = str(error.value)
    assert expected in message
    offered = "which offer: " + ("10.0.0.4 (dddddddd): CPU=4, box=1" if nodes == [BOX_NODE]
                                 else "10.0.0.2 (bbbbbbbb): CPU=2, decode_box=2")  # fmt: skip
    assert offered + ". Offer more" in message  # only the nodes the competing keys can use


def test_phases_pinned_to_different_nodes_do_not_compete():
    """Decode's two replicas fill the decode node; the head still holds prefill and ingress."""
    check({"prefill.resources.prefill_box": "7", "decode.resources.decode_box": "1",
           "decode.autoscaling.min_replicas": "2", "decode.autoscaling.max_replicas": "2",
           "ingress.resources.prefill_box": "0.01", "ingress.num_replicas": "2"})  # fmt: skip


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


EXAMPLE_CONFIG = REPO_ROOT / "examples" / "serve_config_nodes.yaml"
# Beside the example's args: a short context, fast health checks, and a short bound on a call
# no replica takes (the 503 once no node offers prefill_box).
TEST_ARGS = {"max_model_len": 256, "health_check_period_s": 1, "ingress.max_replica_wait_s": 5}
PREFILL_NODE, DECODE_NODES = 0, (1, 2)  # indexes into the cluster's joined nodes
# The GCS declares a node dead after 5 failed checks 1 s apart (default: 3 s apart); a killed
# raylet fails each at once, a busy one keeps the default 10 s to answer.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000"}
PROMPT = "The quick brown fox"
LOST_KV_CLIENT = str(REPO_ROOT / "tests" / "serve" / "lost_kv_client.py")


# A second app whose prefill and two decode replicas all pin to decode_box: each fits one of
# the two decode nodes alone, the three do not fit them at once, so its build fails.
CROWDED_APP = {"name": "crowded", "route_prefix": "/crowded", "import_path": "rayinfer.app:build",
               "args": {"disaggregate": True, "prefill.resources.decode_box": 1,
                        "decode.resources.decode_box": 1, "decode.autoscaling.min_replicas": 2,
                        "decode.autoscaling.max_replicas": 2}}  # fmt: skip


def serve_config() -> dict:
    """The example's config with the test's args, and the crowded app beside it."""
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    (app,) = config["applications"]
    app["args"] = {**app["args"], **TEST_ARGS}
    config["applications"].append(CROWDED_APP)
    return config


@pytest.fixture(scope="module")
def server():
    cluster = ServeCluster(
        serve_config=serve_config(),
        failing_apps=("crowded",),
        num_cpus=1,
        nodes=[
            NodeSpec(num_cpus=1, resources={"prefill_box": 1}),
            NodeSpec(num_cpus=1, resources={"decode_box": 1}),
            NodeSpec(num_cpus=1, resources={"decode_box": 1}),
        ],
        extra_env=FAST_NODE_DEATH,
    )
    with cluster:
        yield cluster
    # Every process of the four nodes is gone (those the kills left, and their workers).
    assert not cluster_process_ids(cluster.temp_dir, cluster.auth_token)


@pytest.fixture(scope="module")
def offline():
    return offline_replies()


def placement(server) -> dict[str, list[int]]:
    """Per phase, the nodes (indexes into the cluster's `nodes`; -1 the head) its alive actors
    sit on: the Prefill and Decode workers, the Ingress replicas."""
    prefixes = {"prefill": "rayinfer-prefill-", "decode": "rayinfer-decode-",
                "ingress": "SERVE_REPLICA::default#Ingress#"}  # fmt: skip
    actors = server.alive_actors()
    return {
        phase: sorted({node for name, node in actors if name.startswith(prefix)})
        for phase, prefix in prefixes.items()
    }


@pytest.mark.slow
def test_each_phase_sits_on_the_node_offering_its_resources(server):
    where = placement(server)
    assert where["prefill"] == [PREFILL_NODE], where  # the one node offering prefill_box
    assert len(where["decode"]) == 1 and where["decode"][0] in DECODE_NODES, where
    assert where["ingress"] == [-1], where  # node:__internal_head__
    assert server.replica_nodes("Decode") == where["decode"]  # the replica beside its worker


@pytest.mark.slow
def test_greedy_text_across_nodes_equals_the_offline_engine(server, offline):
    assert served_replies(server.http_url, stream=True) == offline
    # The prefill worker's arena is on another node: decode asks for it through the store.
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


@pytest.mark.slow
def test_serve_deploy_of_phases_competing_for_the_decode_nodes_fails_naming_the_keys(server):
    """The crowded app, deployed in the same `serve deploy` as the example's: `serve status`
    (the dashboard's REST API) shows why its build failed; the example's app runs beside it."""
    status, message = server.app_status("crowded")
    expected = (
        "prefill.resources (1 x CPU=0.6, decode_box=1) and decode.resources (2 x CPU=0.6, "
        "decode_box=1) each fit a node alone but not all at once: together they need CPU=1.8, "
        "decode_box=3 of the nodes that can hold them, which offer: "
    )
    assert status == "DEPLOY_FAILED" and expected in message, message
    offered = message.split(expected)[1].split(". Offer more")[0].split("; ")
    assert len(offered) == 2 and all("CPU=1, decode_box=1" in node for node in offered), offered
    assert server.app_status("default")[0] == "RUNNING"


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


def complete_once(url: str) -> tuple[httpx.Response, float]:
    sent = time.monotonic()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    return reply, time.monotonic() - sent


def assert_clean_error(status: int, text: str) -> None:
    error = json.loads(text)["error"]
    assert error["message"] and error["request_id"].startswith("cmpl-"), error
    assert "Traceback" not in text and "Actor" not in error["message"], error


@pytest.mark.slow
def test_the_decode_node_dies_and_a_replacement_decode_on_the_other_node_serves(server, offline):
    """Streams in flight when the decode node dies end (an error event, or done where resumed
    on the replacement), none hangs; Serve starts a replacement Decode replica on the other
    node offering decode_box, and from then on every request is answered with the offline
    engine's text."""
    (killed,) = placement(server)["decode"]
    outcomes = [{} for _ in range(3)]
    threads = [
        threading.Thread(target=stream_completion, args=(server.http_url, i, outcome))
        for i, outcome in enumerate(outcomes)
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(o.get("chunks", 0) >= 3 for o in outcomes), 60, 0.1, "streams going")
    killed_at = time.monotonic()
    assert server.kill_node(killed)
    assert not any(o["end"] for o in outcomes), "a stream ended before the kill"
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads), "an in-flight stream hung"
    for outcome in outcomes:
        assert outcome["status"] == 200 and outcome["end"] in ("done", "error"), outcome
        if outcome["end"] == "error":
            assert outcome["error"]["message"] and outcome["error"]["request_id"], outcome
    print("in flight:", [(o["end"], round(o["ended_at"] - killed_at, 1)) for o in outcomes])

    (spare,) = set(DECODE_NODES) - {killed}
    wait_for(
        lambda: server.replica_nodes("Decode") == [spare],
        timeout_s=120,
        what=f"a replacement Decode replica running on node {spare}",
    )
    assert placement(server)["decode"] == [spare]  # and its worker
    print(f"replacement decode running {time.monotonic() - killed_at:.1f} s after the kill")
    # Up once it has answered (the ingress's router learns of it from the controller); from
    # then on no request fails.
    wait_for(lambda: complete_once(server.http_url)[0].status_code == 200, 60, 0.5, "a 200")
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(complete_once, [server.http_url] * 3))
    assert [reply.status_code for reply, _ in answers] == [200] * 3, [a.text for a, _ in answers]
    assert served_replies(server.http_url, stream=True) == offline


@pytest.mark.slow
def test_the_prefill_node_dies_holding_a_handoff_and_decode_recomputes_it(server):
    """The client prefills through the Prefill handle; this test then kills the whole prefill
    node, which holds the hand-off's KV in its prefill worker's arena, before decode has read it
    (the KV would have come through the object store had decode asked). Decode
    recomputes the prompt on its node and the text is the normal path's. With no other node
    offering prefill_box, new requests then get a 503 within ingress.max_replica_wait_s."""
    client = server.popen_python(LOST_KV_CLIENT, server.http_url, "--node-killed-by-caller")
    try:
        owners = json.loads(next(line for line in client.stdout if "owner_node_ids" in line))
        indexes = server.node_indexes()
        assert [indexes[node_id] for node_id in owners["owner_node_ids"]] == [PREFILL_NODE]
        assert server.kill_node(PREFILL_NODE)
        client.stdin.write("killed\n")
        client.stdin.flush()
        output, _ = client.communicate(timeout=240)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, output
    report = json.loads(output.strip().splitlines()[-1])
    assert report["was_recomputed"] and report["kv_in_arena"], report
    assert report["token_ids"] == report["reference_token_ids"]
    assert report["text"] == report["reference_text"]
    assert report["finish_reason"] == "length"
    # While the node's death was news, a call could still be routed to the dead replica (a
    # 500 after the retry) or wait out the bound (503): either way a clean body.
    during = report["http_while_prefill_worker_dead"]
    assert during, report["statuses_while_prefill_worker_dead"]
    assert_clean_error(during["status"], during["text"])
    # No alive node offers prefill_box: each new request waits ingress.max_replica_wait_s for
    # a Prefill replica that cannot start, then gets a 503.
    reply, _ = complete_once(server.http_url)
    assert reply.status_code == 503 and reply.headers["Retry-After"], reply.text
    assert_clean_error(reply.status_code, reply.text)
    assert json.loads(reply.text)["error"]["code"] == "replica_unavailable"
    assert server.get_json("/health") == {"status": "ok"}
