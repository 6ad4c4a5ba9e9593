"""The offline engine end to end on a real (tiny, random) checkpoint: continuous batching,
preemption, prefix caching, the prefill -> decode hand-off and input validation."""

import pytest

import rayinfer
from rayinfer.config import ConfigError
from rayinfer.engine.sampling_params import InvalidRequestError
from tests.engine.test_chat_template import QWEN3_THINKING_TEMPLATE
from tests.models.harness import TINY_DENSE, make_hf_checkpoint, make_prompts

GREEDY = rayinfer.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", **TINY_DENSE)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(TINY_DENSE["vocab_size"], lengths=(5, 23, 3, 40, 9))


@pytest.fixture(scope="module")
def alone(checkpoint, prompts):
    """Each prompt generated on its own: the reference every batching scheme must equal."""
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts]


def test_batch_equals_each_prompt_alone(checkpoint, prompts, alone):
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == alone
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outputs)


@pytest.mark.parametrize("held", [False, True], ids=["admitted_at_once", "held_back"])
def test_requests_joining_mid_flight_give_their_alone_tokens(checkpoint, prompts, alone, held):
    """Also with prompts held back while others decode (waiting_served_ratio): they wait, then
    join, and every request still gets the tokens it gets alone."""
    hold = dict(waiting_served_ratio=2.0, max_waiting_steps=4) if held else {}
    llm = rayinfer.LLM(str(checkpoint), device="cpu", max_num_batched_tokens=16, **hold)
    engine = llm.engine
    finished = {}
    pending = list(enumerate(prompts))
    steps = held_steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new request every third step, others mid-decode
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, GREEDY)
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.token_ids
        held_steps += engine.scheduler.held_steps > 0
        steps += 1
    assert [finished[i] for i in range(len(prompts))] == alone
    assert (held_steps > 0) == held


def test_preemption_under_a_tiny_cache_gives_the_same_tokens(checkpoint, prompts, alone):
    llm = rayinfer.LLM(
        str(checkpoint), device="cpu", block_size=4, num_kv_blocks=20, max_model_len=64
    )
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == alone


def test_shared_prefix_reuses_cached_blocks(checkpoint, prompts, alone):
    llm = rayinfer.LLM(str(checkpoint), device="cpu", block_size=4)
    llm.generate(prompts[3], GREEDY)  # 40 tokens: 10 full blocks enter the cache
    variant = prompts[3][:32] + [1, 2, 3]
    fresh = rayinfer.LLM(str(checkpoint), device="cpu", block_size=4, enable_prefix_caching=False)
    output = llm.generate(variant, GREEDY)[0]
    assert output.num_cached_tokens == 32
    assert llm.engine.block_manager.num_prefix_hit_tokens == 32
    assert output.token_ids == fresh.generate(variant, GREEDY)[0].token_ids
    assert llm.generate(prompts[3], GREEDY)[0].token_ids == alone[3]


def test_prefill_hands_off_to_a_second_engine(checkpoint, prompts, alone):
    prefill = rayinfer.LLM(str(checkpoint), device="cpu", block_size=8)
    decode = rayinfer.LLM(str(checkpoint), device="cpu", block_size=4)
    handoffs = prefill.prefill(prompts, GREEDY)
    assert all(h.payload is not None and h.num_bytes > 0 for h in handoffs)
    assert prefill.engine.block_manager.num_free_blocks == prefill.cache_config.num_blocks
    outputs = decode.decode(handoffs, GREEDY)
    assert [o.token_ids for o in outputs] == alone


def test_seeded_sampling_survives_the_hand_off(checkpoint, prompts):
    params = rayinfer.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    single = rayinfer.LLM(str(checkpoint), device="cpu")
    expected = single.generate(prompts[1], params)[0].token_ids
    prefill = rayinfer.LLM(str(checkpoint), device="cpu")
    decode = rayinfer.LLM(str(checkpoint), device="cpu")
    assert decode.decode(prefill.prefill(prompts[1], params), params)[0].token_ids == expected


def test_seed_makes_sampling_reproducible(checkpoint, prompts):
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    params = rayinfer.SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=11)
    first = llm.generate(prompts[:3], params)
    again = llm.generate(prompts[:3], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]


def test_eos_ends_a_request_unless_ignored(checkpoint, prompts, alone):
    eos = alone[0][4]
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    llm.engine.eos_token_ids = {eos}
    stopped = llm.generate(prompts[0], rayinfer.SamplingParams(max_tokens=12, temperature=0))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == alone[0][: alone[0].index(eos) + 1]
    assert llm.generate(prompts[0], GREEDY)[0].token_ids == alone[0]


def test_abort_frees_the_request(checkpoint, prompts):
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    llm.engine.add_request("x", prompts[3], GREEDY)
    llm.engine.step()
    llm.engine.abort("x")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.cache_config.num_blocks


def test_requests_finishing_together_are_freed_in_one_executor_call(checkpoint, prompts):
    """A worker group makes one remote call per worker for each free: the engine frees every
    request that finished in a step at once, and their sampling generators are gone."""
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    executor, calls = llm.engine.executor, []
    free = executor.free_requests
    executor.free_requests = lambda ids: calls.append(list(ids)) or free(ids)
    seeded = rayinfer.SamplingParams(max_tokens=3, temperature=1.0, seed=7, ignore_eos=True)
    outputs = llm.generate(prompts[:4], seeded)
    assert calls == [[o.request_id for o in outputs]] and executor.runner.sampler.generators == {}


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([[]], GREEDY, "prompt"),
        (list(range(70)), GREEDY, "prompt"),
        ([1, 2, 999], GREEDY, "prompt"),
        ("text without a tokenizer", GREEDY, "prompt"),
        ([1, 2, 3], rayinfer.SamplingParams(stop="a"), "stop"),  # no tokenizer: no text
    ],
)
def test_bad_requests_fail_clearly(checkpoint, prompt, params, field):
    llm = rayinfer.LLM(str(checkpoint), device="cpu", max_model_len=64)
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(prompt, params)
    assert error.value.field == field
    assert not llm.engine.has_unfinished_requests()


def test_bad_configuration_names_the_key(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="model="):
        rayinfer.LLM(str(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match="device="):
        rayinfer.LLM(str(checkpoint), device="tpu")
    with pytest.raises(ConfigError, match="dtype="):
        rayinfer.LLM(str(checkpoint), device="cpu", dtype="float8")
    with pytest.raises(ConfigError, match="max_model_len"):
        rayinfer.LLM(str(checkpoint), device="cpu", max_model_len=1000, num_kv_blocks=4)


def test_dummy_load_format_needs_only_config_json(checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    llm = rayinfer.LLM(str(tmp_path), device="cpu", load_format="dummy")
    output = llm.generate([1, 2, 3], GREEDY)[0]
    assert len(output.token_ids) == 12
    with pytest.raises(ConfigError, match="load_format"):
        rayinfer.LLM(str(tmp_path), device="cpu", load_format="npz")


def test_hand_off_that_ends_at_its_first_token_is_still_reported(checkpoint, prompts, alone):
    """max_tokens=1: nothing is left to decode, yet the decode engine reports the request."""
    one = rayinfer.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill = rayinfer.LLM(str(checkpoint), device="cpu")
    handoff = prefill.prefill(prompts[0], GREEDY)[0]
    decode = rayinfer.LLM(str(checkpoint), device="cpu")
    decode.engine.add_prefilled_request(handoff, one)
    assert decode.engine.has_unfinished_requests()
    (output,) = decode.engine.step()
    assert output.finish_reason == "length" and output.token_ids == alone[0][:1]
    assert not decode.engine.has_unfinished_requests()


def test_penalties_change_greedy_text_and_survive_the_hand_off(checkpoint, prompts, alone):
    penalized = rayinfer.SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
    )
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    tokens = [o.token_ids for o in llm.generate(prompts, penalized)]
    assert tokens != alone
    repeats = sum(len(t) - len(set(t)) for t in tokens)
    assert repeats < sum(len(t) - len(set(t)) for t in alone)
    decode = rayinfer.LLM(str(checkpoint), device="cpu")
    handed_off = decode.decode(llm.prefill(prompts, penalized), penalized)
    assert [o.token_ids for o in handed_off] == tokens


def test_chat_applies_the_template_of_the_built_in_model():
    llm = rayinfer.LLM("tiny", device="cpu")
    messages = [{"role": "user", "content": "Hello!"}]
    params = rayinfer.SamplingParams(max_tokens=6, temperature=0)
    (reply,) = llm.chat(messages, params)
    prompt_ids = llm.tokenizer.encode(
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert reply.prompt_token_ids == prompt_ids
    assert reply.token_ids == llm.generate([prompt_ids], params)[0].token_ids
    assert len(llm.chat([messages, messages], params)) == 2


def test_chat_without_a_tokenizer_says_why(checkpoint):
    with pytest.raises(ConfigError, match="chat template"):
        rayinfer.LLM(str(checkpoint), device="cpu").chat([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def tiny_llm():
    return rayinfer.LLM("tiny", device="cpu")


def chatml_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


STORY = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon"},
]
SHORT = rayinfer.SamplingParams(max_tokens=2, temperature=0)


def test_chat_takes_vllms_template_options(tiny_llm):
    (open_ended,) = tiny_llm.chat(
        STORY, SHORT, add_generation_prompt=False, continue_final_message=True
    )
    asked = "<|im_start|>user\nTell me a story.<|im_end|>\n"
    assert open_ended.prompt_token_ids == chatml_ids(
        tiny_llm, asked + "<|im_start|>assistant\nOnce upon"
    )
    (no_header,) = tiny_llm.chat(STORY[:1], SHORT, add_generation_prompt=False)
    assert no_header.prompt_token_ids == chatml_ids(tiny_llm, asked)
    for options, field in [
        (dict(continue_final_message=True), "continue_final_message"),
        (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
    ]:
        with pytest.raises(InvalidRequestError) as caught:
            tiny_llm.chat(STORY, SHORT, **options)
        assert caught.value.field == field


def test_chat_template_kwargs_reach_the_template(tiny_llm, monkeypatch):
    monkeypatch.setattr(tiny_llm.tokenizer, "chat_templates", {"default": QWEN3_THINKING_TEMPLATE})
    (reply,) = tiny_llm.chat(STORY[:1], SHORT, chat_template_kwargs={"enable_thinking": False})
    text = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
    assert reply.prompt_token_ids == chatml_ids(tiny_llm, text + "<think>\n\n</think>\n\n")


# Writes an assistant's calls as Llama 3.1's template does: `arguments | tojson`
CALLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}{{ call.function.arguments | tojson }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_renders_the_prompt_the_server_renders(tiny_llm, monkeypatch):
    """A tool call's arguments reach the template as the object their text holds, offline as
    served: written once by `tojson`, not as a JSON string of the text."""
    from rayinfer.deployments.config import AppConfig
    from rayinfer.deployments.prompts import PromptBuilder
    from rayinfer.deployments.protocol import ChatCompletionRequest
    from rayinfer.deployments.runtime import ModelSource

    prompts = PromptBuilder(ModelSource.resolve(AppConfig(max_model_len=256)))
    for tokenizer in (tiny_llm.tokenizer, prompts.tokenizer):
        monkeypatch.setattr(tokenizer, "chat_templates", {"default": CALLS_TEMPLATE})
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    served_ids, _ = prompts.build(ChatCompletionRequest(messages=messages, max_tokens=2))
    (reply,) = tiny_llm.chat(messages, SHORT)
    assert reply.prompt_token_ids == served_ids
    assert '\n{"city": "Paris"}<|im_end|>' in tiny_llm.tokenizer.decode(served_ids, False)


def test_kv_cache_that_does_not_fit_names_the_setting(checkpoint):
    with pytest.raises(ConfigError, match="num_kv_blocks=4000000000000"):
        rayinfer.LLM(str(checkpoint), device="cpu", num_kv_blocks=4_000_000_000_000)


def test_profile_writes_the_busiest_operators_and_a_trace(checkpoint, prompts, tmp_path):
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    llm.start_profile(str(tmp_path / "steps"))
    llm.generate(prompts[0], GREEDY)
    (table,) = llm.stop_profile()
    assert table == str(tmp_path / "steps.txt")
    assert "aten::" in (tmp_path / "steps.txt").read_text()
    assert (tmp_path / "steps.json").stat().st_size > 0
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()


def test_logit_bias_forces_a_token_and_survives_the_hand_off(checkpoint, prompts):
    forced = rayinfer.SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, logit_bias={7: 100.0}, logprobs=0
    )
    llm = rayinfer.LLM(str(checkpoint), device="cpu")
    outputs = llm.generate(prompts, forced)
    assert all(o.token_ids == [7] * 5 for o in outputs)
    assert all(e.chosen.logprob < 0 for o in outputs for e in o.logprobs)  # the model's own
    decode = rayinfer.LLM(str(checkpoint), device="cpu")
    handed_off = decode.decode(llm.prefill(prompts, forced), forced)
    assert [o.token_ids for o in handed_off] == [[7] * 5] * len(prompts)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate(prompts[0], rayinfer.SamplingParams(logit_bias={10**6: 1.0}))
