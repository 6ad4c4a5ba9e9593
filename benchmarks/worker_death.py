"""What a worker's death costs a loaded server: requests lost, failed or changed, and how soon its
replica leaves and Serve replaces it (issue 23 item 1), on the CPU with the tiny model.

Starts a private cluster and `serve run` with two replicas of every phase
(rayinfer/bench/serve_cluster.py), then per phase runs rayinfer/bench/worker_death_client.py: six
clients keep greedy completions going (half streamed) while one worker of a replica dies (prefill:
SIGKILL of its process; decode and the colocated engine: `ray.kill`). Prints one JSON line per
phase.

    python benchmarks/worker_death.py                 # Prefill and Decode (disaggregated)
    python benchmarks/worker_death.py --colocated     # Engine (disaggregate=false)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.bench.serve_cluster import ServeCluster  # noqa: E402

CLIENT = ("-m", "rayinfer.bench.worker_death_client")


def app_args(colocated: bool) -> tuple[list[str], list[str]]:
    """The server's arguments and the phases whose workers are killed."""
    phases = ["engine"] if colocated else ["prefill", "decode"]
    args = ["max_model_len=256", f"disaggregate={str(not colocated).lower()}"]
    for phase in phases:
        args += [f"{phase}.autoscaling.min_replicas=2", f"{phase}.autoscaling.max_replicas=2"]
    return args, phases


def summary(phase: str, report: dict) -> dict:
    killed_at, requests = report["killed_at"], report["requests"]
    in_flight = [r for r in requests if r["began"] < killed_at < r["ended"]]
    others = [r for r in requests if r not in in_flight]
    wrong = [r for r in requests if r["text"] != report["references"][r["prompt"]]]

    def seconds(rs: list[dict], of) -> float | None:
        return round(of([r["ended"] - r["began"] for r in rs]), 2) if rs else None

    return {
        "phase": phase,
        "requests": len(requests),
        "in_flight_at_kill": len(in_flight),
        "sent_after_kill": sum(r["began"] > killed_at for r in requests),
        "failed": sum(r["status"] != 200 for r in requests),
        "text_differs": len(wrong),
        "replica_gone_s": round(report["replica_dead_s"], 3),
        "replacement_started_s": round(report["replacement_started_s"], 2),
        "in_flight_latency_max_s": seconds(in_flight, max),
        "other_latency_median_s": seconds(others, statistics.median),
        "other_latency_max_s": seconds(others, max),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--colocated", action="store_true", help="one Engine deployment")
    args, phases = app_args(parser.parse_args().colocated)
    with ServeCluster(args) as server:
        for phase in phases:
            output = server.run_python(*CLIENT, server.http_url, phase, timeout_s=300)
            report = json.loads(output.strip().splitlines()[-1])
            print(json.dumps(summary(phase, report)), flush=True)


if __name__ == "__main__":
    main()
