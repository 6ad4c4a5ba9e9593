"""Fixtures of the end-to-end serve tests. Starting a private cluster and its `serve run` costs
~45 s on 2 cores (`ray start` ~11 s, `serve start` ~8 s, the app ~25 s), stopping it ~5 s.

- `disaggregated_server`: one real `serve run rayinfer.app:build disaggregate=true
  max_model_len=512`, shared by the modules that only send it requests (test_bench_serve.py,
  test_openai_clients.py, test_structured_outputs.py). No test using it kills a replica or a
  worker or changes its deployments.
- `serve_app`: one private cluster (6 CPUs) whose app each module using it replaces with its own
  real `serve run` (`serve_app(app_args)`, see `serve_run_again`): test_colocated_serve.py first
  (on the fresh cluster: it reads the capacity gauge and the logs; its random-weights test
  then serves an app of its own), then
  test_new_families_serve.py (one app per family), test_overload.py (which floods its app) and
  test_parallel_serve.py (whose workers need the 6 CPUs; the apps' replica counts are fixed).
  Each module gets a fresh app, its replicas and workers new; only the Ray cluster and Serve's
  controller and proxy are shared.

At collection the tests using each of them are moved next to each other (each module's keep
their order), and the cluster is stopped after the last of them, so that it does not idle beside
the clusters the other modules start.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest

from rayinfer.bench.serve_cluster import REPO_ROOT, ServeCluster

SHARED = ("disaggregated_server", "serve_app")
DISAGGREGATED_APP_ARGS = ["disaggregate=true", "max_model_len=512"]
_running: dict[str, list[ServeCluster]] = {name: [] for name in SHARED}


def _uses(item, name: str) -> bool:
    return name in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    for name in SHARED:
        users = [item for item in items if _uses(item, name)]
        if not users:
            continue
        first = items.index(users[0])
        others = [item for item in items if not _uses(item, name)]
        items[:] = others[:first] + users + others[first:]


@pytest.fixture(scope="session")
def disaggregated_server():
    with ServeCluster(DISAGGREGATED_APP_ARGS) as cluster:
        _running["disaggregated_server"].append(cluster)
        yield cluster


@pytest.fixture(scope="session")
def serve_app():
    """serve_app(app_args) -> the shared cluster, now serving `serve run rayinfer.app:build
    *app_args` (started with it on the first call, the app replaced on every later one)."""
    clusters = _running["serve_app"]
    started: list[ServeCluster] = []

    def serve(app_args: list[str]) -> ServeCluster:
        if clusters:
            serve_run_again(clusters[0], app_args)
            return clusters[0]
        cluster = ServeCluster(list(app_args), num_cpus=6)
        clusters.append(cluster)
        started.append(cluster)
        cluster.start()
        return cluster

    yield serve
    for cluster in started:
        cluster.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    for name, clusters in _running.items():
        if clusters and _uses(item, name) and (nextitem is None or not _uses(nextitem, name)):
            # Its last user is done; the session's teardown stops it again, a no-op.
            clusters.pop().stop()


def serve_run_again(cluster: ServeCluster, app_args: list[str], timeout_s: float = 240) -> None:
    """Replace the app of a started `ServeCluster` with a new real `serve run rayinfer.app:build
    *app_args` on the same Ray cluster and Serve instance (same HTTP port), as a user redeploys:
    the old `serve run` is ended (SIGTERM: no `serve shutdown`), the new one updates the app and
    is waited for until its "is ready at" line (the app RUNNING at the new version). Saves a
    fresh cluster's `ray start`, `serve start` and stop (~25 s on 2 cores)."""
    cluster.serve_process.terminate()
    cluster.serve_process.wait(timeout=20)
    cluster.log_path.rename(cluster.temp_dir / f"serve_run-{uuid.uuid4().hex[:8]}.log")
    cluster.app_args = list(app_args)
    command = ["serve", "run", "rayinfer.app:build", *cluster.app_args]
    with open(cluster.log_path, "wb") as log:
        cluster.serve_process = subprocess.Popen(
            command, env=cluster.env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
    cluster.wait_until_ready(timeout_s)
