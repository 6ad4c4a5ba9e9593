"""Run against a ServeCluster (tests/serve/test_server.py): one worker
of a Prefill, Decode or Engine replica dies under load, with two replicas of that phase up.

`python -m rayinfer.bench.worker_death_client URL PHASE`: answers a few prompts on a quiet server
(the reference), then keeps CLIENTS greedy completions going (half streamed) over HTTP; once two
replicas of PHASE run, it kills one worker of the one that has served longest (prefill: SIGKILL
of the worker's process; decode and engine: `ray.kill`) and keeps sending until Serve has
started a replacement replica. Prints JSON: every request's prompt, status, text, begin and
end, the kill's time, and how long the killed worker's replica took to die and Serve to
replace it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import httpx
import ray
from ray import serve
from ray.util.state import list_actors

PROMPTS = ["The quick brown fox", "Once upon a time there was", "Rivers run to the sea and"]
MAX_TOKENS = 48
CLIENTS = 6
AFTER_REPLACED_S = 2.0  # of load after Serve started the replacement
AFTER_KILL_ANSWERS = 2  # at least this many requests sent after the kill answer before it stops
READY_TIMEOUT_S = 120.0


def body(index: int, stream: bool) -> dict:
    prompt = PROMPTS[index % len(PROMPTS)]
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


async def complete(client: httpx.AsyncClient, index: int, stream: bool) -> dict:
    """One request's outcome: its prompt, status, text and when it began and ended."""
    began = time.monotonic()
    try:
        status, text = await (_streamed if stream else _whole)(client, body(index, stream))
    except httpx.HTTPError as error:  # no answer at all
        status, text = type(error).__name__, ""
    return {"prompt": index % len(PROMPTS), "stream": stream, "status": status, "text": text,
            "began": began, "ended": time.monotonic()}  # fmt: skip


async def _whole(client: httpx.AsyncClient, request: dict) -> tuple[int, str]:
    reply = await client.post("/v1/completions", json=request)
    return reply.status_code, reply.json()["choices"][0]["text"] if reply.is_success else reply.text


async def _streamed(client: httpx.AsyncClient, request: dict) -> tuple[int | str, str]:
    """A stream's status, or its error event's message (a failure after the 200)."""
    text = ""
    async with client.stream("POST", "/v1/completions", json=request) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                return f"error event: {event['error'].get('message')}", text
            text += "".join(choice["text"] for choice in event["choices"])
        return reply.status_code, text


def replica_of(worker_name: str, phase: str) -> str:
    """The Serve replica id (`Decode#<unique id>`) of a worker named
    rayinfer-<phase>-<unique id>-r<rank>."""
    unique_id = worker_name.rsplit("-r", 1)[0].removeprefix(f"rayinfer-{phase}-")
    return f"{phase.capitalize()}#{unique_id}"


def phase_workers(phase: str) -> dict[str, list]:
    """The phase's live worker actors by replica id."""
    by_replica = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        if actor.name and actor.name.startswith(f"rayinfer-{phase}-"):
            by_replica.setdefault(replica_of(actor.name, phase), []).append(actor)
    return by_replica


def running_replicas(deployment: str) -> int:
    status = serve.status().applications["default"].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def replica_actors(deployment: str) -> dict[str, str]:
    """Replica id -> actor state of every replica actor Serve made for the deployment."""
    prefix = f"SERVE_REPLICA::default#{deployment}#"
    actors = list_actors(filters=[("class_name", "=", f"ServeReplica:default:{deployment}")])
    return {a.name.removeprefix("SERVE_REPLICA::default#"): a.state for a in actors
            if a.name.startswith(prefix)}  # fmt: skip


def wait_for_death(actor, timeout_s: float) -> float:
    """When (time.monotonic) the actor stopped answering: probed every 0.1 s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=2)
        except ray.exceptions.RayActorError:
            return time.monotonic()
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.1)
    raise TimeoutError(f"the replica still answers {timeout_s}s after its worker died")


async def keep_sending(url: str, stop: asyncio.Event, done: list[dict], client_index: int):
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        index = client_index
        while not stop.is_set():
            done.append(await complete(client, index, stream=index % 2 == 0))
            index += CLIENTS


async def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{what} not reached within {timeout_s}s")


def killer(worker, phase: str):
    """A call that kills the worker, its handle looked up before the clock starts."""
    if phase == "prefill":
        return lambda: os.kill(worker.pid, signal.SIGKILL)  # the raylet finds the process gone
    handle = ray.get_actor(worker.name, namespace="serve")
    return lambda: ray.kill(handle, no_restart=True)


async def main(url: str, phase: str) -> dict:
    deployment = phase.capitalize()
    oldest = set(phase_workers(phase))  # the replicas that have served longest
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        references = [await complete(client, i, stream=False) for i in range(len(PROMPTS))]
    stop, done = asyncio.Event(), []
    clients = [asyncio.create_task(keep_sending(url, stop, done, i)) for i in range(CLIENTS)]
    await wait_until(lambda: running_replicas(deployment) == 2, READY_TIMEOUT_S, "2 replicas")
    await asyncio.sleep(1.0)  # every client has a request in flight
    replicas = phase_workers(phase)
    replica_id = next(r for r in replicas if r in oldest)
    victim = replicas[replica_id][0]
    replica = ray.get_actor(f"SERVE_REPLICA::default#{replica_id}", namespace="serve")
    kill = killer(victim, phase)
    killed_at, killed_at_unix = time.monotonic(), time.time()  # the latter for the server logs
    kill()
    replica_dead_s = await asyncio.to_thread(wait_for_death, replica, 30) - killed_at

    def replacement_started() -> bool:
        states = replica_actors(deployment)
        return states.get(replica_id) == "DEAD" and any(
            r not in replicas and state != "DEAD" for r, state in states.items()
        )

    await wait_until(replacement_started, 60, "a replacement replica")  # the load goes on
    replacement_s = time.monotonic() - killed_at
    await asyncio.sleep(AFTER_REPLACED_S)

    # on a loaded machine the requests in flight at the kill can outlast that: the load goes on
    # until some sent after the kill have answered too
    def answered_after_kill() -> bool:
        return sum(r["began"] > killed_at for r in done) >= AFTER_KILL_ANSWERS

    await wait_until(answered_after_kill, READY_TIMEOUT_S, "answers sent after the kill")
    stop.set()
    await asyncio.gather(*clients)
    return {
        "victim": victim.name,
        "replica_dead_s": replica_dead_s,
        "replacement_started_s": replacement_s,
        "references": [reference["text"] for reference in references],
        "killed_at": killed_at,
        "killed_at_unix": killed_at_unix,
        "requests": done,
    }


if __name__ == "__main__":
    ray.init(address="auto", log_to_driver=False)
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
