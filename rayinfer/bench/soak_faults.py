"""The parts of a running rayinfer Serve app that the soak kills, and when Serve has replaced them.

A fault is `<phase>-worker` (one worker actor of a Prefill, Decode or Engine replica) or
`<phase>-replica` (a Prefill, Decode, Engine or Ingress replica actor); each is killed with
SIGKILL of its process, as a crash or the kernel's OOM killer would. The kill is by process id,
so the soak runs on the node that hosts the victim (one machine, as on the CPU).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ray import serve
from ray.util.state import list_actors

PHASES = ("prefill", "decode", "engine", "ingress")
FAULTS = tuple(
    f"{phase}-{part}"
    for phase in PHASES
    for part in ("worker", "replica")
    if (phase, part) != ("ingress", "worker")  # the ingress has no workers
)


@dataclass(frozen=True)
class Victim:
    fault: str
    actor_name: str
    pid: int
    deployment: str
    replica_id: str  # the Serve replica that goes: the victim's own or the worker's


def parse_faults(text: str) -> list[str]:
    """`decode-worker,ingress-replica` -> the list; an unknown name names the valid ones."""
    faults = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in faults if name not in FAULTS]
    if unknown:
        raise ValueError(f"--faults: unknown {unknown}; valid: {', '.join(FAULTS)}")
    return faults


def deployment_of(fault: str) -> str:
    return fault.split("-", 1)[0].capitalize()


def replica_actors(app: str, deployment: str) -> dict[str, object]:
    """Replica id (`Decode#abc`) -> its live actor's state record."""
    prefix = f"SERVE_REPLICA::{app}#"
    found = list_actors(
        filters=[("class_name", "=", f"ServeReplica:{app}:{deployment}"), ("state", "=", "ALIVE")],
        limit=1000,
    )
    return {actor.name.removeprefix(prefix): actor for actor in found if actor.name}


def worker_actors(phase: str) -> dict[str, list]:
    """Replica id -> its live worker actors (named rayinfer-<phase>-<replica unique id>-r<rank>)."""
    by_replica: dict[str, list] = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        if actor.name and actor.name.startswith(f"rayinfer-{phase}-"):
            unique_id = actor.name.rsplit("-r", 1)[0].removeprefix(f"rayinfer-{phase}-")
            by_replica.setdefault(f"{phase.capitalize()}#{unique_id}", []).append(actor)
    return by_replica


def choose_victim(app: str, fault: str) -> Victim:
    """The fault's victim in the replica listed first (each has requests under the soak's load)."""
    deployment = deployment_of(fault)
    replicas = replica_actors(app, deployment)
    if not replicas:
        raise RuntimeError(f"{fault}: no running {deployment} replica in app {app!r}")
    if fault.endswith("-replica"):
        replica_id, actor = sorted(replicas.items())[0]
        return Victim(fault, actor.name, actor.pid, deployment, replica_id)
    workers = {r: ws for r, ws in worker_actors(fault.split("-", 1)[0]).items() if r in replicas}
    if not workers:
        raise RuntimeError(f"{fault}: the {deployment} replicas have no worker actors")
    replica_id, actors = sorted(workers.items())[0]
    actor = sorted(actors, key=lambda a: a.name)[0]
    return Victim(fault, actor.name, actor.pid, deployment, replica_id)


def kill(victim: Victim) -> None:
    os.kill(victim.pid, signal.SIGKILL)


def running_replicas(app: str) -> dict[str, int]:
    """Deployment -> replicas in state RUNNING."""
    deployments = serve.status().applications[app].deployments
    return {name: status.replica_states.get("RUNNING", 0) for name, status in deployments.items()}


def replaced(app: str, victim: Victim, before: dict[str, int], replicas_before: set[str]) -> bool:
    """Whether the victim's replica is gone and Serve runs as many replicas as before, one new."""
    alive = replica_actors(app, victim.deployment)
    if victim.replica_id in alive or not set(alive) - replicas_before:
        return False
    return running_replicas(app) == before
