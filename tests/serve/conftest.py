"""Fixtures of the end-to-end serve tests.

`disaggregated_server`: one real `serve run rayinfer.app:build disaggregate=true
max_model_len=512` on a private cluster, shared by the modules that only send it requests
(test_bench_serve.py, test_openai_clients.py, test_structured_outputs.py): starting one costs
~45 s on 2 cores, stopping it ~5 s. No test using it kills a replica or a worker or changes its
deployments. At collection the tests using it are moved next to each other (each module's keep
their order), and the server is stopped after the last of them, so that it does not idle beside
the clusters the other modules start.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest

from rayinfer.bench.serve_cluster import REPO_ROOT, ServeCluster

SHARED = "disaggregated_server"
DISAGGREGATED_APP_ARGS = ["disaggregate=true", "max_model_len=512"]
_running: list[ServeCluster] = []


def _uses_shared(item) -> bool:
    return SHARED in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    users = [item for item in items if _uses_shared(item)]
    if not users:
        return
    first = items.index(users[0])
    others = [item for item in items if not _uses_shared(item)]
    items[:] = others[:first] + users + others[first:]


@pytest.fixture(scope="session")
def disaggregated_server():
    with ServeCluster(DISAGGREGATED_APP_ARGS) as cluster:
        _running.append(cluster)
        yield cluster


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _running and _uses_shared(item) and (nextitem is None or not _uses_shared(nextitem)):
        # Its last user is done; the session's teardown stops it again, a no-op.
        _running.pop().stop()


def serve_run_again(cluster: ServeCluster, app_args: list[str], timeout_s: float = 240) -> None:
    """Replace the app of a started `ServeCluster` with a new real `serve run rayinfer.app:build
    *app_args` on the same Ray cluster and Serve instance (same HTTP port), as a user redeploys:
    the old `serve run` is ended (SIGTERM: no `serve shutdown`), the new one updates the app and
    is waited for until its "is ready at" line (the app RUNNING at the new version). Saves a fresh cluster's `ray start`, `serve start` and
    stop (~25 s on 2 cores)."""
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
