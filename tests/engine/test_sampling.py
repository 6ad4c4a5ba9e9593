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
