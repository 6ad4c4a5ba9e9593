"""Shared host memory is one node's: a host-staged group whose ranks sit on different nodes is
refused by every rank, naming where each runs, instead of waiting for chunks forever."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from rayinfer.comm import shm
from rayinfer.comm.shm import SharedSegments


def build_segments(monkeypatch, node_of_rank: list[str]) -> list:
    """SharedSegments of every rank, each built on its own thread that reports its own node;
    per rank the segments or the exception it raised."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))
    node_of_thread: dict[int, str] = {}
    monkeypatch.setattr(shm, "this_node_id", lambda: node_of_thread[threading.get_ident()])
    results: list = [None] * len(node_of_rank)

    def build(rank: int) -> None:
        node_of_thread[threading.get_ident()] = node_of_rank[rank]
        try:
            results[rank] = SharedSegments(store, rank, len(node_of_rank), 4096, 2, pin=False)
        except RuntimeError as error:
            results[rank] = error

    threads = [threading.Thread(target=build, args=(r,)) for r in range(len(node_of_rank))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


def test_ranks_on_one_node_share_segments(monkeypatch):
    results = build_segments(monkeypatch, ["node-a"] * 3)
    assert all(isinstance(r, SharedSegments) for r in results)
    for segments in results:
        segments.close()


@pytest.mark.parametrize("nodes", [["node-a", "node-b"], ["node-a", "node-a", "node-b"]])
def test_ranks_on_two_nodes_are_refused_by_every_rank(monkeypatch, nodes):
    results = build_segments(monkeypatch, nodes)
    assert all(isinstance(r, RuntimeError) for r in results), results
    message = str(results[0])
    assert "spans 2 nodes" in message and "node-b" in message
    assert "all_to_all.transport=dist" in message
