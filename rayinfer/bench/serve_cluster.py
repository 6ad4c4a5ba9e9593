"""A private Ray cluster plus a real `serve run rayinfer.app:build` subprocess, for the end-to-end
tests (tests/serve) and the benchmarks that load a server (benchmarks/soak.py).

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
    app_args: list[str]
    num_cpus: int = 4
    head_resources: dict[str, float] = field(default_factory=dict)
    nodes: list[NodeSpec] = field(default_factory=list)  # joining the head, in order
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. RAY_* system settings
    killed_nodes: list[int] = field(default_factory=list)  # indexes into `nodes`
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp")))
    ports: dict[str, int] = field(default_factory=dict)
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
        for index, node in enumerate(self.nodes):
            self._start_node(index, node)
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

    def _start_node(self, index: int, node: NodeSpec) -> None:
        temp_dir = self.node_temp_dir(index)
        temp_dir.mkdir()
        ports = dict(zip(NODE_PORT_NAMES, free_ports(len(NODE_PORT_NAMES))))
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

    def kill_node(self, index: int) -> list[int]:
        """SIGKILL every process of joined node `index` (its raylet, agents and workers), as if
        its machine died; the ids killed."""
        temp_dir = self.node_temp_dir(index)
        roots = [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _names(entry, f"{temp_dir}/")
        ]
        pids = with_descendants(roots)
        self.killed_nodes.append(index)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def wait_until_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.serve_process.poll() is not None:
                raise RuntimeError(f"serve run exited early:\n{self.log_tail()}")
            if "is ready at" in self.log_path.read_text(errors="replace"):
                return
            time.sleep(1)
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

    def serve_status(self) -> dict:
        import yaml

        text = self._run(["serve", "status", f"--address={self.dashboard_url}"], timeout_s=60)
        return yaml.safe_load(text)

    def running_replicas(self, deployment: str, app: str = "default") -> int:
        status = self.serve_status()["applications"][app]["deployments"][deployment]
        return status["replica_states"].get("RUNNING", 0)

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
        # After a node's death Serve's shutdown waits out the graceful stop of the replicas it
        # had there; the processes below are ended anyway.
        if not self.killed_nodes:
            command = ["serve", "shutdown", "-y", f"--address={self.dashboard_url}"]
            try:
                subprocess.run(command, env=self.env(), capture_output=True, timeout=60)
            except subprocess.TimeoutExpired:
                pass
        # `ray stop` would also stop the pytest process's own cluster: end only this cluster's
        # processes (those naming its temp dir) and their children (the worker processes).
        stop_processes(cluster_process_ids(self.temp_dir, self.auth_token))
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        # The node's cleanup: the hand-off arenas of workers killed with the cluster (a live
        # owner's, another cluster's, stays).
        from rayinfer.workers.runner.kv_arena import unlink_dead_arenas

        unlink_dead_arenas()


def _parent_ids() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def _belongs_to_cluster(entry: Path, temp_dir: Path, auth_token: str) -> bool:
    """Its command line names the temp dir, or it inherited the cluster's private token (Ray's
    agents and client server rename themselves and name neither)."""
    try:
        if str(temp_dir).encode() in (entry / "cmdline").read_bytes():
            return True
        token = f"RAY_AUTH_TOKEN={auth_token}".encode()
        return token in (entry / "environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _names(entry: Path, text: str) -> bool:
    """Whether the process's command line contains `text`."""
    try:
        return text.encode() in (entry / "cmdline").read_bytes()
    except OSError:
        return False


def cluster_process_ids(temp_dir: Path, auth_token: str) -> list[int]:
    """This cluster's processes (see `_belongs_to_cluster`) and all their descendants."""
    roots = {
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and int(entry.name) != os.getpid()
        and _belongs_to_cluster(entry, temp_dir, auth_token)
    }
    return with_descendants(roots)


def with_descendants(roots) -> list[int]:
    """The processes `roots` and all their descendants."""
    parents = _parent_ids()
    found = set(roots)
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        found |= children
        grew = bool(children)
    return sorted(found)


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_processes(pids: list[int], grace_s: float = 3) -> None:
    """SIGTERM, then SIGKILL whatever still runs after grace_s (gcs_server ignores SIGTERM)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_is_running(pid) for pid in pids):
            time.sleep(0.2)


def wait_for(predicate, timeout_s: float, interval_s: float = 1.0, what: str = "condition"):
    """Poll predicate() until it returns a truthy value; raise after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as error:  # not up yet (connection refused, 503, a status without the key)
            last_error = error
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached within {timeout_s}s (last error: {last_error!r})")
