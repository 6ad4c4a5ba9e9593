"""Sampling parameters' validation and the sampler's filters."""

import pytest
import torch

from rayinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from rayinfer.layers.sampler import NO_TOKEN, sample_tokens


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 7}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "0.1"}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens=16
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),  # a list of words, not one
        ({"bad_words": [3]}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words"),
        ({"bad_words_token_ids": [[-2]]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ],
)
def test_invalid_values_name_their_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**kwargs)
    assert error.value.field == field
    assert field in str(error.value)


def test_the_seed_range_is_named_in_the_error():
    with pytest.raises(InvalidRequestError, match=r"seed=-1 must be in 0\.\.9223372036854775807"):
        SamplingParams(seed=-1)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_top_k_zero_is_off_as_in_vllm():
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 50)
    tokens, _ = sample_tokens(logits, [0.0] * 3, [-1] * 3, [1.0] * 3, [None] * 3)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(4, 50)
    tokens, _ = sample_tokens(logits, [5.0] * 4, [1] * 4, [1.0] * 4, [seeded(i) for i in range(4)])
    assert tokens == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = torch.randn(4, 50)
    tokens, _ = sample_tokens(
        logits, [1.0] * 4, [-1] * 4, [1e-6] * 4, [seeded(i) for i in range(4)]
    )
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_limits_the_support():
    logits = torch.randn(1, 50)
    allowed = set(logits[0].topk(5).indices.tolist())
    generator = seeded(0)
    for _ in range(200):
        assert sample_tokens(logits, [2.0], [5], [1.0], [generator]).token_ids[0] in allowed


def test_same_seed_samples_the_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 100)
    alone = [sample_tokens(logits[1:2], [1.0], [-1], [0.9], [g]).token_ids[0]
             for g in [seeded(7)] * 5]  # fmt: skip
    generator = seeded(7)
    batched = [
        sample_tokens(
            logits, [0.0, 1.0, 1.0], [-1] * 3, [1.0, 0.9, 1.0], [None, generator, seeded(i)]
        ).token_ids[1]
        for i in range(5)
    ]
    assert alone == batched


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_nan_logits_fails_alone(temperature):
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    generators = [seeded(i) if temperature else None for i in range(3)]
    alone = [sample_tokens(logits[r : r + 1], [temperature], [-1], [1.0],
                           [seeded(r) if temperature else None]).token_ids[0]
             for r in (0, 2)]  # fmt: skip
    rows = sample_tokens(logits, [temperature] * 3, [-1] * 3, [1.0] * 3, generators)
    assert list(rows.errors) == [1] and "NaN" in rows.errors[1]
    assert rows.token_ids == [alone[0], NO_TOKEN, alone[1]]


def test_a_tiny_temperature_is_greedy_not_nan():
    """logits / 1e-300 overflows to inf; the sampler divides the logits shifted by their max."""
    logits = torch.randn(4, 50) * 10
    rows = sample_tokens(logits, [1e-300] * 4, [-1] * 4, [1.0] * 4, [seeded(i) for i in range(4)])
    assert rows.errors == {}
    assert rows.token_ids == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None]
    generator = seeded(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample_tokens(logits, [1.0], [-1], [1.0], [generator]).token_ids[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.04, rtol=0)


def test_penalties_subtract_presence_once_and_frequency_per_occurrence():
    from rayinfer.layers.sampler import apply_penalties

    logits = torch.zeros(3, 6)
    apply_penalties(logits, [[1, 1, 4], None, []], [0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    expected_row = torch.tensor([0.0, -(0.5 + 2 * 0.25), 0.0, 0.0, -(0.5 + 0.25), 0.0])
    torch.testing.assert_close(logits[0], expected_row)
    assert logits[1:].abs().sum() == 0  # no penalties, or nothing generated yet


def _penalties_row_by_row(logits, output_token_ids, presence, frequency):
    """The plain definition, one row at a time."""
    for row, generated in enumerate(output_token_ids):
        if generated:
            counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[1]).float()
            logits[row] -= presence[row] * (counts > 0).float() + frequency[row] * counts


def test_penalties_of_a_batch_equal_the_row_by_row_definition():
    from rayinfer.layers.sampler import apply_penalties

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    generated = [torch.randint(0, 50, (n,), generator=gen).tolist() for n in (7, 0, 1, 30, 3, 0)]
    generated[5] = None
    presence = torch.rand(6, generator=gen).tolist()
    frequency = (torch.rand(6, generator=gen) - 0.5).tolist()
    expected = logits.clone()
    _penalties_row_by_row(expected, generated, presence, frequency)
    apply_penalties(logits, generated, presence, frequency)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_outside_the_openai_range_name_their_field(field):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: 2.5})
    assert error.value.field == field


def test_logit_bias_adds_to_its_rows_tokens_only():
    from rayinfer.layers.sampler import apply_logit_bias

    logits = torch.zeros(3, 6)
    apply_logit_bias(logits, [((1, 5.0), (4, -100.0)), (), ((0, 0.5),)])
    expected = torch.zeros(3, 6)
    expected[0, 1], expected[0, 4], expected[2, 0] = 5.0, -100.0, 0.5
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "bias", [{-1: 1.0}, {True: 1.0}, {"3": 1.0}, {3: 100.5}, {3: float("nan")}, {3: "1"}]
)
def test_logit_bias_outside_openai_range_names_the_field(bias):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(logit_bias=bias)
    assert error.value.field == "logit_bias"
    assert SamplingParams(logit_bias={3: -100, 4: 2.5}).logit_bias == ((3, -100), (4, 2.5))


def test_vllm_extensions_default_to_off_and_normalize():
    params = SamplingParams(stop_token_ids=[5, 6], min_tokens=16)
    assert params.stop_token_ids == (5, 6) and params.min_tokens == 16
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert not SamplingParams(repetition_penalty=1.2).has_additive_penalties


def test_min_p_keeps_the_tokens_above_its_share_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    generator = seeded(0)
    drawn = {sample_tokens(logits, [1.0], [-1], [1.0], [generator], [0.5]).token_ids[0]
             for _ in range(300)}  # fmt: skip
    assert drawn == {0, 1}  # 0.15 < 0.5 * 0.5
    assert sample_tokens(logits, [1.0], [-1], [1.0], [seeded(0)], [1.0]).token_ids == [0]


def test_min_p_of_a_row_leaves_the_others_alone():
    logits = torch.randn(3, 60)
    alone = sample_tokens(logits[1:2], [1.0], [-1], [1.0], [seeded(4)]).token_ids[0]
    batched = sample_tokens(logits, [1.0] * 3, [-1] * 3, [1.0] * 3,
                            [seeded(1), seeded(4), seeded(2)], [0.9, 0.0, 0.3])  # fmt: skip
    assert batched.token_ids[1] == alone


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    from rayinfer.layers.sampler import apply_repetition_penalty

    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0], [2.0, -2.0, 1.0, -1.0, 3.0]])
    prompt = torch.tensor([0, 1])
    apply_repetition_penalty(logits, [prompt, prompt], [[3, 3], [4]], [2.0, 1.0])
    torch.testing.assert_close(logits[0], torch.tensor([1.0, -4.0, 1.0, -2.0, 3.0]))
    torch.testing.assert_close(logits[1], torch.tensor([2.0, -2.0, 1.0, -1.0, 3.0]))


def test_repetition_penalty_of_a_batch_equals_the_row_by_row_rule():
    from rayinfer.layers.sampler import apply_repetition_penalty

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen, dtype=torch.float64)
    prompts = [torch.randint(0, 40, (n,), generator=gen) for n in (3, 9, 1, 20, 4)]
    prompts[2] = None
    outputs = [torch.randint(0, 40, (n,), generator=gen).tolist() for n in (0, 5, 2, 11, 3)]
    outputs[4] = None
    penalties = [1.3, 0.6, 2.0, 1.0, 1.1]
    expected = logits.clone()
    for row, penalty in enumerate(penalties):
        seen = set(outputs[row] or []) | set([] if prompts[row] is None else prompts[row].tolist())
        for token in seen:
            value = expected[row, token]
            expected[row, token] = value / penalty if value > 0 else value * penalty
    apply_repetition_penalty(logits, prompts, outputs, penalties)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_suppressed_tokens_cannot_be_sampled_by_their_row_only():
    from rayinfer.layers.sampler import suppress_tokens

    logits = torch.zeros(3, 5)
    suppress_tokens(logits, [(1, 4), None, (0,)])
    assert logits.isinf().nonzero().tolist() == [[0, 1], [0, 4], [2, 0]]


def test_token_filters_default_to_off_and_drop_duplicates():
    params = SamplingParams()
    assert params.allowed_token_ids is None and params.bad_words == ()
    assert params.bad_words_token_ids is None and params.truncate_prompt_tokens is None
    params = SamplingParams(
        allowed_token_ids=[7, 3, 7],
        bad_words=["a", "b", "a"],
        bad_words_token_ids=[[1, 2], [3]],
        truncate_prompt_tokens=-1,
    )
    assert params.allowed_token_ids == (7, 3) and params.bad_words == ("a", "b")
    assert params.bad_words_token_ids == ((1, 2), (3,)) and params.truncate_prompt_tokens == -1


def test_token_ids_outside_the_vocabulary_name_their_field():
    for params, field in [
        (SamplingParams(allowed_token_ids=[3, 50]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[1, 50]]), "bad_words"),
        (SamplingParams(stop_token_ids=[50]), "stop_token_ids"),
        (SamplingParams(logit_bias={50: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(InvalidRequestError, match=f"^{field}: token id 50 is outside"):
            params.check_vocabulary(50)
    SamplingParams(allowed_token_ids=[49], bad_words_token_ids=[[0, 49]]).check_vocabulary(50)


def test_allow_only_tokens_masks_every_other_token_of_its_rows():
    from rayinfer.layers.sampler import allow_only_tokens

    for lists in ([(1, 4), None, (0,)], [(2,), (3, 1)]):  # some rows, then every row
        logits = torch.randn(len(lists), 6)
        expected = logits.clone()
        for row, allowed in enumerate(lists):
            if allowed is not None:
                keep = expected[row, list(allowed)].clone()
                expected[row] = float("-inf")
                expected[row, list(allowed)] = keep
        allow_only_tokens(logits, [None if a is None else torch.tensor(a) for a in lists])
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_every_token_masked_fails_alone(temperature):
    from rayinfer.layers.sampler import NO_TOKEN_LEFT

    logits = torch.randn(3, 50)
    logits[1] = float("-inf")
    generators = [seeded(i) if temperature else None for i in range(3)]
    alone = [sample_tokens(logits[r : r + 1], [temperature], [-1], [1.0],
                           [seeded(r) if temperature else None]).token_ids[0]
             for r in (0, 2)]  # fmt: skip
    rows = sample_tokens(logits, [temperature] * 3, [-1] * 3, [1.0] * 3, generators)
    assert rows.errors == {1: NO_TOKEN_LEFT}
    assert rows.token_ids == [alone[0], NO_TOKEN, alone[1]]


def test_a_bad_word_masks_its_last_token_where_the_output_ends_with_the_rest():
    from rayinfer.engine.bad_words import completing_tokens

    words = ((9,), (4, 5, 6), (5, 7))
    assert completing_tokens(words, []) == (9,)
    assert completing_tokens(words, [1, 4]) == (9,)  # (4, 5) not yet
    assert completing_tokens(words, [4, 5]) == (9, 6, 7)
    assert completing_tokens(words, [5, 4, 5, 5]) == (9, 7)


def test_truncation_keeps_k_or_what_max_tokens_leaves():
    from rayinfer.engine.prompt_truncation import keep_last, prompt_token_limit

    assert prompt_token_limit(None, 64, 10) is None
    assert prompt_token_limit(5, 64, 10) == 5 and prompt_token_limit(-1, 64, 10) == 54
    assert prompt_token_limit(54, 64, 10) == 54
    for truncate, max_tokens in ((55, 10), (-1, 64), (1, 64)):
        with pytest.raises(InvalidRequestError) as error:
            prompt_token_limit(truncate, 64, max_tokens)
        assert error.value.field == "truncate_prompt_tokens"
    assert keep_last([1, 2, 3], 2) == [2, 3] and keep_last([1, 2, 3], 5) == [1, 2, 3]
    assert keep_last([1, 2, 3], None) == [1, 2, 3]
