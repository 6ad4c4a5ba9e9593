"""The soak against a private server: a Ray cluster and `serve run rayinfer.app:build` with two
replicas of every phase (rayinfer/bench/serve_cluster.py), the tiny model, and
`python -m rayinfer.bench soak` run against it (rayinfer/bench/soak.py: each part killed in turn
under 16 clients, per fault what it cost, the memory before and after).

    python benchmarks/soak.py --json soak.json                    # Prefill + Decode
    python benchmarks/soak.py --colocated --json soak.json        # Engine (disaggregate=false)
    python benchmarks/soak.py --steady-s 600 --faults ''          # memory growth alone
    python benchmarks/soak.py ingress.num_replicas=2 --faults ingress-replica

A `key=value` argument goes to the app (`serve run rayinfer.app:build key=value`); every other
argument after `--colocated` goes to `rayinfer.bench soak` unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.bench.serve_cluster import ServeCluster  # noqa: E402


def app_args(colocated: bool) -> list[str]:
    phases = ["engine"] if colocated else ["prefill", "decode"]
    args = ["max_model_len=256", f"disaggregate={str(not colocated).lower()}"]
    for phase in phases:
        args += [f"{phase}.autoscaling.min_replicas=2", f"{phase}.autoscaling.max_replicas=2"]
    return args


def is_app_arg(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


def main() -> None:
    argv = sys.argv[1:]
    colocated = "--colocated" in argv
    extra_app_args = [arg for arg in argv if is_app_arg(arg)]
    soak_args = [arg for arg in argv if arg != "--colocated" and not is_app_arg(arg)]
    with ServeCluster(app_args(colocated) + extra_app_args) as server:
        command = ["-m", "rayinfer.bench", "soak", "--url", server.http_url, *soak_args]
        print(server.run_python(*command, timeout_s=7200), end="")


if __name__ == "__main__":
    main()
