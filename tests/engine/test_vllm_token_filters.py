"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens end to end on the built-in tiny
model (float32 on the CPU). Greedy tokens are checked against a float64 reference made from the
model's own logits with the masked tokens removed (as tests/engine/test_vllm_sampling.py does);
the masks hold in mixed batches, on the decode graphs' path, under preemption, through the
prefill -> decode hand-off and beside a grammar's mask."""

from dataclasses import replace

import pytest
import torch

import rayinfer
from rayinfer.engine.bad_words import tokenize_bad_words
from rayinfer.engine.model_source import resolve_model_path
from rayinfer.engine.sampling_params import InvalidRequestError
from rayinfer.engine.structured_output import StructuredOutput
from rayinfer.models.tiny import BOS_ID, EOS_ID, IM_END_ID
from tests.engine.test_vllm_sampling import TIE, reference_logits
from tests.models.harness import load_rayinfer, make_prompts

SamplingParams = rayinfer.SamplingParams
TEXTS = ["The quick brown fox jumps over the lazy dog and the", "Hello, how are you? I am"]
# Unbanned, greedy writes "bers beac" first after TEXTS[0] (two tokens: the first comes from a
# prefill, the second is masked by the decode side) and " day" after TEXTS[1] ("day" alone is
# another token: vLLM's rule bans both).
BAD_WORDS = ["bers beac", "day"]
ALLOWED = list(range(400, 700, 3))
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return rayinfer.LLM("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def model():
    return load_rayinfer(resolve_model_path("tiny"))


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def words(llm) -> tuple[tuple[int, ...], ...]:
    return tokenize_bad_words(tuple(BAD_WORDS), llm.tokenizer)


def ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


def holds(tokens: list[int], sequence) -> bool:
    n = len(sequence)
    return any(tuple(tokens[i : i + n]) == tuple(sequence) for i in range(len(tokens) - n + 1))


def banned_after(sequences, output: list[int]) -> list[int]:
    """The rule, plainly: a word's last token is banned once the output ends with the rest."""
    banned = []
    for sequence in sequences:
        *rest, last = sequence
        if not rest or (len(output) >= len(rest) and output[len(output) - len(rest) :] == rest):
            banned.append(last)
    return banned


def test_bad_words_tokenize_alone_and_after_a_space_as_vllm(llm, words):
    assert words == (tuple(ids(llm, "bers beac")), tuple(ids(llm, "day")), tuple(ids(llm, " day")))
    assert len(words[0]) == 2 and len(words[1]) == len(words[2]) == 1
    assert tokenize_bad_words(("  day",), llm.tokenizer) == words[1:]  # leading spaces go
    # " fox" is one token but "fox" three: a spaced form of another length is not banned
    assert len(ids(llm, " fox")) == 1
    assert tokenize_bad_words(("fox",), llm.tokenizer) == (tuple(ids(llm, "fox")),)
    with pytest.raises(InvalidRequestError, match="^bad_words: ' ' encodes to no token"):
        tokenize_bad_words((" ",), llm.tokenizer)


def test_greedy_bad_words_never_appear_and_each_token_is_the_masked_argmax(
    llm, model, prompts, words
):
    free = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))]
    assert list(free[0][:2]) == list(words[0]) and words[2][0] in free[1]
    params = SamplingParams(max_tokens=12, **GREEDY, bad_words=BAD_WORDS)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        generated = list(output.token_ids)
        assert not any(holds(generated, word) for word in words)
        logits = reference_logits(model, prompt, generated)
        for step, token in enumerate(generated):
            row = logits[step].clone()
            row[banned_after(words, generated[:step])] = float("-inf")
            assert row[token] >= row.max() - TIE, f"step {step}"


def test_greedy_allowed_token_ids_pick_the_best_allowed_token(llm, model, prompts):
    params = SamplingParams(max_tokens=8, **GREEDY, allowed_token_ids=ALLOWED, logprobs=0)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        generated = list(output.token_ids)
        assert set(generated) <= set(ALLOWED)
        logits = reference_logits(model, prompt, generated)
        for step, token in enumerate(generated):
            assert logits[step, token] >= logits[step, ALLOWED].max() - TIE, f"step {step}"
        # the log-probabilities reported stay the model's own, as with logit_bias
        raw = torch.log_softmax(logits, -1)[torch.arange(len(generated)), generated]
        reported = torch.tensor([entry.chosen.logprob for entry in output.logprobs])
        torch.testing.assert_close(reported, raw.float(), atol=1e-4, rtol=0)


def test_sampled_tokens_stay_in_the_allowed_set(llm, prompts):
    drawn = set()
    for seed in range(3):
        params = SamplingParams(max_tokens=8, temperature=1.5, seed=seed, ignore_eos=True,
                                allowed_token_ids=ALLOWED)  # fmt: skip
        for output in llm.generate(prompts, params):
            drawn |= set(output.token_ids)
    assert drawn <= set(ALLOWED) and len(drawn) > 8


def test_a_request_left_no_token_fails_alone(llm, prompts):
    lone = ids(llm, "ort")
    assert len(lone) == 1
    empty = SamplingParams(max_tokens=4, **GREEDY, allowed_token_ids=lone, bad_words=["ort"])
    plain = SamplingParams(max_tokens=4, **GREEDY)
    alone = llm.generate(prompts[1], plain)[0].token_ids
    failed, other = llm.generate(prompts, [empty, plain])
    assert failed.finish_reason == "error" and "every token is masked" in failed.error
    assert other.token_ids == alone


def test_the_masks_combine_with_a_grammar(llm, prompts):
    day, the = ids(llm, "day"), ids(llm, "The")
    assert len(day) == len(the) == 1
    # the grammar allows "day" or "The" in any tokenization; allowed_token_ids only as one token
    only = SamplingParams(max_tokens=4, temperature=0, structured_output=StructuredOutput.choice(
        ["day", "The"]), allowed_token_ids=day + the + [EOS_ID, IM_END_ID])  # fmt: skip
    first = llm.generate(prompts[0], only)[0]
    assert first.text in ("day", "The") and len(first.token_ids) == 2
    second = llm.generate(prompts[0], replace(only, bad_words=[first.text]))[0]
    assert second.text == ({"day", "The"} - {first.text}).pop()
    assert second.finish_reason == "stop"
    none = llm.generate(prompts[0], replace(only, allowed_token_ids=ids(llm, "ort")))[0]
    assert none.finish_reason == "error" and "every token is masked" in none.error


MIXED = [
    SamplingParams(max_tokens=8, **GREEDY, allowed_token_ids=ALLOWED),
    SamplingParams(max_tokens=8, **GREEDY, bad_words=BAD_WORDS),
    SamplingParams(
        max_tokens=8,
        temperature=1.2,
        seed=4,
        ignore_eos=True,
        bad_words=BAD_WORDS,
        allowed_token_ids=ALLOWED + [571, 864],
        top_k=20,
    ),  # fmt: skip
    SamplingParams(max_tokens=8, **GREEDY),
    SamplingParams(
        max_tokens=8,
        temperature=0,
        min_tokens=4,
        logit_bias={EOS_ID: 100.0},
        repetition_penalty=1.3,
        bad_words=["day"],
    ),  # fmt: skip
]


def test_a_mixed_batch_from_decode_graphs_gives_each_row_its_alone_tokens(llm, prompts):
    rows = [prompts[i % len(prompts)] for i in range(len(MIXED))]
    alone = [llm.generate(p, params)[0].token_ids for p, params in zip(rows, MIXED)]
    graphs = rayinfer.LLM("tiny", device="cpu", dtype="float32", cuda_graphs=True)
    runner = graphs.engine.executor.runner
    replays, run = [], runner.decode_graphs.run
    runner.decode_graphs.run = lambda requests, bucket=None: (
        replays.append(len(requests)) or run(requests, bucket)
    )
    assert [o.token_ids for o in graphs.generate(rows, MIXED)] == alone
    assert replays and max(replays) == len(MIXED)  # the decode steps ran from the graphs


def test_the_masks_and_truncation_survive_preemption_and_the_hand_off(llm, prompts, words):
    rows = prompts + make_prompts(1000, lengths=(9, 30))
    params = [
        SamplingParams(max_tokens=12, **GREEDY, bad_words=BAD_WORDS),
        SamplingParams(max_tokens=12, **GREEDY, bad_words=BAD_WORDS, allowed_token_ids=ALLOWED),
        SamplingParams(
            max_tokens=12, temperature=0.9, seed=1, ignore_eos=True, allowed_token_ids=ALLOWED
        ),  # fmt: skip
        SamplingParams(max_tokens=12, **GREEDY, bad_words=BAD_WORDS, truncate_prompt_tokens=20),
    ]
    alone = [llm.generate(p, one)[0] for p, one in zip(rows, params)]
    assert alone[0].token_ids[0] == words[0][0] and alone[0].token_ids[1] != words[0][1]
    assert list(alone[3].prompt_token_ids) == rows[3][-20:]
    tight = rayinfer.LLM("tiny", device="cpu", dtype="float32", block_size=4, num_kv_blocks=16,
                         max_model_len=48)  # fmt: skip
    assert [o.token_ids for o in tight.generate(rows, params)] == [o.token_ids for o in alone]
    assert tight.engine.scheduler.num_preemptions > 0
    decode = rayinfer.LLM("tiny", device="cpu", dtype="float32", block_size=8)
    handed_off = decode.decode(llm.prefill(rows, params), params)
    assert [o.token_ids for o in handed_off] == [o.token_ids for o in alone]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, prompts):
    prompt, plain = prompts[0], SamplingParams(max_tokens=6, **GREEDY)
    kept = llm.generate(prompt, replace(plain, truncate_prompt_tokens=5))[0]
    assert list(kept.prompt_token_ids) == prompt[-5:]
    assert kept.token_ids == llm.generate(prompt[-5:], plain)[0].token_ids
    # a text keeps the BOS its tokenizer adds, before its last tokens (transformers' left side)
    text = llm.generate(TEXTS[0], SamplingParams(max_tokens=2, truncate_prompt_tokens=5))[0]
    assert list(text.prompt_token_ids) == [BOS_ID] + prompt[-4:]
    short = llm.generate(prompt, SamplingParams(max_tokens=2, truncate_prompt_tokens=500))[0]
    assert list(short.prompt_token_ids) == prompt  # shorter than k: unchanged


def test_truncate_minus_one_keeps_what_max_tokens_leaves_of_max_model_len():
    small = rayinfer.LLM("tiny", device="cpu", dtype="float32", max_model_len=32)
    (prompt,) = make_prompts(1000, lengths=(60,))
    output = small.generate(prompt, SamplingParams(max_tokens=8, truncate_prompt_tokens=-1))[0]
    assert list(output.prompt_token_ids) == prompt[-24:]
    with pytest.raises(InvalidRequestError, match="^truncate_prompt_tokens: 25 exceeds") as error:
        small.generate(prompt, SamplingParams(max_tokens=8, truncate_prompt_tokens=25))
    assert error.value.field == "truncate_prompt_tokens"


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(allowed_token_ids=[5, 10**6]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[10**6]]), "bad_words"),
        (SamplingParams(bad_words=["\u2003"]), "bad_words"),  # only a space: no token
    ],
)
def test_ids_outside_the_vocabulary_and_empty_words_name_their_field(llm, prompts, params, field):
    with pytest.raises(InvalidRequestError, match=f"^{field}: ") as error:
        llm.generate(prompts[0], params)
    assert error.value.field == field
