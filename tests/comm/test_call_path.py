"""RayinferGroup.all_to_all's call path (issue 4): errors for bad splits, `auto` without the
split-matrix all-gather where the topology fixes the plan, and batched metrics. Two ranks run
as two threads of this process (gloo over a HashStore), so no Ray cluster is needed."""

import threading

import pytest
import torch
import torch.distributed as dist

from rayinfer.comm import metrics
from rayinfer.comm.group import RayinferGroup
from rayinfer.comm.refs import all_to_all_ref
from rayinfer.comm.topology import Topology


def on_both(fns) -> list:
    """fns[r]() on a thread per rank; returns their results, re-raises the first error."""
    results, errors = [None] * len(fns), []

    def run(r):
        try:
            results[r] = fns[r]()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


class CountingProcessGroup:
    """The real process group, counting all-gathers (the split-matrix exchange)."""

    def __init__(self, pg):
        self.pg = pg
        self.allgathers = 0

    def allgather(self, *args):
        self.allgathers += 1
        return self.pg.allgather(*args)

    def __getattr__(self, name):
        return getattr(self.pg, name)


@pytest.fixture(scope="module")
def groups():
    store = dist.HashStore()
    made = on_both(
        [lambda r=r: RayinferGroup(2, r, "rayinfer-decode-t-ep0", store) for r in (0, 1)]
    )
    for g in made:
        g.pg = CountingProcessGroup(g.pg)
    yield made
    on_both([g.destroy_group for g in made])


def _exchange(groups, matrix, **kw):
    gen = torch.Generator().manual_seed(sum(map(sum, matrix)))
    inputs = [torch.randn(sum(row), 3, generator=gen).to(torch.bfloat16) for row in matrix]
    expected = all_to_all_ref(inputs, matrix)
    outs = [torch.full_like(e, 7) for e in expected]
    calls = [
        lambda g=g, r=r: g.all_to_all(
            outs[r], inputs[r], [row[r] for row in matrix], matrix[r], **kw
        )
        for r, g in enumerate(groups)
    ]
    choices = on_both(calls)
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))
    return choices


def test_bad_splits_raise_clear_errors(groups):
    g, x = groups[0], torch.zeros(4, 3)
    with pytest.raises(ValueError, match="in_splits has 3 entries"):
        g.all_to_all(torch.zeros(4, 3), x, [2, 2], [1, 1, 2])
    with pytest.raises(ValueError, match="out_splits has negative entries"):
        g.all_to_all(torch.zeros(4, 3), x, [5, -1], [2, 2])
    with pytest.raises(ValueError, match="in_splits sums to 3 but the tensor has 4 rows"):
        g.all_to_all(torch.zeros(4, 3), x, [2, 2], [1, 2], "nccl", "dist")


def test_auto_skips_the_split_gather_where_the_topology_fixes_the_plan(groups):
    """CPU placeholder topology: nccl/dist is the only candidate at every size."""
    for g in groups:
        g.topology = Topology.uniform(2)
        assert (g.size_free_plan().schedule, g.size_free_plan().transport) == ("nccl", "dist")
    before = [g.pg.allgathers for g in groups]
    choices = _exchange(groups, [[3, 5], [0, 2]])
    choices += _exchange(groups, [[300, 1], [2, 40]])
    assert [g.pg.allgathers for g in groups] == before
    assert {(c.schedule, c.transport) for c in choices} == {("nccl", "dist")}


def test_auto_gathers_where_the_plan_depends_on_size(groups):
    """A fast host link with a slow start: dist for small exchanges, host for large ones."""
    topo = Topology.from_matrix([[10.0] * 2] * 2, latency_us=5.0, host_gbps=40.0)
    for g in groups:
        g.topology = topo
        assert g.size_free_plan() is None
    before = [g.pg.allgathers for g in groups]
    _exchange(groups, [[3, 5], [1, 2]])
    _exchange(groups, [[3, 5], [1, 2]], split_matrix=[[3, 5], [1, 2]])  # given: no gather
    assert [g.pg.allgathers for g in groups] == [b + 1 for b in before]
    for g in groups:
        g.topology = Topology.uniform(2)


class FakeMetric:
    def __init__(self):
        self.values, self.tags = [], []

    def inc(self, value, tags):
        self.values.append(value)
        self.tags.append(tags)

    observe = inc


def test_metrics_are_batched_with_exact_counts(groups, monkeypatch):
    sent, seconds = FakeMetric(), FakeMetric()
    monkeypatch.setattr(metrics, "_made", (sent, seconds))
    for g in groups:
        monkeypatch.setattr(g, "_metrics", metrics.AllToAllRecorder(g.group_name))
    matrix = [[3, 5], [4, 2]]  # rank 0 sends 5 rows, rank 1 sends 4 (3 bf16 = 6 bytes each)
    for _ in range(3):
        _exchange(groups, matrix, schedule="nccl", transport="dist")
    _exchange(groups, [[2, 0], [0, 2]], schedule="pairwise", transport="dist")  # 0 bytes out
    for g in groups:
        g._metrics.flush()
    assert len(seconds.values) == 8  # one observation per call and rank
    assert sum(sent.values) == 3 * (5 + 4) * 6
    assert {t["schedule"] for t in seconds.tags} == {"nccl", "pairwise"}
    assert {t["schedule"] for t in sent.tags} == {"nccl"}  # nothing sent: no Counter.inc(0)
    assert all(t["phase"] == "decode" and t["transport"] == "dist" for t in seconds.tags)


def test_a_failed_exchange_records_nothing(groups, monkeypatch):
    sent, seconds = FakeMetric(), FakeMetric()
    monkeypatch.setattr(metrics, "_made", (sent, seconds))
    recorder = metrics.AllToAllRecorder(groups[0].group_name)
    monkeypatch.setattr(groups[0], "_metrics", recorder)
    inp = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="in_splits"):
        groups[0].all_to_all(torch.zeros(3, 2), inp, [1, 2], [1, 1], "nccl", "dist")
    recorder.flush()
    assert sent.values == [] and seconds.values == []
