"""The exporting group's holds on its hand-offs (workers/export_holds.py): those whose import
nothing on this node shows (object-store exports) are kept for the lease, but never more than
max_unseen_bytes of KV, the oldest let go first."""

from __future__ import annotations

from types import SimpleNamespace

import ray as ray_module

from rayinfer.workers.export_holds import ExportHolds


def store_export(ray):
    """An ended export through the object store: its header names no arena span."""
    return [ray.put(SimpleNamespace(arena=None))]


def test_unseen_holds_keep_at_most_their_byte_budget(ray_cluster):
    ray = ray_cluster
    holds = ExportHolds(lease_s=600.0, max_unseen_bytes=250)
    for name in ("a", "b", "c"):
        holds.hold(name, store_export(ray), num_bytes=100)
    holds.drop_done()
    assert holds.request_ids == ["b", "c"]  # 300 bytes past 250: the oldest let go
    holds.hold("d", store_export(ray), num_bytes=100)
    holds.drop_done()
    assert holds.request_ids == ["c", "d"]
    holds.clear()


@ray_module.remote(num_cpus=0)
class Gate:
    """Holds callers of `passed` until `open` is called."""

    def __init__(self):
        import asyncio

        self.event = asyncio.Event()

    async def passed(self) -> None:
        await self.event.wait()

    def open(self) -> None:
        self.event.set()


@ray_module.remote(num_cpus=0)
def export_behind(gate):
    ray_module.get(gate.passed.remote())
    return SimpleNamespace(arena=None)


def test_an_export_still_running_is_held_past_the_budget(ray_cluster):
    """Only ended exports count against the budget: one still running is never let go."""
    gate = Gate.remote()
    running = export_behind.remote(gate)
    holds = ExportHolds(lease_s=600.0, max_unseen_bytes=50)
    holds.hold("running", [running], num_bytes=100)
    holds.hold("ended", store_export(ray_cluster), num_bytes=100)
    holds.drop_done()
    assert holds.request_ids == ["running"]  # "ended" alone is past the budget
    ray_module.get(gate.open.remote())
    ray_module.get(running)
    holds.drop_done()
    assert holds.request_ids == []  # ended now, and past the budget too
    holds.clear()
    ray_module.kill(gate)
