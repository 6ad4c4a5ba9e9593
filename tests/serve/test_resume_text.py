"""A stream resumed on another replica keeps the text the first replica would have sent: what it
held back at the cut (part of a character, a stop string's start) and a stop string across it."""

from __future__ import annotations

import asyncio

import pytest

import rayinfer
from rayinfer.deployments.pipeline import ColocatedPipeline
from rayinfer.deployments.resume import ResumedText, TextRules
from rayinfer.deployments.types import DecodeChunk, Delta, Timings
from rayinfer.engine.request_state import RequestState
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine.sequence import Sequence
from rayinfer.engine.stop_checker import eos_token_ids
from tests.serve.test_colocated_pipeline import GONE, Engines, Metrics, Stream

PROMPT = [5, 17, 42, 99]
MAX_LEN = 128


@pytest.fixture(scope="module")
def llm():
    return rayinfer.LLM("tiny", max_model_len=MAX_LEN, num_kv_blocks=64)


@pytest.fixture(scope="module")
def rules(llm):
    return TextRules(llm.tokenizer, frozenset(eos_token_ids(llm.model_config, llm.tokenizer)),
                     MAX_LEN)  # fmt: skip


def streamed(llm, rules, prompt, params, tokens) -> list[str]:
    """Each token's text as an engine streams it (held back while a character or a possible
    stop string is unfinished)."""
    state = RequestState(Sequence("first", list(prompt), params), llm.tokenizer)
    texts = []
    for token in tokens:
        reason = state.append_token(token, set(rules.eos_token_ids), rules.max_model_len)
        assert reason is None
        texts.append(state.take_output().new_text)
    return texts


def test_part_of_a_character_held_at_the_cut_is_sent_after_it(llm, rules):
    tokens = llm.tokenizer.encode("ab🙂cd")[1:]  # no BOS; the emoji is 4 byte tokens
    params = SamplingParams(max_tokens=len(tokens))
    cut = 4  # after "a", "b" and two of the emoji's four bytes
    sent_text = "".join(streamed(llm, rules, PROMPT, params, tokens[:cut]))
    assert sent_text == "ab"  # the half character is held back
    resumed = ResumedText(rules, PROMPT, params, tokens[:cut], sent_text)
    rest = [resumed.next(Delta("?", [token], None)).text for token in tokens[cut:]]
    assert sent_text + "".join(rest) == "ab🙂cd"


def stop_across(text: str, cut_chars: int) -> str:
    """A stop string starting 2 characters before `cut_chars` and ending 3 after, found nowhere
    earlier in text."""
    for start in range(cut_chars - 2, 0, -1):
        stop = text[start : start + 5]
        if start + 5 > cut_chars and text.find(stop) == start and stop.strip():
            return stop
    pytest.skip("no stop string across the cut in this text")


def test_a_stop_string_across_the_cut_ends_the_resumed_stream(llm, rules):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    [whole] = llm.generate([PROMPT], free)
    cut = 10
    head = "".join(streamed(llm, rules, PROMPT, free, whole.token_ids[:cut]))
    stop = stop_across(whole.text, len(head))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    [expected] = llm.generate([PROMPT], params)
    assert expected.finish_reason == "stop" and len(expected.token_ids) > cut
    texts = streamed(llm, rules, PROMPT, params, whole.token_ids[:cut])
    sent = [DecodeChunk(text, [token], None) for text, token in zip(texts, whole.token_ids)]
    first = Stream([], fail=GONE(), chunks=sent)
    # The other replica knows nothing of the text before: its own would be wrong.
    rest = whole.token_ids[cut:]
    second = Stream(rest)
    engines = Engines([first, second])
    pipeline = ColocatedPipeline(engines, Metrics())
    pipeline.text_rules = rules

    async def collect():
        return [delta async for delta in pipeline.run("req", PROMPT, params, Timings())]

    deltas = asyncio.run(collect())
    assert "".join(d.text for d in deltas) == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert engines.requests[1].prompt_token_ids == PROMPT + whole.token_ids[:cut]
    assert second.cancelled  # stopped before that replica's own end
