"""Log-probabilities of generated tokens (SamplingParams.logprobs) against transformers on the
same tiny checkpoint: each token's log-probability and its top-k alternatives equal the
log-softmax of transformers' logits at that position, whatever else shares the batch, through
a prefill -> decode hand-off, and for sampled (not only greedy) tokens."""

import math

import pytest
import torch

import rayinfer
from rayinfer.engine.sampling_params import InvalidRequestError
from rayinfer.layers.sampler import gather_logprobs, log_probabilities
from tests.models.harness import TINY_DENSE, make_hf_checkpoint, make_prompts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", **TINY_DENSE)


@pytest.fixture(scope="module")
def transformers_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def expected_log_probs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V]: transformers' log-softmax at the position before each token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def assert_logprobs_match(output, expected: torch.Tensor, k: int) -> None:
    assert len(output.logprobs) == len(output.token_ids)
    for step, (token_id, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        row = expected[step]
        assert entry.chosen.token_id == token_id
        assert math.isclose(entry.chosen.logprob, row[token_id].item(), abs_tol=1e-4)
        values, ids = row.topk(k)
        assert [t.token_id for t in entry.top] == ids.tolist()
        torch.testing.assert_close(
            torch.tensor([t.logprob for t in entry.top]), values, atol=1e-4, rtol=0
        )


def test_greedy_logprobs_match_transformers_in_a_mixed_batch(checkpoint, transformers_model):
    llm = rayinfer.LLM(str(checkpoint), device="cpu", max_num_batched_tokens=16)
    prompts = make_prompts(TINY_DENSE["vocab_size"], lengths=(5, 23, 9))
    with_logprobs = rayinfer.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                            logprobs=5)  # fmt: skip
    without = rayinfer.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, [with_logprobs, without, with_logprobs])
    assert outputs[1].logprobs is None and outputs[1].new_logprobs is None
    for prompt, output in zip(prompts, outputs):
        if output.logprobs is None:
            continue
        expected = expected_log_probs(transformers_model, prompt, list(output.token_ids))
        assert_logprobs_match(output, expected, k=5)
        assert all(len(entry.top) == 5 for entry in output.logprobs)
        # the greedy token is the most likely one
        assert all(entry.top[0].token_id == entry.chosen.token_id for entry in output.logprobs)


def test_sampled_tokens_and_zero_alternatives(checkpoint, transformers_model):
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    prompt = make_prompts(TINY_DENSE["vocab_size"], lengths=(7,))[0]
    params = rayinfer.SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True,
                                     logprobs=0, presence_penalty=1.0)  # fmt: skip
    (output,) = llm.generate([prompt], params)
    expected = expected_log_probs(transformers_model, prompt, list(output.token_ids))
    assert_logprobs_match(output, expected, k=0)  # raw log-probs: before the penalty
    assert all(entry.top == [] for entry in output.logprobs)


def test_logprobs_survive_the_prefill_to_decode_hand_off(checkpoint, transformers_model):
    prefill, decode = (rayinfer.LLM(str(checkpoint), device="cpu") for _ in range(2))
    prompt = make_prompts(TINY_DENSE["vocab_size"], lengths=(11,))[0]
    params = rayinfer.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    (handoff,) = prefill.prefill([prompt], params)
    assert handoff.first_token_logprobs is not None
    (output,) = decode.decode([handoff], params)
    expected = expected_log_probs(transformers_model, prompt, list(output.token_ids))
    assert_logprobs_match(output, expected, k=2)


def test_the_runner_math_on_a_known_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]]))
    raw = log_probabilities(logits, [2, None])
    assert raw is not None and raw[1] == [0]
    (chosen, ids, values), missing = gather_logprobs(*raw, [1, 3], [2, None])
    assert missing is None and ids == [0, 1]
    assert math.isclose(chosen, math.log(0.25), rel_tol=1e-6)
    assert [round(math.exp(v), 6) for v in values] == [0.5, 0.25]
    assert log_probabilities(logits, [None, None]) is None


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_bad_logprobs_are_refused_naming_the_field(bad):
    with pytest.raises(InvalidRequestError) as error:
        rayinfer.SamplingParams(logprobs=bad)
    assert error.value.field == "logprobs"


def assert_prompt_logprobs_match(output, model, prompt: list[int], k: int) -> None:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], dim=-1)  # row j predicts prompt[j + 1]
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt)
    assert entries[0].chosen.token_id == prompt[0] and entries[0].chosen.logprob is None
    for position, entry in enumerate(entries[1:], 1):
        row = expected[position - 1]
        assert entry.chosen.token_id == prompt[position]
        assert math.isclose(entry.chosen.logprob, row[prompt[position]].item(), abs_tol=1e-4)
        values, ids = row.topk(k)
        assert [t.token_id for t in entry.top] == ids.tolist()
        torch.testing.assert_close(
            torch.tensor([t.logprob for t in entry.top]), values, atol=1e-4, rtol=0
        )


def test_prompt_logprobs_over_chunks_and_past_the_prefix_cache(checkpoint, transformers_model):
    # 16-token chunks split the 40-token prompt; the second request's prompt is fully cached by
    # the first, yet gets every position computed again
    llm = rayinfer.LLM(str(checkpoint), device="cpu", max_num_batched_tokens=16, block_size=4)
    prompt = make_prompts(TINY_DENSE["vocab_size"], lengths=(40,), seed=4)[0]
    params = rayinfer.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                     prompt_logprobs=3)  # fmt: skip
    plain = rayinfer.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    (warm,) = llm.generate([prompt], plain)
    assert warm.prompt_logprobs is None
    first, second = llm.generate([prompt, prompt], [params, params])
    for output in (first, second):
        assert output.num_cached_tokens == 0
        assert_prompt_logprobs_match(output, transformers_model, prompt, k=3)


def test_prompt_logprobs_come_with_a_prefill_hand_off(checkpoint, transformers_model):
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    prompt = make_prompts(TINY_DENSE["vocab_size"], lengths=(9,), seed=6)[0]
    params = rayinfer.SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0)
    engine = llm.engine
    engine.add_request("p", prompt, params, prefill_only=True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (done,) = [o for o in outputs if o.finished]
    assert_prompt_logprobs_match(done, transformers_model, prompt, k=0)
