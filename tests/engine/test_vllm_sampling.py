"""vLLM's sampling extensions end to end on the built-in tiny model (float32 on the CPU): min_p,
repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output and
skip_special_tokens. Tokens are checked against a float64 reference made from the model's own
logits at each generated position (the same checkpoint, the prompt and output teacher-forced)."""

import pytest
import torch

import rayinfer
from rayinfer.engine.model_source import resolve_model_path
from rayinfer.engine.sampling_params import InvalidRequestError
from rayinfer.models.tiny import EOS_ID, IM_START_ID, SPECIAL_TOKENS
from tests.models.harness import load_rayinfer, make_prompts, run_greedy

SamplingParams = rayinfer.SamplingParams
TIE = 1e-4  # float32 engine vs float64 reference: a token within this of the best is a tie


@pytest.fixture(scope="module")
def llm():
    return rayinfer.LLM("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def model():
    return load_rayinfer(resolve_model_path("tiny"))


@pytest.fixture(scope="module")
def prompts(llm):
    texts = ["The quick brown fox jumps over the lazy dog and the", "Hello, how are you? I am"]
    return [llm.tokenizer.encode(t) for t in texts] + make_prompts(1000, lengths=(9, 30))


def reference_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V] float64: the model's logits at the position before each token."""
    net, config = model
    logits = run_greedy(net, config, [prompt + generated], max_new_tokens=1).prompt_logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)].double()


def repetition_penalized(row: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    row, ids = row.clone(), torch.tensor(sorted(set(seen)))
    row[ids] = torch.where(row[ids] > 0, row[ids] / penalty, row[ids] * penalty)
    return row


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_repetition_penalty_matches_the_reference_argmax(llm, model, prompts, penalty):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                            repetition_penalty=penalty)  # fmt: skip
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] != [o.token_ids for o in llm.generate(prompts, plain)]
    for prompt, output in zip(prompts, outputs):
        generated = list(output.token_ids)
        logits = reference_logits(model, prompt, generated)
        for step, token in enumerate(generated):
            row = repetition_penalized(logits[step], prompt + generated[:step], penalty)
            assert row[token] >= row.max() - TIE, f"step {step}"


def test_min_p_draws_never_leave_the_allowed_set(llm, model, prompts):
    temperature, min_p = 1.5, 0.2
    narrowed = 0
    for seed in range(4):
        params = SamplingParams(max_tokens=10, temperature=temperature, min_p=min_p, seed=seed,
                                ignore_eos=True)  # fmt: skip
        for prompt, output in zip(prompts, llm.generate(prompts, params)):
            generated = list(output.token_ids)
            probs = torch.softmax(reference_logits(model, prompt, generated) / temperature, -1)
            threshold = min_p * probs.max(-1).values  # [T]
            chosen = probs[torch.arange(len(generated)), generated]  # [T]
            assert (chosen >= threshold * (1 - TIE)).all()
            narrowed += int((probs < threshold[:, None]).sum())
    assert narrowed > 0  # min_p did remove tokens at these settings


def first_new_token_step(tokens: list[int]) -> int:
    """A step >= 1 whose greedy token did not appear before it (and is no EOS)."""
    return next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k] + [1, 3])


def test_stop_token_ids_end_with_stop_and_hide_their_text(llm, prompts):
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    greedy = list(llm.generate(prompts[0], plain)[0].token_ids)
    k = first_new_token_step(greedy)
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[greedy[k]])
    (output,) = llm.generate(prompts[0], params)
    assert output.finish_reason == "stop" and list(output.token_ids) == greedy[: k + 1]
    assert output.text == llm.tokenizer.decode(greedy[:k])
    kept = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[greedy[k]],
                          include_stop_str_in_output=True)  # fmt: skip
    assert llm.generate(prompts[0], kept)[0].text == llm.tokenizer.decode(greedy[: k + 1])


def test_min_tokens_masks_the_stop_ids_and_eos(llm, model, prompts):
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    greedy = list(llm.generate(prompts[0], plain)[0].token_ids)
    k = first_new_token_step(greedy)
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[greedy[k]],
                            min_tokens=k + 3)  # fmt: skip
    (output,) = llm.generate(prompts[0], params)
    generated = list(output.token_ids)
    assert len(generated) >= k + 3
    banned = [greedy[k], EOS_ID, 3]  # the stop id and the tiny model's two EOS ids
    assert not set(generated[: k + 3]) & set(banned)
    logits = reference_logits(model, prompts[0], generated)
    for step in range(k + 3):  # each token is the argmax with the banned ones masked
        row = logits[step].clone()
        row[banned] = float("-inf")
        assert row[generated[step]] >= row.max() - TIE
    # EOS all but forced: it ends the request right after min_tokens
    eos = SamplingParams(max_tokens=16, temperature=0, logit_bias={EOS_ID: 100.0}, min_tokens=4)
    (output,) = llm.generate(prompts[0], eos)
    assert output.finish_reason == "stop" and len(output.token_ids) == 5
    assert output.token_ids[-1] == EOS_ID and EOS_ID not in output.token_ids[:4]


def test_stop_strings_wait_for_min_tokens_and_can_be_kept(llm, prompts):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = llm.generate(prompts[1], plain)[0].text
    stop = text[1:4]  # found at the first tokens
    stopped = llm.generate(prompts[1], SamplingParams(**_greedy12(), stop=stop))[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]
    kept = SamplingParams(**_greedy12(), stop=stop, include_stop_str_in_output=True)
    assert llm.generate(prompts[1], kept)[0].text == text[: text.index(stop) + len(stop)]
    late = SamplingParams(**_greedy12(), stop=stop, min_tokens=12)
    output = llm.generate(prompts[1], late)[0]
    assert len(output.token_ids) == 12 and output.text.startswith(text[: text.index(stop) + 3])


def _greedy12() -> dict:
    return dict(max_tokens=12, temperature=0, ignore_eos=True)


def test_skip_special_tokens_false_shows_them(llm, prompts):
    forced = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={IM_START_ID: 100.0})
    hidden = llm.generate(prompts[0], SamplingParams(**forced))[0]
    shown = llm.generate(prompts[0], SamplingParams(**forced, skip_special_tokens=False))[0]
    assert list(hidden.token_ids) == list(shown.token_ids) == [IM_START_ID] * 3
    assert hidden.text == "" and shown.text == SPECIAL_TOKENS[IM_START_ID] * 3


MIXED = [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(max_tokens=10, temperature=1.2, min_p=0.2, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0, min_tokens=6, stop_token_ids=[7, 8]),
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    SamplingParams(
        max_tokens=10,
        temperature=0.8,
        top_k=50,
        seed=2,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        min_p=0.05,
        ignore_eos=True,
    ),  # fmt: skip
]


def test_a_mixed_batch_gives_each_row_its_alone_tokens(llm, prompts):
    rows = [prompts[i % len(prompts)] for i in range(len(MIXED))]
    alone = [llm.generate(p, params)[0].token_ids for p, params in zip(rows, MIXED)]
    batched = rayinfer.LLM("tiny", device="cpu", dtype="float32").generate(rows, MIXED)
    assert [o.token_ids for o in batched] == alone


def test_the_repetition_penalty_survives_preemption_and_the_hand_off(llm, prompts):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                            repetition_penalty=1.5, min_tokens=3)  # fmt: skip
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    tight = rayinfer.LLM("tiny", device="cpu", dtype="float32", block_size=4, num_kv_blocks=16,
                         max_model_len=48)  # fmt: skip
    assert [o.token_ids for o in tight.generate(prompts, params)] == alone
    assert tight.engine.scheduler.num_preemptions > 0
    decode = rayinfer.LLM("tiny", device="cpu", dtype="float32", block_size=8)
    handed_off = decode.decode(llm.prefill(prompts, params), params)
    assert [o.token_ids for o in handed_off] == alone


def test_stop_token_ids_outside_the_vocabulary_name_the_field(llm, prompts):
    with pytest.raises(InvalidRequestError, match="^stop_token_ids: ") as error:
        llm.generate(prompts[0], SamplingParams(stop_token_ids=[10**6]))
    assert error.value.field == "stop_token_ids"
