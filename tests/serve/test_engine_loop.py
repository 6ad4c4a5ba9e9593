"""EngineLoop: one thread drives the engine; callers stream, hand off, cancel, fail alone."""

from __future__ import annotations

import asyncio
import time

import pytest

import rayinfer
from rayinfer.deployments.engine_loop import EngineLoop
from rayinfer.engine.engine import LLMEngine
from rayinfer.engine.sampling_params import InvalidRequestError, SamplingParams

PROMPTS = [[5, 17, 42, 99], [7, 123], [64, 8, 250, 31, 11, 12], [300]]


@pytest.fixture(scope="module")
def llm():
    return rayinfer.LLM("tiny", max_model_len=128, num_kv_blocks=64)


def new_loop(llm, **callbacks) -> EngineLoop:
    from rayinfer.workers.in_process import InProcessExecutor

    executor = InProcessExecutor(llm.spec)
    engine = LLMEngine(
        llm.model_config, llm.cache_config, llm.engine.scheduler_config, executor, llm.tokenizer
    )
    return EngineLoop(engine, name="test-loop", **callbacks)


async def final_output(loop, request_id, prompt, params, prefill_only=False):
    last = None
    async for event in loop.generate(request_id, prompt, params, prefill_only):
        last = event
    return last


def test_concurrent_streams_equal_offline(llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    offline = llm.generate(PROMPTS, params)
    loop = new_loop(llm)

    async def run():
        return await asyncio.gather(
            *(final_output(loop, f"r{i}", p, params) for i, p in enumerate(PROMPTS))
        )

    events = asyncio.run(run())
    loop.stop()
    assert [e.output.token_ids for e in events] == [o.token_ids for o in offline]
    assert [e.output.text for e in events] == [o.text for o in offline]


def test_prefill_hands_off_to_a_second_loop(llm):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = llm.generate(PROMPTS[0], params)[0].token_ids
    prefill, decode = new_loop(llm), new_loop(llm)

    async def run():
        first = await final_output(prefill, "h0", PROMPTS[0], params, prefill_only=True)
        assert first.output.finish_reason == "prefilled"
        assert first.handoff.num_bytes > 0
        token_ids = list(first.output.token_ids)
        async for event in decode.continue_prefilled(first.handoff, params):
            token_ids += event.output.new_token_ids
        return token_ids

    assert asyncio.run(run()) == expected
    prefill.stop()
    decode.stop()


def test_leaving_a_stream_aborts_the_request(llm):
    loop = new_loop(llm)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def read_two_then_leave():
        stream = loop.generate("long", PROMPTS[1], params, False)
        await anext(stream)
        await anext(stream)
        await stream.aclose()

    asyncio.run(read_two_then_leave())
    deadline = time.monotonic() + 30
    while loop.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not loop.engine.has_unfinished_requests()
    loop.stop()


def test_an_invalid_request_fails_alone(llm):
    loop = new_loop(llm)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def run():
        return await asyncio.gather(
            final_output(loop, "bad", [], params),
            final_output(loop, "good", PROMPTS[0], params),
            return_exceptions=True,
        )

    bad, good = asyncio.run(run())
    assert isinstance(bad, InvalidRequestError) and bad.field == "prompt"
    assert good.output.finish_reason == "length" and len(good.output.token_ids) == 4
    assert loop.is_healthy
    loop.stop()


def test_an_engine_failure_ends_every_request_and_marks_the_loop_unhealthy(llm):
    heard = []  # on_fatal's error, and the requests still waiting to hear of it then
    loop = new_loop(llm, on_fatal=lambda error: heard.append((error, len(loop.streams))))

    def lost_device(batch):
        raise RuntimeError("device lost")

    loop.engine.executor.execute = lost_device
    params = SamplingParams(max_tokens=4, temperature=0)

    async def run():
        return await asyncio.gather(
            *(final_output(loop, f"f{i}", p, params) for i, p in enumerate(PROMPTS)),
            return_exceptions=True,
        )

    results = asyncio.run(run())
    assert all(isinstance(r, RuntimeError) and "device lost" in str(r) for r in results)
    assert len(heard) == 1 and "device lost" in str(heard[0][0]) and heard[0][1] >= 1
    assert not loop.is_healthy
    with pytest.raises(RuntimeError, match="engine loop stopped"):
        asyncio.run(final_output(loop, "late", PROMPTS[0], params))


def test_a_request_the_engine_fails_raises_request_failed_and_the_loop_goes_on(llm):
    from dataclasses import replace

    from rayinfer.engine.outputs import RequestFailedError

    loop = new_loop(llm)
    good = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    bad = replace(good, temperature=0.8)
    object.__setattr__(bad, "seed", 2**64)  # past validation: torch's manual_seed refuses it

    async def run():
        return await asyncio.gather(
            final_output(loop, "bad", PROMPTS[1], bad),
            final_output(loop, "good", PROMPTS[0], good),
            return_exceptions=True,
        )

    failed, completed = asyncio.run(run())
    assert isinstance(failed, RequestFailedError) and "seed" in failed.reason
    assert completed.output.token_ids == llm.generate(PROMPTS[0], good)[0].token_ids
    assert loop.is_healthy
    after = asyncio.run(final_output(loop, "after", PROMPTS[0], good))
    assert after.output.finish_reason == "length"
    loop.stop()


def test_a_caller_that_falls_behind_gets_the_steps_it_missed_in_one_event(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    [expected] = llm.generate([PROMPTS[0]], params)
    loop = new_loop(llm)

    async def run():
        events = []
        async for event in loop.generate("slow", PROMPTS[0], params, False):
            events.append(event)
            await asyncio.sleep(0.05)  # the engine steps on meanwhile
        return events

    events = asyncio.run(run())
    loop.stop()
    tokens = [token for event in events for token in event.output.new_token_ids]
    assert tokens == expected.token_ids
    assert "".join(event.output.new_text for event in events) == expected.text
    logprobs = [entry for event in events for entry in event.output.new_logprobs]
    assert logprobs == list(expected.logprobs)
    assert len(events) < len(tokens)  # several steps' tokens came together
    assert events[-1].output.finished and sum(e.output.finished for e in events) == 1


def test_a_chunk_interval_merges_the_steps_between_a_streams_events(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    [expected] = llm.generate([PROMPTS[0]], params)
    loop = new_loop(llm, chunk_interval_s=0.1)

    async def run():
        events, sent_at = [], []
        async for event in loop.generate("paced", PROMPTS[0], params, False):
            events.append(event)
            sent_at.append(asyncio.get_running_loop().time())
        return events, sent_at

    events, sent_at = asyncio.run(run())
    loop.stop()
    tokens = [token for event in events for token in event.output.new_token_ids]
    assert tokens == expected.token_ids
    assert "".join(event.output.new_text for event in events) == expected.text
    assert len(events) < len(tokens)  # several steps' tokens came together
    # The interval is a floor between events (the clock's resolution aside); the last one, the
    # finish, is sent at once.
    gaps = [later - earlier for earlier, later in zip(sent_at[:-2], sent_at[1:-1])]
    assert all(gap >= 0.1 - 1e-3 for gap in gaps)
    assert events[-1].output.finished and sum(e.output.finished for e in events) == 1


def test_each_step_is_timed_with_its_prompt_tokens(llm):
    """The loop keeps every model step's start, seconds and prompt tokens for the replica's step
    metric and log: the prompt's step, then the steps of its decodes alone."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    loop = new_loop(llm)
    asyncio.run(final_output(loop, "r0", PROMPTS[2], params))
    loop.stop()
    loop.thread.join(timeout=10)
    times = loop.take_step_times()
    assert [tokens for _, _, tokens in times] == [len(PROMPTS[2]), 0, 0, 0]
    assert all(seconds > 0 for _, seconds, _ in times)
    starts = [start for start, _, _ in times]
    assert starts == sorted(starts) and starts[-1] <= time.monotonic()
    assert loop.take_step_times() == []
