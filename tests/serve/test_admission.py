"""The ingress's admission estimate (deployments/admission.py) against a hand-driven clock."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from types import SimpleNamespace

import pytest
from ray.serve.exceptions import BackPressureError

from rayinfer.deployments.admission import Admission, Refusal, Waiter
from rayinfer.deployments.choices import ChoiceLimit
from rayinfer.deployments.ingress import Ingress
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.phase_config import PhaseConfig
from rayinfer.deployments.pipeline import ColocatedPipeline
from rayinfer.deployments.protocol import CompletionRequest
from rayinfer.deployments.replies import ALL_FORMATS
from rayinfer.engine.sampling_params import SamplingParams
from tests.serve.test_colocated_pipeline import Engines, Metrics, Stream

# The ingress class as written, without Serve's ASGI wrapper (deployments/ingress.py)
IngressClass = Ingress.func_or_class.__mro__[1]


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


def test_left_requests_stop_waiting_and_their_queue_is_not_measured():
    clock = Clock()
    admission = Admission(max_wait_s=1.0, clock=clock)
    run_queued(admission, clock, num_requests=1, start_s=1.0)
    admission.try_admit()
    admission.try_admit()
    clock.now += 1.0
    admission.leave()
    admission.leave()
    assert admission.num_waiting == 0
    assert admission.start_rate() == pytest.approx(2 / 1.0)  # as before the queue


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


def oversized_request(admission: Admission, clock: Clock, num_runs: int, num_started: int):
    """One request of num_runs runs admitted on an idle server: a few start over 5 s while
    Serve refuses the rest, which leave unstarted."""
    assert admission.try_admit(num_runs) is None
    clock.now += 5.0
    for _ in range(num_started):
        admission.start()
    for _ in range(num_runs - num_started):
        admission.leave()


def test_a_request_whose_runs_mostly_fail_unstarted_leaves_the_rate_as_it_was():
    clock = Clock()
    admission = Admission(max_wait_s=30.0, clock=clock, parallelism=128)
    run_queued(admission, clock, num_requests=8, start_s=0.1)  # 9 starts in 0.8 queued s
    rate = admission.start_rate()
    oversized_request(admission, clock, num_runs=4096, num_started=3)
    assert admission.num_waiting == 0 and admission.start_rate() == pytest.approx(rate)
    assert admission.try_admit() is None  # with one waiting, a batch of 64 is not shed: it
    assert admission.try_admit(64) is None  # waits 65 / 11.25 s (the failed queue: 31 s)
    assert admission.num_waiting == 65


def test_while_a_mostly_failed_queue_lasts_the_estimate_uses_the_rate_before_it():
    clock = Clock()
    admission = Admission(max_wait_s=30.0, clock=clock)
    run_queued(admission, clock, num_requests=8, start_s=0.1)
    rate = admission.start_rate()
    assert admission.try_admit(300) is None  # admitted on an idle server
    assert admission.try_admit(2) is None  # two ordinary requests behind it (302 / 11.25 s)
    clock.now += 5.0
    for _ in range(3):
        admission.start()
    for _ in range(297):  # refused by Serve's queues
        admission.leave()
    assert admission.num_waiting == 2
    assert admission.start_rate() == pytest.approx(rate)
    clock.now += 0.1
    admission.start()
    admission.start()  # the queue ends having lost more than it started: not measured
    assert admission.start_rate() == pytest.approx(rate)


def test_a_queue_that_mostly_started_is_measured_with_its_leaves():
    clock = Clock()
    admission = Admission(max_wait_s=30.0, clock=clock)
    assert admission.try_admit(4) is None
    clock.now += 1.0
    for _ in range(3):
        admission.start()
    admission.leave()
    assert admission.start_rate() == pytest.approx(4 / 1.0)


def test_lone_waiting_that_ends_in_a_leave_is_not_measured():
    clock = Clock()
    admission = Admission(max_wait_s=30.0, clock=clock, parallelism=4)
    run_sequentially(admission, clock, num_requests=2, start_s=1.0)
    assert admission.try_admit() is None
    clock.now += 100.0  # it fails after a long time, unstarted
    admission.leave()
    assert admission.start_rate() == pytest.approx(1.0 * 4)


def test_an_idle_server_admits_a_request_whatever_its_estimate():
    clock = Clock()
    admission = Admission(max_wait_s=2.0, clock=clock)
    run_queued(admission, clock, num_requests=1, start_s=1.0)  # 2 starts per second
    assert admission.num_waiting == 0
    assert admission.try_admit(64) is None  # 32 s to start the last: no wait makes it shorter
    assert admission.try_admit() == Refusal(pytest.approx(65 / 2), math.ceil(65 / 2 - 2.0))


def test_a_request_of_several_runs_is_admitted_or_refused_whole():
    clock = Clock()
    admission = Admission(max_wait_s=3.0, clock=clock)
    run_queued(admission, clock, num_requests=1, start_s=1.0)  # 2 starts per second
    assert admission.try_admit(2) is None
    assert admission.try_admit(4) is None  # the last of the six starts in 3 s
    refusal = admission.try_admit(2)
    assert refusal == Refusal(pytest.approx(8 / 2), math.ceil(8 / 2 - 3.0))
    assert admission.num_waiting == 6  # none of the refused request's runs waits


def test_retry_after_of_a_request_that_fits_the_bound_only_alone_is_the_time_to_drain():
    clock = Clock()
    admission = Admission(max_wait_s=3.0, clock=clock)
    run_queued(admission, clock, num_requests=1, start_s=1.0)  # 2 starts per second
    assert admission.try_admit(4) is None
    refusal = admission.try_admit(10)  # 5 s alone: admitted once the 4 ahead have started
    assert refusal == Refusal(pytest.approx(14 / 2), math.ceil(4 / 2))


def test_a_waiter_starts_or_leaves_once():
    admission = Admission(max_wait_s=None, clock=Clock())
    assert admission.try_admit(2) is None
    started, left = Waiter(admission), Waiter(admission)
    started.start()
    started.leave()
    left.leave()
    left.start()
    assert admission.num_waiting == 0


class ChoiceIngress(IngressClass):
    """The ingress's choices path alone, over a colocated pipeline of stand-in engines."""

    def __init__(self, engines: Engines, admission: Admission):
        self.source = SimpleNamespace(served_model_name="tiny")
        self.prompts = SimpleNamespace(tool_call_formats=ALL_FORMATS)
        self.pipeline = ColocatedPipeline(engines, Metrics(), admission)

    async def serve_async(self, request: CompletionRequest):
        singles = [request.for_prompt(prompt) for prompt in request.prompts]
        built = [([1, 2], SamplingParams(max_tokens=2)) for _ in singles]
        return await self._serve_choices(request, "cmpl-1", singles, built, chat=False)

    def serve(self, request: CompletionRequest):
        return asyncio.run(self.serve_async(request))


def test_the_choices_of_a_failed_request_all_stop_waiting():
    clock = Clock()
    admission = Admission(max_wait_s=30.0, clock=clock)
    refused_one = Stream([], fail=BackPressureError(9, 8))
    engines = Engines([refused_one] + [Stream([7, 8]) for _ in range(5)])
    request = CompletionRequest(model="tiny", prompt=["a", "b"], n=3, max_tokens=2)
    with pytest.raises(OpenAIError) as caught:
        ChoiceIngress(engines, admission).serve(request)
    assert caught.value.code == "overloaded" and admission.num_waiting == 0


def test_the_choices_of_a_request_cancelled_before_they_ran_stop_waiting():
    admission = Admission(max_wait_s=30.0, clock=Clock())
    engines = Engines([Stream([7, 8]) for _ in range(6)])
    ingress = ChoiceIngress(engines, admission)
    request = CompletionRequest(model="tiny", prompt=["a", "b"], n=3, max_tokens=2)

    async def client_goes_away():
        served = asyncio.create_task(ingress.serve_async(request))
        await asyncio.sleep(0)  # it admits the choices and hands them to their tasks
        served.cancel()
        with pytest.raises(asyncio.CancelledError):
            await served

    asyncio.run(client_goes_away())
    assert engines.requests == [] and admission.num_waiting == 0


class TickingClock(Clock):
    """10 ms pass between any two readings."""

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


def test_the_choices_of_a_request_are_admitted_together_and_start_as_one_queue():
    admission = Admission(max_wait_s=30.0, clock=TickingClock())
    engines = Engines([Stream([7, 8]) for _ in range(6)])
    request = CompletionRequest(model="tiny", prompt=["a", "b"], n=3, max_tokens=2)
    reply = ChoiceIngress(engines, admission).serve(request)
    assert [choice["index"] for choice in json.loads(reply.body)["choices"]] == list(range(6))
    assert admission.num_waiting == 0 and math.isfinite(admission.start_rate())

    admission.try_admit()  # one waits: the next request of 6 is shed whole
    admission.max_wait_s = 6 / admission.start_rate()
    ingress = ChoiceIngress(Engines([]), admission)
    with pytest.raises(OpenAIError) as caught:
        ingress.serve(request)
    assert caught.value.status == 503 and "request's 6 choices" in caught.value.message
    assert ingress.pipeline.metrics.statuses == ["shed"] and admission.num_waiting == 1


@pytest.mark.parametrize(
    ("num_prompts", "n", "param", "asked"),
    [(5, 2, "n", "10 choices (5 prompts x n=2)"), (9, 1, "prompt", "9 choices (9 prompts x n=1)"),
     (1, 9, "n", "9 choices (n=9)")],
)  # fmt: skip
def test_a_request_of_more_choices_than_serve_can_queue_is_a_400_naming_n_or_prompt(
    num_prompts, n, param, asked
):
    phases = {"prefill": PhaseConfig(max_queued_requests=8), "decode": PhaseConfig()}
    limit = ChoiceLimit.of(phases)
    assert limit == ChoiceLimit(8, "prefill.max_queued_requests")
    limit.check(num_prompts=4, n=2)  # 8: fits
    with pytest.raises(OpenAIError) as caught:
        limit.check(num_prompts, n)
    error = caught.value
    assert error.status == 400 and error.param == param and asked in error.message
    assert "prefill.max_queued_requests" in error.message


def test_a_shed_request_is_logged_in_one_line(caplog):
    from rayinfer.deployments.errors import as_openai_error
    from rayinfer.deployments.pipeline import refused

    try:
        raise refused(Refusal(40.0, 10), 30.0, num_runs=64)
    except OpenAIError as error:
        with caplog.at_level(logging.WARNING, logger="rayinfer.deployments.errors"):
            answer = as_openai_error(error, "cmpl-1")
    assert answer.status == 503 and answer.retry_after_s == 10
    (record,) = caplog.records
    assert record.exc_info is None and "cmpl-1" in record.getMessage()
