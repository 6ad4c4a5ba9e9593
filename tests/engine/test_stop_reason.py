"""vLLM's stop_reason on the offline outputs, on the built-in tiny model (float32 on the CPU):
the stop_token_ids entry or the stop string that ended a request, None for EOS and length; the
same under preemption and through the prefill -> decode hand-off, whichever side decides."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import rayinfer
from rayinfer.models.tiny import EOS_ID

SamplingParams = rayinfer.SamplingParams
TEXTS = ["The quick brown fox jumps over the lazy dog and the", "Hello, how are you? I am"]
GREEDY = dict(max_tokens=12, temperature=0)


@dataclass
class Case:
    prompt: list[int]
    params: SamplingParams
    finish_reason: str
    stop_reason: int | str | None


@pytest.fixture(scope="module")
def llm():
    return rayinfer.LLM("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def free(llm, prompts):
    """Each prompt's 12 greedy tokens and their text, EOS ignored."""
    return llm.generate(prompts, SamplingParams(**GREEDY, ignore_eos=True))


def stop_string_at(llm, output, token_index: int) -> str:
    """A 3-character stop string starting where token `token_index`'s text starts, found nowhere
    earlier in the text."""
    start = len(llm.tokenizer.decode(output.token_ids[:token_index]))
    for at in range(start, len(output.text) - 3):
        stop = output.text[at : at + 3]
        if output.text.find(stop) == at and "\ufffd" not in stop:
            return stop
    pytest.skip("no stop string in this text")


def new_token_step(tokens: list[int]) -> int:
    """A step >= 5 whose greedy token did not appear before it (and is no EOS)."""
    return next(k for k in range(5, len(tokens)) if tokens[k] not in tokens[:k] + [1, 3])


@pytest.fixture(scope="module")
def cases(llm, prompts, free) -> dict[str, Case]:
    first, second = prompts
    tokens = list(free[1].token_ids)
    stop_id = tokens[new_token_step(tokens)]
    stop = stop_string_at(llm, free[0], 6)
    early = stop_string_at(llm, free[1], 1)
    forced_eos = {EOS_ID: 100.0}
    return {
        "stop token": Case(second, SamplingParams(**GREEDY, stop_token_ids=[stop_id]),
                           "stop", stop_id),
        "stop string": Case(first, SamplingParams(**GREEDY, stop=["never seen", stop]),
                            "stop", stop),
        "stop string kept": Case(first, SamplingParams(**GREEDY, stop=stop,
                                                       include_stop_str_in_output=True),
                                 "stop", stop),
        # the text is cut at the stop string, before the stop token comes
        "stop string before a stop token": Case(
            second, SamplingParams(**GREEDY, stop=early, stop_token_ids=[tokens[-1]]),
            "stop", early),
        "eos": Case(first, SamplingParams(**GREEDY, logit_bias=forced_eos, min_tokens=6),
                    "stop", None),
        "eos listed, ignore_eos": Case(
            first, SamplingParams(**GREEDY, logit_bias=forced_eos, min_tokens=6,
                                  ignore_eos=True, stop_token_ids=[EOS_ID]),
            "stop", EOS_ID),
        "length": Case(second, SamplingParams(**GREEDY, ignore_eos=True), "length", None),
        # min_tokens: the stop string at the start is not looked for, so it runs to length
        "stop string under min_tokens": Case(
            second, SamplingParams(**GREEDY, ignore_eos=True, stop=early, min_tokens=12),
            "length", None),
    }  # fmt: skip


def reasons(outputs) -> list[tuple[str, int | str | None]]:
    return [(o.finish_reason, o.stop_reason) for o in outputs]


def expected(cases: dict[str, Case]) -> list[tuple[str, int | str | None]]:
    return [(c.finish_reason, c.stop_reason) for c in cases.values()]


def run(llm, cases: dict[str, Case]):
    return llm.generate([c.prompt for c in cases.values()], [c.params for c in cases.values()])


def test_each_way_to_end_gives_its_stop_reason(llm, cases):
    alone = [llm.generate(c.prompt, c.params)[0] for c in cases.values()]
    assert dict(zip(cases, reasons(alone))) == dict(zip(cases, expected(cases)))
    by_name = dict(zip(cases, alone))
    stop = cases["stop string"].stop_reason
    assert not by_name["stop string"].text.endswith(stop)
    assert by_name["stop string kept"].text.endswith(stop)
    assert by_name["eos listed, ignore_eos"].token_ids[-1] == EOS_ID


def test_stop_reasons_survive_preemption(llm, cases):
    """Each case beside a filler admitted with it, whose prompt fills the rest of the cache: the
    filler's first decode needs a block, so the case (the latest admitted) is preempted after
    its first token, recomputed once the filler is done, and then stops."""
    block_size, num_blocks = 2, 14
    tight = rayinfer.LLM("tiny", device="cpu", dtype="float32", block_size=block_size,
                         num_kv_blocks=num_blocks, max_model_len=block_size * num_blocks,
                         enable_prefix_caching=False)  # fmt: skip
    filler_params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for name, case in cases.items():
        case_blocks = -(-len(case.prompt) // block_size)
        filler = list(range(10, 10 + (num_blocks - case_blocks) * block_size))
        before = tight.engine.scheduler.num_preemptions
        _, output = tight.generate([filler, case.prompt], [filler_params, case.params])
        assert tight.engine.scheduler.num_preemptions > before, name
        assert reasons([output]) == [(case.finish_reason, case.stop_reason)], name
        assert output.token_ids == llm.generate(case.prompt, case.params)[0].token_ids, name


def test_stop_reasons_survive_the_hand_off(llm, cases):
    params = [c.params for c in cases.values()]
    handoffs = llm.prefill([c.prompt for c in cases.values()], params)
    assert all(h.finish_reason is None for h in handoffs)  # every stop is decode's
    decode = rayinfer.LLM("tiny", device="cpu", dtype="float32", block_size=8)
    outputs = decode.decode(handoffs, params)
    assert reasons(outputs) == expected(cases)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in run(llm, cases)]


def test_a_stop_on_the_prefills_first_token_is_handed_on(llm, prompts, free):
    first_id = free[0].token_ids[0]
    first_text = llm.tokenizer.decode([first_id])
    stop = first_text.strip()[:2]
    assert stop and stop in first_text
    params = [
        SamplingParams(**GREEDY, stop_token_ids=[first_id]),
        SamplingParams(**GREEDY, stop=stop),
        SamplingParams(**GREEDY, logit_bias={EOS_ID: 100.0}),
    ]
    handoffs = llm.prefill([prompts[0]] * 3, params)
    assert [(h.finish_reason, h.stop_reason) for h in handoffs] == [
        ("stop", first_id), ("stop", stop), ("stop", None)
    ]  # fmt: skip
    assert all(h.payload is None for h in handoffs)
    decode = rayinfer.LLM("tiny", device="cpu", dtype="float32")
    outputs = decode.decode(handoffs, params)
    assert reasons(outputs) == [("stop", first_id), ("stop", stop), ("stop", None)]
    # the prefill's whole output is what decode returns: its text and logprobs too
    kept = SamplingParams(**GREEDY, stop=stop, include_stop_str_in_output=True, logprobs=1)
    (output,) = decode.decode(llm.prefill([prompts[0]], kept), kept)
    (whole,) = llm.generate([prompts[0]], kept)
    assert output.text == whole.text == stop and output.token_ids == whole.token_ids
    assert output.logprobs == whole.logprobs and output.logprobs
