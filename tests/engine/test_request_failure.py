"""One request the engine cannot go on with fails alone: its seed, NaN logits or its sampling
raising end it with finish_reason "error" while the rest of its batch completes unchanged."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

import rayinfer
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.workers.runner.sampling import RequestSampler

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
    real_generator, calls = RequestSampler.generator, []

    def flaky_generator(self, request_id, params):
        if request_id == victim:
            calls.append(request_id)
            if len(calls) == 4:
                raise RuntimeError("generator state corrupted")
        return real_generator(self, request_id, params)

    monkeypatch.setattr(RequestSampler, "generator", flaky_generator)
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


def test_a_request_whose_detokenizing_raises_fails_alone(llm, monkeypatch):
    """The engine's own per-request work (detokenizer, stop strings) raises for one request on
    its 3rd token: that request ends with "error", the other's tokens are unchanged."""
    from rayinfer.engine.request_state import RequestState

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=["zz"])
    alone = llm.generate(PROMPTS[0], greedy)[0]
    real_append = RequestState.append_token

    def broken_append(self, token_id, *args, **kwargs):
        if self.seq.prompt_token_ids == PROMPTS[1] and len(self.seq.output_token_ids) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_append(self, token_id, *args, **kwargs)

    monkeypatch.setattr(RequestState, "append_token", broken_append)
    completed, failed = llm.generate(PROMPTS, greedy)
    assert failed.finish_reason == "error" and "UnicodeDecodeError" in failed.error
    assert completed.token_ids == alone.token_ids and completed.finish_reason == "length"
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_usage == 0
    monkeypatch.undo()
    assert llm.generate(PROMPTS[1], greedy)[0].finish_reason == "length"


def test_a_prefill_whose_report_raises_fails_alone_and_frees_its_kept_blocks(llm, monkeypatch):
    from rayinfer.engine.request_state import RequestState

    real_take = RequestState.take_output

    def broken_take(self):
        if self.seq.prompt_token_ids == PROMPTS[1]:
            raise ValueError("corrupt state")
        return real_take(self)

    monkeypatch.setattr(RequestState, "take_output", broken_take)
    engine, params = llm.engine, SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("kept", PROMPTS[0], params, prefill_only=True)
    engine.add_request("broken", PROMPTS[1], params, prefill_only=True)
    outputs = {output.request_id: output for output in engine.step()}
    assert outputs["kept"].finish_reason == "prefilled"
    assert outputs["broken"].finish_reason == "error" and "ValueError" in outputs["broken"].error
    assert set(engine.handoffs_ready) == {"kept"}
    engine.abort("kept")
    assert engine.kv_usage == 0 and not engine.has_unfinished_requests()
