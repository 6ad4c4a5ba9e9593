"""vLLM's stop_reason from where the stop is decided to the OpenAI bodies, without Ray: the
Prefill, Decode and Engine replicas' own code over engine loops on the built-in tiny model, the
pipelines over stand-in handles, and the JSON of whole and streamed replies."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

import rayinfer
from rayinfer.deployments.decode import Decode
from rayinfer.deployments.engine import Engine
from rayinfer.deployments.pipeline import ColocatedPipeline, DisaggregatedPipeline
from rayinfer.deployments.prefill import Prefill
from rayinfer.deployments.protocol import ChatCompletionRequest, CompletionRequest
from rayinfer.deployments.replies import HttpReply
from rayinfer.deployments.types import Delta, Timings
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.models.tiny import EOS_ID
from tests.serve.test_colocated_pipeline import Metrics
from tests.serve.test_engine_loop import new_loop
from tests.serve.test_protocol import collect_events

CHAT = {"messages": [{"role": "user", "content": "x"}]}
TEXT = "The quick brown fox jumps over the lazy dog and the"
GREEDY = dict(max_tokens=10, temperature=0)


def replies(chat: bool, stream: bool, **fields) -> HttpReply:
    request = (ChatCompletionRequest(**CHAT, stream=stream, **fields) if chat
               else CompletionRequest(prompt="x", stream=stream))  # fmt: skip
    return HttpReply("id-1", "tiny", chat, request, 3)


async def ending(finish_reason: str, stop_reason):
    yield Delta("Hel", [1], None)
    yield Delta("lo", [2], finish_reason, stop_reason=stop_reason)


def whole_choice(reply: HttpReply, deltas) -> dict:
    body = asyncio.run(reply.whole(deltas, Timings()))
    return json.loads(json.dumps(body))["choices"][0]  # as the client reads it


def streamed_choices(reply: HttpReply, deltas) -> list[dict]:
    return [body["choices"][0] for body in collect_events(reply, deltas) if body["choices"]]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    "finish_reason, stop_reason", [("stop", 7), ("stop", "END"), ("stop", None), ("length", None)]
)
def test_whole_and_streamed_bodies_carry_the_stop_reason(chat, finish_reason, stop_reason):
    choice = whole_choice(replies(chat, False), ending(finish_reason, stop_reason))
    assert (choice["finish_reason"], choice["stop_reason"]) == (finish_reason, stop_reason)
    chunks = streamed_choices(replies(chat, True), ending(finish_reason, stop_reason))
    assert all("stop_reason" in c for c in chunks)  # null before the end, as vLLM's
    assert [(c["finish_reason"], c["stop_reason"]) for c in chunks] == (
        [(None, None)] * (len(chunks) - 1) + [(finish_reason, stop_reason)]
    )


def test_a_chat_offered_tools_keeps_the_stop_reason():
    tools = [{"type": "function", "function": {"name": "weather"}}]
    chunks = streamed_choices(replies(True, True, tools=tools), ending("stop", "END"))
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", "END")
    choice = whole_choice(replies(True, False, tools=tools), ending("stop", 7))
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 7)


# --- the replicas' own code over engine loops ------------------------------------------------
class Metric:
    def observe(self, *args, **kwargs):
        pass

    def inc(self, *args, **kwargs):
        pass


class ReplicaMetrics:
    tags: dict = {}
    ttft = kv_handoff_bytes = Metric()

    def add_tokens(self, *args):
        pass

    def observe_token_gap(self, *args):
        pass

    def observe_handoff(self, *args, **kwargs):
        pass


def replica(deployment, loop):
    """A Prefill, Decode or Engine replica over `loop`, without Serve or workers."""
    cls = deployment.func_or_class
    made = cls.__new__(cls)
    made.loop, made.metrics = loop, ReplicaMetrics()
    stats = SimpleNamespace(import_seconds={}, handoff_timings={}, lost_request_ids=set())
    made.workers = SimpleNamespace(stats=stats, workers=[])  # no workers to close at __del__
    return made


class Stream:
    """A replica's streaming call as a handle gives it."""

    def __init__(self, chunks):
        self.chunks = chunks

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self.chunks)

    def cancel(self):
        pass


class Handle:
    """`handle.options(stream=True).<method>.remote(request)`: the replica's call, here."""

    def __init__(self, call):
        self.remote = call

    def options(self, **_):
        return self

    def __getattr__(self, method: str):
        return self


@pytest.fixture(scope="module")
def llm():
    return rayinfer.LLM("tiny", max_model_len=128, num_kv_blocks=64)


@pytest.fixture(scope="module")
def pipelines(llm):
    loops = [new_loop(llm) for _ in range(3)]
    prefill, decode, engine = (
        replica(c, loop) for c, loop in zip((Prefill, Decode, Engine), loops)
    )
    disaggregated = DisaggregatedPipeline(
        Handle(prefill._prefill), Handle(lambda r: Stream(decode._generate(r))), Metrics()
    )
    colocated = ColocatedPipeline(Handle(lambda r: Stream(engine._generate(r))), Metrics())
    yield {"disaggregated": disaggregated, "colocated": colocated}
    for loop in loops:
        loop.stop()


@pytest.fixture(scope="module")
def cases(llm) -> dict[str, SamplingParams]:
    """Stops decided by decode and by the prefill's first token, EOS and length."""
    prompt = llm.tokenizer.encode(TEXT)
    tokens = llm.generate(prompt, SamplingParams(**GREEDY, ignore_eos=True))[0].token_ids
    later = next(k for k in range(3, len(tokens)) if tokens[k] not in tokens[:k])
    first_text = llm.tokenizer.decode(tokens[:1]).strip()
    later_text = llm.tokenizer.decode(tokens[later : later + 1]).strip()
    assert first_text and later_text and later_text not in llm.tokenizer.decode(tokens[:later])
    return {
        "stop token": SamplingParams(**GREEDY, stop_token_ids=[tokens[later]]),
        "stop string": SamplingParams(**GREEDY, stop=["never seen", later_text]),
        "first token's stop token": SamplingParams(**GREEDY, stop_token_ids=[tokens[0]]),
        "first token's stop string": SamplingParams(**GREEDY, stop=first_text),
        "eos": SamplingParams(**GREEDY, logit_bias={EOS_ID: 100.0}, min_tokens=2),
        "length": SamplingParams(**GREEDY, ignore_eos=True),
    }


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("chat", [False, True])
def test_the_replicas_stop_reason_reaches_the_bodies(llm, pipelines, cases, mode, chat):
    prompt = llm.tokenizer.encode(TEXT)
    pipeline = pipelines[mode]
    for name, params in cases.items():
        (offline,) = llm.generate(prompt, params)
        assert offline.finish_reason in ("stop", "length"), name
        expected = (offline.finish_reason, offline.stop_reason)
        assert (expected[1] is not None) == name.endswith(("stop token", "stop string")), name
        run = pipeline.run(f"{mode}-{chat}-{name}", prompt, params, Timings())
        choice = whole_choice(replies(chat, False), run)
        assert (choice["finish_reason"], choice["stop_reason"]) == expected, name
        run = pipeline.run(f"{mode}-{chat}-{name}-streamed", prompt, params, Timings())
        last = streamed_choices(replies(chat, True), run)[-1]
        assert (last["finish_reason"], last["stop_reason"]) == expected, name
