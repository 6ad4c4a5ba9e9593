"""Fixtures of the end-to-end serve tests. Starting a private cluster and its `serve run` costs
~45 s on 2 cores (`ray start` ~11 s, `serve start` ~8 s, the app ~25 s), stopping it ~5 s.

- `serve_app`: one private cluster (6 CPUs) whose app each module using it replaces with its own
  real `serve run` (`serve_app(app_args)`, see `serve_run_again`): test_colocated_serve.py first
  (on the fresh cluster: it reads the capacity gauge and the logs; its random-weights test
  then serves an app of its own), then test_new_families_serve.py (one app per family),
  test_overload.py (which floods its app), test_parallel_serve.py (whose workers need the 6
  CPUs; the apps' replica counts are fixed), and last the `disaggregated_server`'s users.
  Each module gets a fresh app, its replicas and workers new; only the Ray cluster and Serve's
  controller and proxy are shared.
- `disaggregated_server`: one real `serve run rayinfer.app:build disaggregate=true
  max_model_len=512` on that cluster, shared by the modules that only send it requests
  (test_bench_serve.py, test_openai_clients.py, test_structured_outputs.py; none reads the
  cluster's metrics or logs). No test using it kills a replica or a worker or changes its
  deployments.

At collection the tests using them are moved next to each other (each module's keep their
order, the disaggregated server's users after the others), and the cluster is stopped after the
last of them, so that it does not idle beside the clusters the other modules start.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest

from rayinfer.bench.serve_cluster import REPO_ROOT, ServeCluster

SHARED = "serve_app"  # disaggregated_server uses it too
DISAGGREGATED_APP_ARGS = ["disaggregate=true", "max_model_len=512"]
_running: list[ServeCluster] = []


def _uses(item, name: str = SHARED) -> bool:
    return name in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    users = [item for item in items if _uses(item)]
    if not users:
        return
    first = items.index(users[0])
    others = [item for item in items if not _uses(item)]
    # a stable sort: the disaggregated server's users last, so that no app replaces it
    users.sort(key=lambda item: _uses(item, "disaggregated_server"))
    items[:] = others[:first] + users + others[first:]


@pytest.fixture(scope="session")
def serve_app():
    """serve_app(app_args) -> the shared cluster, now serving `serve run rayinfer.app:build
    *app_args` (started with it on the first call, the app replaced on every later one)."""
    started: list[ServeCluster] = []

    def serve(app_args: list[str]) -> ServeCluster:
        if _running:
            serve_run_again(_running[0], app_args)
            return _running[0]
        cluster = ServeCluster(list(app_args), num_cpus=6)
        _running.append(cluster)
        started.append(cluster)
        cluster.start()
        return cluster

    yield serve
    for cluster in started:
        cluster.stop()


@pytest.fixture(scope="session")
def disaggregated_server(serve_app):
    return serve_app(DISAGGREGATED_APP_ARGS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _running and _uses(item) and (nextitem is None or not _uses(nextitem)):
        # Its last user is done; the session's teardown stops it again, a no-op.
        _running.pop().stop()


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
