"""The colocated request path (`ColocatedPipeline`) against stand-in Engine handles, no Ray: the
first token retried once on another replica, a mid-stream death resumed from the sent tokens,
back-pressure as 503, and a stream left early cancelled on the replica."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import ray
from ray.serve.exceptions import BackPressureError

from rayinfer.deployments.engine_loop import EngineStoppedError
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.pipeline import ColocatedPipeline
from rayinfer.deployments.types import DecodeChunk, EngineRequest, Timings
from rayinfer.engine.sampling_params import SamplingParams

GONE = ray.exceptions.RayActorError


class Metric:
    def observe(self, *args, **kwargs):
        pass


class Metrics:
    tags: dict = {}

    def __init__(self):
        self.statuses: list[str] = []
        self.ttft = self.inter_token_latency = Metric()

    def count_request(self, status: str) -> None:
        self.statuses.append(status)

    def add_tokens(self, num_prompt: int, num_generated: int) -> None:
        self.num_tokens = (num_prompt, num_generated)

    def observe_token_gap(self, seconds: float, num_tokens: int) -> None:
        pass


@dataclass
class Stream:
    """A replica's stream: `tokens` one chunk each (or the `chunks` given), then `fail` (an
    exception) or the end."""

    tokens: list[int]
    fail: BaseException | None = None
    cancelled: bool = False
    chunks: list[DecodeChunk] | None = None

    def __post_init__(self):
        self._chunks = self._run()

    async def _run(self):
        for index, token in enumerate(self.tokens):
            last = index == len(self.tokens) - 1 and self.fail is None
            yield DecodeChunk(f"<{token}>", [token], "length" if last else None)
        for chunk in self.chunks or []:
            yield chunk
        if self.fail is not None:
            raise self.fail

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self._chunks)

    def cancel(self):
        self.cancelled = True


@dataclass
class Engines:
    """`handle.options(stream=True).generate.remote(request)`: the next planned stream."""

    planned: list[Stream]
    requests: list[EngineRequest] = field(default_factory=list)

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request: EngineRequest) -> Stream:
        self.requests.append(request)
        return self.planned[len(self.requests) - 1]


def run(engines: Engines, max_tokens: int = 4, num_deltas: int | None = None):
    metrics = Metrics()
    pipeline = ColocatedPipeline(engines, metrics)
    timings = Timings()

    async def collect():
        deltas = pipeline.run("req", [1, 2, 3], SamplingParams(max_tokens=max_tokens), timings)
        taken = []
        async for delta in deltas:
            taken.append(delta)
            if num_deltas is not None and len(taken) == num_deltas:
                break
        await deltas.aclose()
        return taken

    return asyncio.run(collect()), metrics, timings


def test_one_replica_streams_the_whole_request():
    engines = Engines([Stream([7, 8, 9, 10])])
    deltas, metrics, timings = run(engines)
    assert [d.token_ids for d in deltas] == [[7], [8], [9], [10]]
    assert deltas[-1].finish_reason == "length" and metrics.statuses == ["ok"]
    assert metrics.num_tokens == (3, 4) and timings.ttft_s > 0 and not timings.was_resumed


def test_a_replica_gone_before_the_first_token_is_retried_once():
    engines = Engines([Stream([], fail=GONE()), Stream([7, 8, 9, 10])])
    deltas, _, _ = run(engines)
    assert [d.token_ids[0] for d in deltas] == [7, 8, 9, 10]
    assert [r.prompt_token_ids for r in engines.requests] == [[1, 2, 3], [1, 2, 3]]
    with pytest.raises(GONE):
        run(Engines([Stream([], fail=GONE()), Stream([], fail=GONE())]))


def test_a_replica_gone_mid_stream_resumes_from_the_sent_tokens():
    engines = Engines([Stream([7, 8], fail=GONE()), Stream([9, 10])])
    deltas, metrics, timings = run(engines)
    assert [d.token_ids[0] for d in deltas] == [7, 8, 9, 10]
    resumed = engines.requests[1]
    assert resumed.request_id == "req-resumed"
    assert resumed.prompt_token_ids == [1, 2, 3, 7, 8] and resumed.params.max_tokens == 2
    assert timings.was_resumed and metrics.statuses == ["ok"]
    assert engines.planned[0].cancelled  # the dead stream is let go


def engine_stopped() -> ray.exceptions.RayTaskError:
    """What a replica whose engine stopped (a worker died) answers, as Ray wraps it."""
    return ray.exceptions.RayTaskError("generate", "", EngineStoppedError("ActorDiedError()"))


def test_a_replica_whose_engine_stopped_counts_as_lost_before_and_after_the_first_token():
    engines = Engines([Stream([], fail=engine_stopped()), Stream([7, 8], fail=engine_stopped()),
                       Stream([9, 10])])  # fmt: skip
    deltas, _, timings = run(engines)
    assert [d.token_ids[0] for d in deltas] == [7, 8, 9, 10] and timings.was_resumed
    assert [r.prompt_token_ids for r in engines.requests] == [[1, 2, 3], [1, 2, 3], [1, 2, 3, 7, 8]]


def test_back_pressure_is_503_and_any_other_failure_ends_the_stream():
    with pytest.raises(OpenAIError) as caught:
        run(Engines([Stream([], fail=BackPressureError(9, 8))]))
    assert caught.value.status == 503 and caught.value.code == "overloaded"
    with pytest.raises(RuntimeError, match="boom"):
        run(Engines([Stream([7], fail=RuntimeError("boom"))]))


def test_leaving_early_cancels_the_replicas_stream():
    engines = Engines([Stream([7, 8, 9, 10])])
    deltas, metrics, _ = run(engines, num_deltas=2)
    assert len(deltas) == 2 and engines.planned[0].cancelled
    assert metrics.statuses == ["abort"]
