"""Grammar masks keep byte-level outputs valid UTF-8: the tails against Python's own decoder, and
a grammar whose class xgrammar lets run into a surrogate."""

from __future__ import annotations

import random

import torch

from rayinfer import LLM, SamplingParams
from rayinfer.engine.batch import ScheduledRequest
from rayinfer.engine.structured_output import StructuredOutput
from rayinfer.engine.tokenizer import Tokenizer
from rayinfer.models.tiny import EOS_ID, ensure_tiny_model
from rayinfer.workers.runner.grammar_matchers import GrammarMatchers
from rayinfer.workers.runner.utf8_tails import CLOSED, TAILS, Utf8Tails, extend


def _sequences():
    """Every 1- and 2-byte sequence, and 3- and 4-byte ones over every lead and second byte."""
    yield from (bytes([a]) for a in range(256))
    yield from (bytes([a, b]) for a in range(0xC0, 0x100) for b in range(256))
    for a in range(0xE0, 0x100):
        for b in range(256):
            for c in (0x7F, 0x80, 0xBF, 0xC0):
                yield bytes([a, b, c])
                yield bytes([a, b, c, 0x80])


def _decodes(data: bytes) -> str:
    """ "whole", "prefix" (the start of valid UTF-8, cut short) or "invalid", as Python says."""
    try:
        data.decode()
        return "whole"
    except UnicodeDecodeError as error:
        cut_short = error.reason == "unexpected end of data" and error.end == len(data)
        return "prefix" if cut_short else "invalid"


def test_tails_agree_with_the_python_decoder():
    for data in _sequences():
        tail = extend(CLOSED, data)
        expected = _decodes(data)
        got = "whole" if tail == CLOSED else "prefix" if tail is not None else "invalid"
        assert got == expected, f"{data!r}: {got}, Python: {expected}"
        assert tail is None or tail in TAILS


def test_each_tails_mask_holds_the_tokens_that_continue_it_validly():
    rng = random.Random(0)
    vocab = [
        bytes(rng.choice(range(0x7E, 0xF6)) for _ in range(rng.randint(1, 3))) for _ in range(300)
    ]
    vocab += [b"ab", b"\xed\xa0\x80", b"\xe4\xb8\x80", b"\xf0\x9f\x98\x80", b"\xf0\x9f"]
    tails = Utf8Tails(vocab, vocab_size=len(vocab) + 20)  # ids past the tokenizer's: never
    assert tails.masks.shape == (len(TAILS), -(-(len(vocab) + 20) // 32))
    for tail in TAILS:
        bits = (tails.mask(tail)[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = set(bits.flatten().nonzero().flatten().tolist())
        assert allowed == {i for i, data in enumerate(vocab) if extend(tail, data) is not None}
    assert tails.after(CLOSED, vocab.index(b"\xe4\xb8\x80")) == CLOSED
    assert tails.after(CLOSED, vocab.index(b"\xf0\x9f")) == (2, 0x80, 0xBF)
    assert tails.after(CLOSED, vocab.index(b"\xed\xa0\x80")) == CLOSED  # invalid: restarts
    assert tails.after(CLOSED, len(vocab) + 5) == CLOSED  # past the tokenizer's ids


def test_narrow_keeps_the_grammars_mask_where_no_token_would_remain():
    tails = Utf8Tails([b"a", b"\xc3", b"\xa9"], vocab_size=3)
    bitmask = torch.tensor([[0b011], [0b111]], dtype=torch.int32)  # the grammar's two rows
    rows = bitmask.numpy()  # narrowed in place, as the runner does
    tails.narrow(rows[0], (1, 0x80, 0xBF))  # after a lead byte: only "\xa9", which it forbids
    assert bitmask[0].tolist() == [0b011]
    tails.narrow(rows[0], CLOSED)
    assert bitmask[0].tolist() == [0b011]
    tails.narrow(rows[1], CLOSED)
    assert bitmask.tolist() == [[0b011], [0b011]]  # a continuation byte opens nothing


def _allowed(bitmask_row: torch.Tensor) -> set[int]:
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:1000].nonzero().flatten().tolist())


def test_a_grammar_string_never_continues_into_a_surrogate():
    """After "\\xed" inside a JSON string, only 80-9F may follow (A0-BF would make a surrogate,
    which xgrammar's character class lets through), whether the matcher advanced token by token
    or was rebuilt from the hand-off's tokens."""
    path = str(ensure_tiny_model())
    tokenizer = Tokenizer.from_pretrained(path)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}}
    params = SamplingParams(max_tokens=64, structured_output=StructuredOutput.json_schema(schema))
    history = tokenizer.encode('{"name": " writ', add_special_tokens=False)
    stepped = GrammarMatchers(path, 1000, [EOS_ID], pin=False)
    request = ScheduledRequest("r", [5], 0, [0], True, params, grammar_token_ids=history)
    stepped.masks([request])
    token_bytes = stepped._utf8.token_bytes
    lead = token_bytes.index(b"\xed")
    assert not stepped.accept([request], stepped.masks([request]), [lead])
    rebuilt = GrammarMatchers(path, 1000, [EOS_ID], pin=False)
    handed_off = ScheduledRequest(
        "r", [5], 0, [0], True, params, grammar_token_ids=[*history, lead]
    )
    for matchers, req in ((stepped, request), (rebuilt, handed_off)):
        allowed = _allowed(matchers.masks([req]).bitmask[0])
        assert allowed and all(0x80 <= token_bytes[i][0] <= 0x9F for i in allowed), allowed


def test_grammar_outputs_decode_as_utf8_for_20_seeds():
    """A class of 3-byte characters, which xgrammar lets hold the surrogates D800-DFFF: a
    random-weights model picks the lead byte ED in about one character of 16."""
    params = [
        SamplingParams(
            max_tokens=60, temperature=1.0, seed=seed,
            structured_output=StructuredOutput("regex", r'[\u0800-\uffff]{12}'),
        )
        for seed in range(20)
    ]  # fmt: skip
    outputs = LLM("tiny").generate(["Tell me about"] * 20, params)
    assert [o.text for o in outputs if "\ufffd" in o.text or len(o.text) != 12] == []
