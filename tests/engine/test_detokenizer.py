"""IncrementalDetokenizer: deltas never hold broken UTF-8 and add up to decode(all ids)."""

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from rayinfer.engine.detokenizer import IncrementalDetokenizer
from rayinfer.engine.stop_checker import find_stop_string
from rayinfer.engine.tokenizer import Tokenizer
from rayinfer.models.tiny import SPECIAL_TOKENS, build_tokenizer

TEXTS = [
    "Hello world, plain ASCII.",
    "你好，世界！这是一个测试。",
    "emoji 🙂 and 👍🏽 and a family 👨‍👩‍👧 in one line",
    "naïve café — «quotes» and ∑ math ∞",
    "mixed 中文 text 🙂 with\nnewlines\tand tabs",
]


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """The tiny model's byte-level BPE: its corpus is English, so CJK and emoji split into bytes."""
    special = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1]}
    return Tokenizer(build_tokenizer(), special)


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detokenizer.add(token_id) for token_id in ids]
    return deltas + [detokenizer.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_decode_and_never_break_characters(byte_level, text):
    ids = byte_level.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 4  # the text really is split inside characters
    detokenizer = IncrementalDetokenizer(byte_level)
    deltas = stream(detokenizer, ids)
    assert "".join(deltas) == detokenizer.text == byte_level.decode(ids) == text
    assert all("\ufffd" not in delta for delta in deltas)
    emitted = ""
    for delta in deltas:  # a delta is never revised: each prefix is a prefix of the final text
        emitted += delta
        assert text.startswith(emitted)


def test_characters_split_across_tokens_are_held_back(byte_level):
    ids = byte_level.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(byte_level)
    assert [detokenizer.add(token_id) for token_id in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert detokenizer.flush() == ""


def test_special_tokens_are_skipped_or_kept(byte_level):
    im_start, im_end = (byte_level.backend.token_to_id(t) for t in SPECIAL_TOKENS[2:4])
    ids = [im_start, *byte_level.encode("中文 ok", add_special_tokens=False), im_end]
    assert "".join(stream(IncrementalDetokenizer(byte_level), ids)) == "中文 ok"
    kept = IncrementalDetokenizer(byte_level, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "<|im_start|>中文 ok<|im_end|>"


def test_unfinished_character_is_flushed_as_decode_shows_it(byte_level):
    ids = byte_level.encode("ok 🙂", add_special_tokens=False)[:-1]  # cut inside the emoji
    detokenizer = IncrementalDetokenizer(byte_level)
    assert "".join(detokenizer.add(token_id) for token_id in ids) == "ok "
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == byte_level.decode(ids)


def test_random_token_streams_add_up_to_decode(byte_level):
    """Random ids (a random model's output) include lone continuation bytes and cut characters."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(byte_level.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream(IncrementalDetokenizer(byte_level), ids)) == byte_level.decode(ids)


def test_stop_string_spanning_tokens_is_found_in_the_deltas(byte_level):
    """Stop strings are matched by the engine on the text the deltas build; a cut emoji never
    produces a false match or hides a real one."""
    text = "answer 🙂 then 世界 and more"
    detokenizer = IncrementalDetokenizer(byte_level)
    found_at = None
    for token_id in byte_level.encode(text, add_special_tokens=False):
        searched = len(detokenizer.text)
        detokenizer.add(token_id)
        found_at = find_stop_string(detokenizer.text, ("世界",), searched)
        if found_at is not None:
            break
    assert detokenizer.text[:found_at] == "answer 🙂 then "


def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE: its decoder drops the leading space of the first token."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["hello world, hello there, the world is wide"] * 3, trainer)
    return Tokenizer(backend, {"unk_token": "<unk>"})


def test_prompt_context_keeps_the_first_tokens_leading_space():
    tokenizer = metaspace_tokenizer()
    prompt_ids = tokenizer.encode("hello there")
    output_ids = tokenizer.encode("hello world")[1:]  # "▁world": a word after a space
    alone = "".join(stream(IncrementalDetokenizer(tokenizer), output_ids))
    assert alone == tokenizer.decode(output_ids) == "world"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_ids)
    full_text = tokenizer.decode(prompt_ids + output_ids)
    assert "".join(stream(detokenizer, output_ids)) == " world"
    assert full_text == tokenizer.decode(prompt_ids) + " world"


@pytest.mark.parametrize("use_stream", [True, False], ids=["decode-stream", "window"])
def test_a_prompt_ending_inside_a_character_stays_out_of_the_text(byte_level, use_stream):
    prompt = byte_level.encode("ends inside 🙂", add_special_tokens=False)[:-1]
    assert byte_level.decode(prompt).endswith("\ufffd")  # its last character is unfinished
    generated = byte_level.encode(" and then plain words", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level, prompt)
    if not use_stream:
        detokenizer._stream = None
    assert "".join(stream(detokenizer, generated)) == byte_level.decode(generated)
