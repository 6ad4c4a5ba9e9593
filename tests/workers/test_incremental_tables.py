"""A worker group sends each request's block table once, then only the blocks added since, and
its SamplingParams once: the workers rebuild the whole tables and keep the params, also across a
preemption (a new table), a move to another replica and a free, and each step's payload shrinks
to the new blocks."""

import pickle
from types import SimpleNamespace

import pytest

from rayinfer.engine.batch import ModelBatch, ScheduledRequest
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.workers.step_wire import SentState
from rayinfer.workers.worker import Worker

PARAMS = SamplingParams(max_tokens=4, temperature=0)


def request(request_id: str, table: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request_id, [7], len(table) * 16 - 1, table, True, PARAMS)


class Driver:
    """The group's side of the protocol, with one worker per replica (pickled as by Ray)."""

    def __init__(self, replicas: int):
        self.sent = SentState()
        self.workers = [SimpleNamespace(block_tables={}, params={}) for _ in range(replicas)]

    def step(self, shares: list[list[ScheduledRequest]]) -> list[list[ScheduledRequest]]:
        seen, self.wire = [], []
        for replica, share in enumerate(shares):
            wire = self.sent.as_sent(replica, share)
            batch = pickle.loads(pickle.dumps(ModelBatch(wire)))
            self.wire.append([r.params for r in batch.requests])
            Worker._complete_requests(self.workers[replica], batch)
            seen.append(batch.requests)
        return seen

    def free(self, request_ids):
        self.sent.forget(request_ids)
        for request_id in request_ids:
            for worker in self.workers:
                worker.block_tables.pop(request_id, None)
                worker.params.pop(request_id, None)


def test_workers_rebuild_the_tables_from_the_new_blocks():
    driver = Driver(replicas=2)
    a, b = [3, 9], [4]
    (got_a, got_b) = driver.step([[request("a", a)], [request("b", b)]])
    assert got_a[0].block_table == [3, 9] and got_b[0].block_table == [4]
    a.append(11)  # a grows by a block; b does not
    copy = SentState()
    copy.tables, copy.params = dict(driver.sent.tables), dict(driver.sent.params)
    sent = [copy.as_sent(0, [request("a", a)])]
    assert sent[0][0].block_table == [11] and sent[0][0].block_table_from == 2
    (got_a, got_b) = driver.step([[request("a", a)], [request("b", b)]])
    assert got_a[0].block_table == [3, 9, 11] and got_b[0].block_table == [4]
    assert got_a[0].block_table_from == 0
    a = [5]  # preempted and admitted again: a new table, sent whole
    (got_a,) = driver.step([[request("a", a)]])
    assert got_a[0].block_table == [5]
    (_, got_b) = driver.step([[], [request("b", b + [8])]])  # another list: sent whole too
    assert got_b[0].block_table == [4, 8]
    driver.free(["a"])
    (got_a, _) = driver.step([[request("a", [6, 2])], []])  # an id used again after its free
    assert got_a[0].block_table == [6, 2]


def test_params_go_once_per_replica_and_again_after_a_free_or_a_change():
    driver = Driver(replicas=2)
    got = driver.step([[request("a", [1])], [request("b", [2])]])
    assert driver.wire == [[PARAMS], [PARAMS]]  # first steps carry them
    got = driver.step([[request("a", [1])], [request("b", [2])]])
    assert driver.wire == [[None], [None]]  # the workers hold them
    assert got[0][0].params is not None and got[0][0].params.max_tokens == 4
    driver.step([[], [request("a", [1])]])  # moved to the other replica
    assert driver.wire == [[], [PARAMS]]
    other = SamplingParams(max_tokens=9, temperature=0)
    moved = ScheduledRequest("a", [7], 15, [1], True, other)
    (_, got_a) = driver.step([[], [moved]])  # another params object: sent again
    assert driver.wire == [[], [other]] and got_a[0].params.max_tokens == 9
    driver.free(["a"])
    driver.step([[], [moved]])
    assert driver.wire == [[], [other]]


def test_a_worker_missing_the_start_of_a_table_or_the_params_says_so():
    worker = SimpleNamespace(block_tables={}, params={})
    late = ScheduledRequest("x", [1], 40, [12], True, PARAMS, block_table_from=3)
    with pytest.raises(RuntimeError, match="request 'x': sent blocks from 3 on.*holds None"):
        Worker._complete_requests(worker, ModelBatch([late]))
    bare = ScheduledRequest("y", [1], 40, [12], True, None)
    with pytest.raises(RuntimeError, match="request 'y': sent without its SamplingParams"):
        Worker._complete_requests(worker, ModelBatch([bare]))


def test_decode_payload_shrinks_to_the_new_blocks():
    """256 decodes with 512-block tables: the first step sends every table, the next ones a
    block or none (the 557 KB per worker call of whole tables went past Ray's inline limit)."""
    driver = Driver(replicas=1)
    tables = [list(range(i * 600, i * 600 + 512)) for i in range(256)]
    first = [request(f"r{i}", t) for i, t in enumerate(tables)]
    whole = len(pickle.dumps(ModelBatch(driver.sent.as_sent(0, first))))
    for t in tables[:8]:
        t.append(t[-1] + 1)
    later = [request(f"r{i}", t) for i, t in enumerate(tables)]
    step = len(pickle.dumps(ModelBatch(driver.sent.as_sent(0, later))))
    assert whole > 500_000 and step < 40_000
