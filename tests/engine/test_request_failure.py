"""One request the engine cannot go on with fails alone: its seed, NaN logits or its sampling
raising end it with finish_reason "error" while the rest of its batch completes unchanged."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

import rayinfer
from rayinfer.engine.model_runner import ModelRunner
from rayinfer.engine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 99], [7, 123, 64, 8]]


@pytest.fixture(scope="module")
def llm():
    return rayinfer.LLM("tiny", device="cpu", max_model_len=128, num_kv_blocks=64)


def with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    """A seed no validation let through, as a caller building params by hand could send it."""
    bad = replace(params)
    object.__setattr__(bad, "seed", seed)
    return bad


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 - 1])
def test_a_bad_seed_is_refused_naming_the_field(llm, seed):
    with pytest.raises(rayinfer.InvalidRequestError) as caught:
        llm.generate("hello", SamplingParams(temperature=0.8, seed=seed))
    assert caught.value.field == "seed"
    assert f"seed={seed}" in str(caught.value) and "0..9223372036854775807" in str(caught.value)


def test_a_seed_torch_refuses_fails_its_request_alone(llm):
    good = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], good)[0]
    bad = with_seed(good, 2**64)  # torch.Generator.manual_seed overflows
    failed, completed = llm.generate([PROMPTS[1], PROMPTS[0]], [bad, good])
    assert failed.finish_reason == "error" and "seed=18446744073709551616" in failed.error
    assert list(failed.token_ids) == []
    assert completed.finish_reason == "length"
    assert completed.token_ids == alone.token_ids
    # the engine went on: nothing left running, every block back, the next request succeeds
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_usage == 0
    assert llm.generate(PROMPTS[0], good)[0].token_ids == alone.token_ids


def test_a_request_failing_mid_decode_fails_alone(llm, monkeypatch):
    """The sampler's per-request step raises for one request on its 4th token only."""
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=0.7, seed=1, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], greedy)[0]
    llm._request_ids = itertools.count(1000)
    victim = "llm-1001"  # the second request of the next generate
    real_generator, calls = ModelRunner._generator, []

    def flaky_generator(self, request_id, params):
        if request_id == victim:
            calls.append(request_id)
            if len(calls) == 4:
                raise RuntimeError("generator state corrupted")
        return real_generator(self, request_id, params)

    monkeypatch.setattr(ModelRunner, "_generator", flaky_generator)
    completed, failed = llm.generate(PROMPTS, [greedy, sampled])
    assert failed.finish_reason == "error" and "generator state corrupted" in failed.error
    assert len(failed.token_ids) == 3
    assert completed.token_ids == alone.token_ids and completed.finish_reason == "length"
    assert llm.engine.kv_usage == 0


def test_nan_logits_fail_only_their_row(llm, monkeypatch):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], params)[0]
    model = llm.engine.executor.runner.model
    real_logits = model.compute_logits

    def nan_first_row(hidden):
        logits = real_logits(hidden)
        if logits.shape[0] == 2:  # both requests in the batch: the first one's row
            logits[0, 0] = float("nan")
        return logits

    monkeypatch.setattr(model, "compute_logits", nan_first_row)
    failed, completed = llm.generate(PROMPTS, params)
    assert failed.finish_reason == "error" and "NaN" in failed.error
    assert completed.token_ids == alone.token_ids


def test_a_prefill_that_fails_raises_request_failed(llm):
    bad = with_seed(SamplingParams(max_tokens=4, temperature=0.8), 2**64)
    with pytest.raises(rayinfer.RequestFailedError, match="seed"):
        llm.prefill([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=4, temperature=0), bad])
    assert llm.engine.kv_usage == 0 and not llm.engine.handoffs_ready
