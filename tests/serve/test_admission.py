"""The ingress's admission estimate (deployments/admission.py) against a hand-driven clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from rayinfer.deployments.admission import Admission, Refusal


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_queued(admission: Admission, clock: Clock, num_requests: int, start_s: float):
    """num_requests starts start_s apart, each with one more request waiting behind it (a
    queue: what the rate is measured on); the last one behind leaves unstarted."""
    assert admission.try_admit() is None
    for _ in range(num_requests):
        assert admission.try_admit() is None
        clock.now += start_s
        admission.start()
    admission.leave()


def run_sequentially(admission: Admission, clock: Clock, num_requests: int, start_s: float):
    """One request at a time, each starting start_s after its admission."""
    for _ in range(num_requests):
        assert admission.try_admit() is None
        clock.now += start_s
        admission.start()


def test_one_request_at_a_time_bounds_the_rate_by_the_batch_until_a_queue_measures_it():
    clock = Clock()
    admission = Admission(max_wait_s=30.0, clock=clock, parallelism=16)
    run_sequentially(admission, clock, num_requests=3, start_s=2.0)  # latency-bound: 0.5/s
    assert admission.start_rate() == pytest.approx(0.5 * 16)
    burst = [admission.try_admit() for _ in range(300)]
    assert burst[:16] == [None] * 16  # a burst on an idle replica is admitted...
    assert burst.count(None) == 240 and burst[-1] is not None  # ...up to 30 s at 8 starts/s
    clock.now += 2.0
    for _ in range(16):  # then measured once a batch of it starts
        admission.start()
    assert admission.start_rate() == pytest.approx(17 / 2.0)


def test_without_a_bound_every_request_is_admitted():
    admission = Admission(max_wait_s=None, clock=Clock())
    assert all(admission.try_admit() is None for _ in range(10_000))
    assert admission.num_waiting == 10_000


def test_a_fresh_replica_admits_until_its_first_start():
    clock = Clock()
    admission = Admission(max_wait_s=1.0, clock=clock)
    for _ in range(50):
        assert admission.try_admit() is None
        clock.now += 1.0
    assert admission.start_rate() == math.inf


def test_the_rate_is_starts_per_busy_second_and_idle_time_does_not_count():
    clock = Clock()
    admission = Admission(max_wait_s=10.0, clock=clock)
    run_queued(admission, clock, num_requests=4, start_s=0.5)
    clock.now += 1_000.0  # idle: the rate is kept
    # 4 starts in 2 busy seconds, plus the one under way
    assert admission.start_rate() == pytest.approx(5 / 2.0)
    assert admission.estimated_wait_s() == pytest.approx(1 / 2.5)


def test_a_request_that_would_wait_past_the_deadline_is_refused_with_the_excess():
    clock = Clock()
    admission = Admission(max_wait_s=2.0, clock=clock)
    run_queued(admission, clock, num_requests=4, start_s=0.5)  # 2.5 starts per second
    admitted = 0
    while admission.try_admit() is None:
        admitted += 1
    assert admitted == 5  # the 5th waits 5 / 2.5 = 2 s, the 6th would wait 2.4 s
    assert admission.try_admit() == Refusal(pytest.approx(2.4), 1)
    assert admission.num_waiting == 5  # refusals are not counted as waiting


def test_retry_after_is_the_time_the_backlog_needs_to_drain_into_the_deadline():
    clock = Clock()
    admission = Admission(max_wait_s=1.0, clock=clock)
    run_queued(admission, clock, num_requests=1, start_s=1.0)  # 2 starts per busy second
    admission.max_wait_s = None  # pile up a backlog as a burst would before the rate fell
    for _ in range(20):
        admission.try_admit()
    admission.max_wait_s = 1.0
    refusal = admission.try_admit()
    assert refusal.estimated_wait_s == pytest.approx(21 / 2)
    assert refusal.retry_after_s == math.ceil(21 / 2 - 1.0)


def test_a_stall_lowers_the_rate_while_requests_wait():
    clock = Clock()
    admission = Admission(max_wait_s=1.0, clock=clock)
    run_queued(admission, clock, num_requests=4, start_s=0.5)  # 2.5 starts per second
    assert admission.try_admit() is None
    assert admission.try_admit() is None
    assert admission.estimated_wait_s() == pytest.approx(3 / 2.5)
    clock.now += 3.0  # two wait, nothing starts
    assert admission.start_rate() == pytest.approx(5 / 5.0)
    assert admission.try_admit() == Refusal(pytest.approx(3.0), 2)


def test_batched_starts_raise_the_rate():
    clock = Clock()
    admission = Admission(max_wait_s=1.0, clock=clock)
    run_queued(admission, clock, num_requests=1, start_s=0.5)
    for _ in range(3):
        assert admission.try_admit() is None
    clock.now += 0.5
    for _ in range(3):  # one engine step starts the three together: the last, then alone, is
        admission.start()  # not counted (a batch's end is under-counted by one)
    assert admission.start_rate() == pytest.approx(4 / 1.0)


def test_left_requests_stop_waiting_without_counting_as_starts():
    clock = Clock()
    admission = Admission(max_wait_s=1.0, clock=clock)
    run_queued(admission, clock, num_requests=1, start_s=1.0)
    admission.try_admit()
    admission.try_admit()
    clock.now += 1.0
    admission.leave()
    admission.leave()
    assert admission.num_waiting == 0
    assert admission.start_rate() == pytest.approx(2 / 2.0)


def test_the_window_keeps_the_last_starts():
    clock = Clock()
    admission = Admission(max_wait_s=10.0, num_samples=4, clock=clock)
    run_queued(admission, clock, num_requests=4, start_s=1.0)  # slow: 1 per second
    run_queued(admission, clock, num_requests=4, start_s=0.1)  # now 10 per second
    assert admission.start_rate() == pytest.approx(5 / 0.4)


def test_a_refused_request_answers_503_with_its_retry_after_and_does_no_work():
    from rayinfer.deployments.ingress import error_response
    from rayinfer.deployments.openai_error import OpenAIError
    from rayinfer.deployments.pipeline import DisaggregatedPipeline

    class NoHandle:
        def options(self, **_):
            return self

    class Counts:
        tags = {}

        def __init__(self):
            self.statuses = []

        def count_request(self, status):
            self.statuses.append(status)

    clock = Clock()
    admission = Admission(max_wait_s=1.0, clock=clock)
    run_queued(admission, clock, num_requests=1, start_s=1.0)
    admission.max_wait_s = None
    for _ in range(7):
        admission.try_admit()
    admission.max_wait_s = 1.0
    metrics = Counts()
    # any call to a handle would fail
    pipeline = DisaggregatedPipeline(NoHandle(), NoHandle(), metrics, admission)

    async def first():
        return await anext(pipeline.run("req-1", [1, 2], None, None))

    with pytest.raises(OpenAIError) as caught:
        asyncio.run(first())
    assert caught.value.code == "overloaded" and caught.value.retry_after_s == 3
    assert metrics.statuses == ["shed"] and admission.num_waiting == 7
    reply = error_response(caught.value)
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "3"
