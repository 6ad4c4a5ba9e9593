"""`python -m rayinfer.bench soak`: a bounded load against a running rayinfer server while its parts
are killed one by one, and per fault what it cost: requests lost, errored, hung or changed, how
long until service was normal again, and the cluster's memory before and after.

Run it on the machine that hosts the server (faults are SIGKILLs by process id), with the Ray
cluster reachable (`RAY_ADDRESS`, or the local one). Its course:
1. each prompt's greedy text on the quiet server (the reference every later reply must equal);
2. a warm-up load, then a quiet period, then the memory baseline (RSS of the cluster's processes
   by kind, object-store bytes);
3. the steady load (`--clients` loops; three of four requests streamed) for `--steady-s`,
   sampling RSS (its growth per kind, MiB/min, is reported);
4. per fault, under the same load: SIGKILL of the victim, wait until Serve runs a replacement,
   `--settle-s` more, and until `--clients` requests sent after the replacement have answered;
5. the load stops, a quiet period, the memory again.
`benchmarks/soak.sh` starts a private cluster with two replicas of every phase and runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.request

from rayinfer.bench import soak_faults, soak_memory, soak_report
from rayinfer.bench.polling import wait_for
from rayinfer.bench.soak_load import Load, references

DISAGGREGATED_FAULTS = (
    "decode-worker", "prefill-worker", "decode-replica", "prefill-replica", "ingress-replica",
)  # fmt: skip
COLOCATED_FAULTS = ("engine-worker", "engine-replica", "ingress-replica")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench soak", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--app", default="default", help="the Serve application's name")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--faults", type=soak_faults.parse_faults, default=None,
                        help="comma-separated, in order ('' for none: the steady load only); "
                        "default: every part of the app "
                        f"({', '.join(DISAGGREGATED_FAULTS)}; or with an Engine deployment: "
                        f"{', '.join(COLOCATED_FAULTS)})")  # fmt: skip
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a client's wait")
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--steady-s", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    parser.add_argument("--quiet-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--replace-timeout-s", type=float, default=120.0)
    parser.add_argument("--json", default=None, help="write the report (and every outcome) here")
    return parser.parse_args(argv)


def first_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def default_faults(app: str) -> tuple[str, ...]:
    deployments = soak_faults.running_replicas(app)
    return COLOCATED_FAULTS if "Engine" in deployments else DISAGGREGATED_FAULTS


def memory_snapshot(session_dir: str) -> dict:
    used, objects = soak_memory.object_store_bytes()
    rss = soak_memory.rss_by_kind(session_dir, exclude_pids={os.getpid()})
    return {"rss": rss, "object_store_bytes": used, "objects": objects}


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """When (time.monotonic) predicate() first held, polled every 0.25 s."""
    wait_for(predicate, timeout_s, interval_s=0.25, what=what)
    return time.monotonic()


async def inflict(args: argparse.Namespace, fault: str, load: Load) -> dict:
    """Kill the fault's victim under the load; returns when service is back (or gives up)."""
    deployment = soak_faults.deployment_of(fault)
    counts = await asyncio.to_thread(soak_faults.running_replicas, args.app)
    before = set(await asyncio.to_thread(soak_faults.replica_actors, args.app, deployment))
    victim = await asyncio.to_thread(soak_faults.choose_victim, args.app, fault)
    killed_at = time.monotonic()
    soak_faults.kill(victim)
    record = {"fault": fault, "victim": victim.actor_name, "killed_at": killed_at}
    is_back = lambda: soak_faults.replaced(args.app, victim, counts, before)
    what = f"a running replacement for {victim.replica_id}"
    timeout_s = args.replace_timeout_s
    record["replaced_at"] = await asyncio.to_thread(wait_until, is_back, timeout_s, what)
    await asyncio.sleep(args.settle_s)
    enough = lambda: load.ended_ok_since(record["replaced_at"]) >= args.clients
    await asyncio.to_thread(wait_until, enough, timeout_s, "answers after the replacement")
    print(f"{fault}: killed {victim.actor_name} (pid {victim.pid}); replaced in "
          f"{record['replaced_at'] - killed_at:.1f}s", flush=True)  # fmt: skip
    return record


async def soak(args: argparse.Namespace) -> dict:
    import ray

    ray.init(address="auto", log_to_driver=False)  # RAY_ADDRESS where set, else the local one
    session_dir = soak_memory.session_dir()
    model = args.model or first_model(args.url)
    faults = args.faults
    if faults is None:
        faults = list(await asyncio.to_thread(default_faults, args.app))
    refs = await references(args.url, model, args.max_tokens, args.timeout_s)
    make_load = lambda: Load(args.url, model, args.clients, args.max_tokens, args.timeout_s)

    warmup = make_load()
    warmup.start()
    await asyncio.sleep(args.warmup_s)
    await warmup.stop()
    await asyncio.sleep(args.quiet_s)
    before = await asyncio.to_thread(memory_snapshot, session_dir)

    load = make_load()
    load.start()
    began = time.monotonic()
    samples = []
    while time.monotonic() < began + args.steady_s:
        rss = await asyncio.to_thread(soak_memory.rss_by_kind, session_dir, {os.getpid()})
        samples.append((time.monotonic() - began, rss))
        await asyncio.sleep(args.sample_s)
    steady_end = time.monotonic()
    records = []
    for fault in faults:
        records.append(await inflict(args, fault, load))
    await load.stop()
    await asyncio.sleep(args.quiet_s)
    after = await asyncio.to_thread(memory_snapshot, session_dir)

    first_kill = records[0]["killed_at"] if records else float("inf")
    steady = soak_report.steady_summary(load.outcomes, refs, steady_end, first_kill)
    p95_s = steady["latency_p95_s"] or args.timeout_s
    ends = [r["killed_at"] for r in records[1:]] + [float("inf")]
    return {
        "model": model,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "steady": {**steady, "seconds": round(steady_end - began, 1),
                   "rss_growth_mib_per_min": soak_memory.growth_mib_per_min(samples)},
        "faults": [soak_report.fault_summary(r, load.outcomes, refs, end, p95_s)
                   for r, end in zip(records, ends)],
        "memory": soak_report.memory_summary(before, after),
        "outcomes": [o.to_json() for o in load.outcomes],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    print(soak_report.table(report["faults"]))
    print(json.dumps({key: report[key] for key in ("steady", "memory")}))
    return 0
