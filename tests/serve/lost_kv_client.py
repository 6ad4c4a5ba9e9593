"""Run inside the test cluster: lose a hand-off's KV, decode must recompute.

Prefills a prompt through the Prefill deployment, loses the worker actors that hold the KV (in
their arenas, by default, or the object store) before anyone read it, then decodes the hand-off.
Prints JSON: the decoded text, whether decode reported a recompute, and the greedy text of the
same prompt through the normal path. With the server's URL as argument, also what an HTTP
request answered while the Prefill replica's worker was dead (a 5xx: its error body must show
no internals).

How the owners are lost: by default this kills the actors (test_server.py, one node). With
`--node-killed-by-caller` (test_multi_node.py) it prints `{"owner_node_ids": [...]}` (the
Ray nodes the owners run on) and waits for a line on stdin: the caller kills that whole node
meanwhile, as a machine's death would.
"""

from __future__ import annotations

import json
import sys
import time

import ray
from ray import serve

from rayinfer.deployments.types import DecodeRequest, GenerateRequest, PrefillRequest
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.workers.runner.kv_arena_maps import ArenaMaps

PROMPT_IDS = [5, 17, 42, 99, 7, 123, 64, 8, 250, 31]
MAX_TOKENS = 12


def kill_and_wait(actor, timeout_s: float = 30) -> None:
    """Kill an actor and return once it is dead (its owned objects are then lost)."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.describe.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.2)
    raise TimeoutError(f"actor still alive {timeout_s}s after ray.kill")


def wait_until_lost(shard, timeout_s: float = 30) -> None:
    """Ray notices an owner's death within about a second; until then the chunks still read.
    A KV in a worker's arena reads as lost once its process is gone (its lock on the arena with
    it), or, from another node, once its owner no longer answers. An export the killed worker
    had not finished reads as its death."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not is_readable(ray.get(shard, timeout=5)):
                return
        except (ray.exceptions.ObjectLostError, ray.exceptions.RayActorError):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the KV was still readable {timeout_s}s after its owner died")


def is_readable(payload) -> bool:
    """Whether an importer here could still read the payload's KV (raises what Ray raises for
    an object or an owner that is gone)."""
    span = payload.arena
    if span is None:
        ray.get(payload.chunks, timeout=5)
        return True
    if span.node_id != ray.get_runtime_context().get_node_id():
        return ray.get(span.owner.kv_from_arena.remote(payload), timeout=5) is not None
    maps = ArenaMaps(pin=False)
    try:
        return maps.view(span) is not None
    finally:
        maps.close()


def first_server_error(url: str, timeout_s: float = 10) -> tuple[dict | None, list[int]]:
    """The first 5xx an HTTP completion gets while the replica is not yet replaced (Serve
    replaces it after a few failed health checks; from then on requests succeed again), and
    the statuses seen until then (all 200 when every request's retry found a new replica)."""
    import httpx

    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    statuses = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        statuses.append(reply.status_code)
        if reply.status_code >= 500:
            return {"status": reply.status_code, "text": reply.text}, statuses
    return None, statuses


def owner_node_ids(owners: list[str]) -> list[str]:
    """The nodes the owner actors run on."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return sorted({actor.node_id for actor in actors if actor.name in owners})


def lose_owners(owners: list[str], node_killed_by_caller: bool) -> None:
    if not node_killed_by_caller:
        for owner in owners:
            kill_and_wait(ray.get_actor(owner, namespace="serve"))
        return
    print(json.dumps({"owner_node_ids": owner_node_ids(owners)}), flush=True)
    sys.stdin.readline()


def main() -> None:
    node_killed_by_caller = "--node-killed-by-caller" in sys.argv
    urls = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    ray.init(address="auto", log_to_driver=False)
    ingress = serve.get_app_handle("default")
    reference = ingress.generate.remote(
        GenerateRequest(prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ).result()

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prefill = serve.get_deployment_handle("Prefill", app_name="default")
    result = prefill.prefill.remote(PrefillRequest("lost-kv-0", PROMPT_IDS, params)).result()
    owners = result.handoff.payload.owners
    kv_in_arena = ray.get(result.handoff.payload.shards[0]).arena is not None
    lose_owners(owners, node_killed_by_caller)
    during_death, statuses = first_server_error(urls[0]) if urls else (None, [])
    wait_until_lost(result.handoff.payload.shards[0])

    decode = serve.get_deployment_handle("Decode", app_name="default").options(stream=True)
    text, token_ids, chunks = result.first_text, [result.first_token_id], []
    for chunk in decode.generate.remote(DecodeRequest(result, params)):
        chunks.append(chunk)
        text += chunk.new_text
        token_ids += chunk.new_token_ids
    report = {
        "owners": owners,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": chunks[-1].finish_reason,
        "was_recomputed": chunks[0].was_recomputed,
        "kv_in_arena": kv_in_arena,
        "reference_text": reference.text,
        "reference_token_ids": reference.token_ids,
        "http_while_prefill_worker_dead": during_death,
        "statuses_while_prefill_worker_dead": statuses,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
