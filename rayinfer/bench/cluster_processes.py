"""The processes of a private Ray cluster on this machine (rayinfer/bench/serve_cluster.py):
found by their command lines and environment under /proc, and stopped by pid, so that ending
one cluster never touches another one on the same machine (`ray stop` would end them all)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def raylet_node_id(temp_dir: Path) -> str:
    """The node id of the raylet started with `--temp-dir=temp_dir`, from its command line."""
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if f"--temp_dir={temp_dir}".encode() in args:
            for arg in args:
                if arg.startswith(b"--node_id="):
                    return arg.removeprefix(b"--node_id=").decode()
    raise RuntimeError(f"no raylet runs with --temp_dir={temp_dir}")


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


def command_line_has(entry: Path, text: str) -> bool:
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


def node_process_ids(temp_dir: Path) -> list[int]:
    """The processes of the node started with `--temp-dir=temp_dir` (its raylet and agents,
    which name the dir) and all their descendants (its workers)."""
    roots = [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and command_line_has(entry, f"{temp_dir}/")
    ]
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
