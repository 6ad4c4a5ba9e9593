"""DeathWatch: one thread hears of a worker's death as soon as Ray reports it, and not after
the watch is closed (a group killing its own workers at shutdown)."""

from __future__ import annotations

import threading

import pytest

from rayinfer.workers.death_watch import DeathWatch


@pytest.fixture(scope="module")
def actor_class(ray_cluster):
    @ray_cluster.remote(num_cpus=0, concurrency_groups={"watch": 1})
    class Idle:
        """A worker's stand-in: `wait_until_killed` as Worker has it."""

        @ray_cluster.method(concurrency_group="watch")
        def wait_until_killed(self) -> None:
            threading.Event().wait()

        def ping(self) -> str:
            return "ok"

    return Idle


def test_the_first_killed_worker_is_reported_once(ray_cluster, actor_class):
    workers = [actor_class.remote() for _ in range(2)]
    assert ray_cluster.get([w.ping.remote() for w in workers]) == ["ok", "ok"]  # both serve
    heard, reported = [], threading.Event()
    watch = DeathWatch(workers, ["w-r0", "w-r1"], lambda lost: (heard.append(lost), reported.set()))
    assert watch.lost is None
    ray_cluster.kill(workers[1], no_restart=True)
    assert reported.wait(timeout=20)
    assert watch.lost == heard[0] and heard[0].worker_name == "w-r1"
    assert heard[0].error == "ActorDiedError" and "w-r1 died" in heard[0].describe()
    ray_cluster.kill(workers[0], no_restart=True)


def test_a_closed_watch_reports_nothing(ray_cluster, actor_class):
    workers = [actor_class.remote()]
    ray_cluster.get(workers[0].ping.remote())
    heard = []
    watch = DeathWatch(workers, ["w-r0"], heard.append)
    watch.close()
    ray_cluster.kill(workers[0], no_restart=True)
    watch._thread.join(timeout=20)
    assert not watch._thread.is_alive() and heard == [] and watch.lost is None
