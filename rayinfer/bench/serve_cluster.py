"""A private Ray cluster plus a real `serve run rayinfer.app:build` subprocess, for the end-to-end
tests (tests/serve) and the benchmarks that load a server (benchmarks/soak.py); or, given a
Serve config (`serve_config`), the app deployed onto the running cluster with `serve deploy`
through the dashboard, as a user deploys onto a cluster of several machines.

The cluster is started with `ray start --head` in its own short temp dir, with every port found
free at run time, so it cannot collide with the pytest process's own cluster (`ray_cluster` in
tests/conftest.py): that one is found through RAY_ADDRESS or /tmp/ray, and neither points here.
Only the subprocesses get RAY_ADDRESS. Every wait is bounded; `stop` always tears everything down.
More nodes (`nodes`: `ray start --address=...` each with its own resources, temp dir and ports)
make a multi-node cluster on this one machine; `kill_node` kills one node's processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rayinfer import envs
from rayinfer.bench.cluster_processes import (
    cluster_process_ids,
    node_process_ids,
    raylet_node_id,
    stop_processes,
)

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding the rayinfer package
PORT_NAMES = (
    "port",
    "node-manager-port",
    "object-manager-port",
    "ray-client-server-port",
    "dashboard-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
)


NODE_PORT_NAMES = (
    "node-manager-port",
    "object-manager-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
)


@dataclass(frozen=True)
class NodeSpec:
    """A node joining the head: its CPUs and custom resources."""

    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)


def free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (all held open until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class ServeCluster:
    app_args: list[str] = field(default_factory=list)  # `serve run rayinfer.app:build` args
    # A Serve config (a YAML file's mapping) to `serve deploy` instead of `serve run`; its HTTP
    # port is replaced by a free one.
    serve_config: dict | None = None
    failing_apps: tuple[str, ...] = ()  # of serve_config, meant to fail their deploy: awaited
    num_cpus: int = 4
    head_resources: dict[str, float] = field(default_factory=dict)
    nodes: list[NodeSpec] = field(default_factory=list)  # joining the head, in order
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. RAY_* system settings
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp")))
    ports: dict[str, int] = field(default_factory=dict)
    head_node_id: str = ""
    node_ids: list[str] = field(default_factory=list)  # Ray's id of each joined node, in order
    serve_process: subprocess.Popen | None = None
    # Its own auth token: Ray turns token auth on for `ray start` when ~/.ray/auth_token exists
    # (any earlier `ray.init()` writes one), and then clients must send that token too.
    auth_token: str = field(default_factory=lambda: uuid.uuid4().hex + uuid.uuid4().hex)

    @property
    def ray_address(self) -> str:
        return f"127.0.0.1:{self.ports['port']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics-export-port']}/metrics"

    @property
    def log_path(self) -> Path:
        return self.temp_dir / "serve_run.log"

    def env(self) -> dict[str, str]:
        env = envs.subprocess_env()  # this process's environment, for the cluster's children
        python_path = [str(REPO_ROOT), env.get("PYTHONPATH", "")]
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in python_path if p),
            RAY_ADDRESS=self.ray_address,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.auth_token,
            RAY_metrics_report_interval_ms="1000",
            RAY_USAGE_STATS_ENABLED="0",
            OMP_NUM_THREADS="1",
        )
        env.update(self.extra_env)
        return env

    def node_temp_dir(self, index: int) -> Path:
        return self.temp_dir / f"n{index}"

    def start(self, timeout_s: float = 240) -> None:
        inherited = envs.subprocess_env()
        assert "RAY_ADDRESS" not in inherited, "unset RAY_ADDRESS: the tests start their own"
        self.ports = dict(zip((*PORT_NAMES, "http"), free_ports(len(PORT_NAMES) + 1)))
        port_flags = [f"--{name}={self.ports[name]}" for name in PORT_NAMES]
        self._run(
            [
                "ray",
                "start",
                "--head",
                f"--temp-dir={self.temp_dir}",
                f"--num-cpus={self.num_cpus}",
                "--num-gpus=0",
                "--include-dashboard=true",
                "--disable-usage-stats",
                f"--resources={json.dumps(self.head_resources)}",
                *port_flags,
            ],
            timeout_s=120,
        )
        if self.nodes:
            self.head_node_id = raylet_node_id(self.temp_dir)
            self._start_nodes()
        if self.serve_config is not None:
            self.deploy(self.serve_config)
            self.wait_until_deployed(self.serve_config, timeout_s)
            return
        serve_start = ["serve", "start", f"--http-port={self.ports['http']}"]
        if self.nodes:  # one machine: every node's proxy would want the same port
            serve_start.append("--proxy-location=HeadOnly")
        self._run(serve_start, timeout_s=60)
        command = ["serve", "run", "rayinfer.app:build", *self.app_args]
        with open(self.log_path, "wb") as log:
            self.serve_process = subprocess.Popen(
                command, env=self.env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
            )
        self.wait_until_ready(timeout_s)

    def _start_nodes(self) -> None:
        """`ray start --address=...` every joined node, one after another (on two busy cores
        the GCS missed a raylet's registration deadline when three joined at once), on ports
        all chosen beforehand so that none is taken twice."""
        num_ports = len(NODE_PORT_NAMES)
        ports = free_ports(num_ports * len(self.nodes))
        node_ports = [ports[i * num_ports : (i + 1) * num_ports] for i in range(len(self.nodes))]
        for index, (node, port_numbers) in enumerate(zip(self.nodes, node_ports)):
            self._start_node(index, node, port_numbers)
        self.node_ids = [raylet_node_id(self.node_temp_dir(i)) for i in range(len(self.nodes))]

    def _start_node(self, index: int, node: NodeSpec, port_numbers: list[int]) -> None:
        temp_dir = self.node_temp_dir(index)
        temp_dir.mkdir()
        ports = dict(zip(NODE_PORT_NAMES, port_numbers))
        command = [
            "ray",
            "start",
            f"--address={self.ray_address}",
            f"--temp-dir={temp_dir}",
            f"--num-cpus={node.num_cpus}",
            "--num-gpus=0",
            "--disable-usage-stats",
            f"--resources={json.dumps(node.resources)}",
            *(f"--{name}={port}" for name, port in ports.items()),
        ]
        self._run(command, timeout_s=120)

    def node_indexes(self) -> dict[str, int]:
        """Ray's node id -> the node's index into `nodes`; -1 for the head."""
        return {self.head_node_id: -1} | {node_id: i for i, node_id in enumerate(self.node_ids)}

    def kill_node(self, index: int) -> list[int]:
        """SIGKILL every process of joined node `index` (its raylet, agents and workers), as if
        its machine died; the ids killed."""
        pids = node_process_ids(self.node_temp_dir(index))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def deploy(self, config: dict) -> None:
        """`serve deploy` a Serve config through the dashboard (starting Serve with its HTTP
        options, on a free port); returns once the controller has it, not once it runs."""
        http_options = {**config.get("http_options", {}), "port": self.ports["http"]}
        config = {**config, "http_options": {**http_options, "host": "127.0.0.1"}}
        if self.nodes:  # one machine: every node's proxy would want the same port
            config["proxy_location"] = "HeadOnly"
        path = self.temp_dir / "serve_config.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        self._run(["serve", "deploy", str(path), f"--address={self.dashboard_url}"], 120)

    def dashboard_json(self, path: str) -> dict:
        """GET a route of the dashboard's REST API (what the `serve` and `ray list` CLIs read,
        without starting a process for each call)."""
        request = urllib.request.Request(
            self.dashboard_url + path, headers={"Authorization": f"Bearer {self.auth_token}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def serve_details(self) -> dict:
        """What `serve status` shows and more: per application its status, message and
        deployments, and per replica its state and node_id."""
        return self.dashboard_json("/api/serve/applications/")

    def alive_actors(self) -> list[tuple[str, int]]:
        """(name, node index as in `node_indexes`) of every alive named actor."""
        query = "filter_keys=state&filter_predicates=%3D&filter_values=ALIVE&limit=10000"
        actors = self.dashboard_json(f"/api/v0/actors?{query}")["data"]["result"]["result"]
        indexes = self.node_indexes()
        return [(a["name"], indexes[a["node_id"]]) for a in actors if a.get("name")]

    def app_status(self, app: str) -> tuple[str, str]:
        """An application's status (DEPLOYING, RUNNING, DEPLOY_FAILED, ...) and its message."""
        return self.app_statuses([app])[app]

    def app_statuses(self, apps: list[str]) -> dict[str, tuple[str, str]]:
        details = self.serve_details()["applications"]
        statuses = {app: details.get(app, {}) for app in apps}
        return {
            app: (status.get("status", "NOT_STARTED"), status.get("message", ""))
            for app, status in statuses.items()
        }

    def replica_nodes(self, deployment: str, app: str = "default") -> list[int]:
        """The node index (into `nodes`; -1 for the head) of each RUNNING replica."""
        details = self.serve_details()["applications"][app]["deployments"][deployment]
        node_ids = [r["node_id"] for r in details["replicas"] if r["state"] == "RUNNING"]
        return sorted(self.node_indexes()[node_id] for node_id in node_ids)

    def wait_until_deployed(self, config: dict, timeout_s: float) -> None:
        """Until every application of `config` runs, except `failing_apps`, which must fail
        to deploy instead; raise as soon as another one fails."""
        deadline = time.monotonic() + timeout_s
        names = [app.get("name", "default") for app in config["applications"]]
        while time.monotonic() < deadline:
            statuses = self.app_statuses(names)
            failed = {n: message for n, (s, message) in statuses.items() if s == "DEPLOY_FAILED"}
            if set(failed) - set(self.failing_apps):
                raise RuntimeError(f"serve deploy failed: {failed}")
            expected = {n: "DEPLOY_FAILED" if n in self.failing_apps else "RUNNING" for n in names}
            if {n: status for n, (status, _) in statuses.items()} == expected:
                return
            time.sleep(0.5)
        raise TimeoutError(f"serve deploy: not as expected after {timeout_s}s: {statuses}")

    def wait_until_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.serve_process.poll() is not None:
                raise RuntimeError(f"serve run exited early:\n{self.log_tail()}")
            if "is ready at" in self.log_path.read_text(errors="replace"):
                return
            time.sleep(0.2)  # a read of a short local file: the app's start is not held up
        raise TimeoutError(f"serve run not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def _run(self, command: list[str], timeout_s: float) -> str:
        result = subprocess.run(
            command,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO_ROOT,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def run_python(self, script: str, *args: str, timeout_s: float = 120) -> str:
        """Run Python (a file, or -m module) against this cluster, e.g. handle clients."""
        return self._run([sys.executable, script, *args], timeout_s)

    def popen_python(self, script: str, *args: str) -> subprocess.Popen:
        """Start Python against this cluster with text pipes to its stdin and stdout (a client
        that waits for the caller between steps); its stderr goes to a log in the temp dir."""
        with open(self.temp_dir / f"client-{uuid.uuid4().hex[:8]}.log", "wb") as log:
            return subprocess.Popen(
                [sys.executable, script, *args],
                env=self.env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=REPO_ROOT,
            )

    def serve_status(self) -> dict:
        import yaml

        text = self._run(["serve", "status", f"--address={self.dashboard_url}"], timeout_s=60)
        return yaml.safe_load(text)

    def running_replicas(self, deployment: str, app: str = "default") -> int:
        """RUNNING replicas of a deployment, from the dashboard's REST API (what `serve status`
        reads and counts, without a CLI process per call: ~3 s of CPU on 2 busy cores, polled)."""
        details = self.serve_details()["applications"][app]["deployments"][deployment]
        return sum(replica["state"] == "RUNNING" for replica in details["replicas"])

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()

    def metric_sum(self, name: str) -> float:
        """Sum of every sample of a Prometheus metric (all tags)."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.http_url + path, timeout=30) as response:
            return json.loads(response.read())

    def __enter__(self) -> ServeCluster:
        """`with ServeCluster(args) as cluster:` starts it, and stops it however the block
        ends (a failed start included)."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        if self.serve_process is not None and self.serve_process.poll() is None:
            self.serve_process.terminate()
            try:
                self.serve_process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.serve_process.kill()
        # No `serve shutdown` first: its graceful stop of the replicas took ~8 s of a ~15 s stop
        # (tiny model, 2 cores) and leaves nothing that ending the processes does not (the
        # hand-off arenas of killed owners go below). `ray stop` would also stop the pytest
        # process's own cluster: end only this cluster's processes (those naming its temp dir)
        # and their children (the worker processes); gcs_server ignores SIGTERM, so a short grace.
        stop_processes(cluster_process_ids(self.temp_dir, self.auth_token), grace_s=1)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        # The node's cleanup: the hand-off arenas of workers killed with the cluster (a live
        # owner's, another cluster's, stays).
        from rayinfer.workers.runner.kv_arena import unlink_dead_arenas

        unlink_dead_arenas()
