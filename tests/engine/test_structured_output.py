"""Structured outputs on the CPU: the grammar's token masks, the sampler applying them, the
matcher rebuilt from a hand-off's tokens, and the engine ending a request whose grammar is done."""

from __future__ import annotations

import json

import pytest
import torch

from rayinfer import LLM, SamplingParams
from rayinfer.engine.batch import ScheduledRequest
from rayinfer.engine.structured_output import StructuredOutput
from rayinfer.engine.tokenizer import Tokenizer
from rayinfer.layers.sampler import apply_token_bitmask
from rayinfer.models.tiny import EOS_ID, IM_END_ID, ensure_tiny_model
from rayinfer.workers.runner.grammar_matchers import GrammarMatchers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def tokenizer(tiny_path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def _request(structured, history=None, request_id="r") -> ScheduledRequest:
    params = SamplingParams(max_tokens=64, structured_output=structured)
    return ScheduledRequest(request_id, [5], 0, [0], True, params, grammar_token_ids=history)


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


def _matchers(tiny_path, vocab=1000) -> GrammarMatchers:
    return GrammarMatchers(tiny_path, vocab, [EOS_ID], pin=False)


def test_mask_allows_exactly_the_tokens_that_keep_a_choice_possible(tiny_path, tokenizer):
    choices = ["yes", "no way"]
    matchers = _matchers(tiny_path)
    request = _request(StructuredOutput.choice(choices))
    allowed = _allowed(matchers.masks([request]).bitmask[0], 1000)
    expected = {
        i
        for i in range(1000)
        if (text := tokenizer.decode([i], skip_special_tokens=False))
        and any(c.startswith(text) for c in choices)
        and i not in tokenizer.all_special_ids
    }
    assert allowed == expected


def test_length_bounded_json_strings_hold_no_control_characters(tiny_path, tokenizer):
    structured = StructuredOutput.json_schema(SCHEMA)
    prefix = tokenizer.encode('{"name": "', add_special_tokens=False)
    matchers = _matchers(tiny_path)
    allowed = _allowed(matchers.masks([_request(structured, prefix)]).bitmask[0], 1000)
    texts = [tokenizer.decode([i]) for i in allowed]
    assert texts and not [t for t in texts if any(ord(c) < 0x20 for c in t)]
    assert not [t for t in texts if "\\" in t or ('"' in t and t != '"')]


def test_apply_token_bitmask_forbids_every_masked_token():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # logits row 2: tokens 1 and 3
    bitmask[1, 2] = 1 << 3  # logits row 0: token 67
    apply_token_bitmask(logits, bitmask, [2, 0])
    assert torch.equal(logits[1], before[1])  # a row without a grammar is untouched
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [67]
    assert logits[2, 1] == before[2, 1] and logits[0, 67] == before[0, 67]


def test_a_matcher_rebuilt_from_the_handoff_tokens_masks_as_the_original(tiny_path, tokenizer):
    structured = StructuredOutput.json_schema(SCHEMA)
    history = tokenizer.encode('{"name": "ab", "age": 4', add_special_tokens=False)
    original = _matchers(tiny_path)
    original.masks([_request(structured, [])])
    for token in history:
        assert original.matchers["r"].accept_token(token)
    rebuilt = _matchers(tiny_path)
    assert torch.equal(
        original.masks([_request(structured)]).bitmask,
        rebuilt.masks([_request(structured, history)]).bitmask,
    )
    mismatch = tokenizer.encode("[", add_special_tokens=False)
    assert _matchers(tiny_path).masks([_request(structured, mismatch)]).errors


def test_json_schema_outputs_validate_for_20_seeds(llm):
    structured = StructuredOutput.json_schema(SCHEMA)
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=seed, structured_output=structured)
        for seed in range(20)
    ]
    for output in llm.generate(["Tell me about"] * 20, params):
        value = json.loads(output.text)
        assert set(value) == {"name", "age", "ok"} and len(value["name"]) <= 8
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 99
        assert output.finish_reason == "stop"
        assert output.token_ids[-1] in (EOS_ID, IM_END_ID)


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(
        max_tokens=50, temperature=1.0, seed=1, ignore_eos=True,
        structured_output=StructuredOutput("regex", "[a-z]{3}-[0-9]{2}"),
    )  # fmt: skip
    output = llm.generate(["Tell me about"], params)[0]
    assert output.finish_reason == "stop" and len(output.token_ids) < 50
    assert len(output.text) == 6 and output.text[3] == "-" and output.text[4:].isdigit()


def test_requests_without_a_grammar_sample_as_before(llm):
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.generate(["Once upon a time"], plain)[0].token_ids
    mixed = llm.generate(
        ["Once upon a time", "Tell me about"],
        [plain, SamplingParams(max_tokens=12, structured_output=StructuredOutput("json_object"))],
    )
    assert mixed[0].token_ids == alone
    assert mixed[1].text.startswith("{")


@pytest.mark.parametrize(
    "structured, message",
    [
        (StructuredOutput.json_schema({"type": "intege"}), 'Unsupported type "intege"'),
        (StructuredOutput("json_schema", "{nope"), "is not JSON"),
        (StructuredOutput("regex", "a(b"), "parenthesis is not closed"),
        (StructuredOutput.choice([]), "non-empty list"),
    ],
)
def test_check_names_what_is_wrong(structured, message):
    with pytest.raises(ValueError) as error:
        structured.check()
    assert message in str(error.value) and "cpp" not in str(error.value)
