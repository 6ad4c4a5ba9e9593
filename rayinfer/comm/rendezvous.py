"""Rendezvous through Ray: rank 0 opens a TCPStore on a free port and publishes it in Ray's KV."""

import datetime
import socket
import time

import torch.distributed as dist

_KEY_PREFIX = "rayinfer_comm_store_"


def _node_ip() -> str:
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def this_node_id() -> str:
    """The Ray node this process runs on (its node id); outside Ray, the host's name."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()


def _kv():
    import ray.experimental.internal_kv as kv

    return kv


def make_store(group_name: str, rank: int, world_size: int, timeout_s: float = 60.0) -> dist.Store:
    """Return a TCPStore shared by the group's ranks: rank 0 hosts it on a port the OS picks.

    Rank 0 publishes "host:port" under a Ray internal-KV key named after the group; the other
    ranks wait for the key. No port is hard-coded.
    """
    key = _KEY_PREFIX + group_name
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        host = _node_ip()
        store = dist.TCPStore(host, 0, world_size, True, timeout=timeout, wait_for_workers=False)
        _kv()._internal_kv_put(key, f"{host}:{store.port}", overwrite=True)
        return store
    address = _wait_for_key(key, timeout_s, group_name)
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world_size, False, timeout=timeout)


def forget_store(group_name: str) -> None:
    """Delete the published address (rank 0 calls this once every rank has joined)."""
    _kv()._internal_kv_del(_KEY_PREFIX + group_name)


def _wait_for_key(key: str, timeout_s: float, group_name: str) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = _kv()._internal_kv_get(key)
        if value is not None:
            return value.decode()
        time.sleep(0.02)
    raise TimeoutError(
        f"rank 0 of collective group {group_name!r} never published its store address within "
        f"{timeout_s:.0f} s; check that every rank called init_collective_group with the same name"
    )
