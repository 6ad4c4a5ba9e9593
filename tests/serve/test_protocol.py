"""OpenAI request validation (400 naming the field), prompt limits, and the SSE reply format."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError
from ray.exceptions import ActorDiedError, TaskCancelledError

import rayinfer
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.engine_loop import EngineStoppedError
from rayinfer.deployments.errors import as_openai_error
from rayinfer.deployments.openai_error import OpenAIError, client_message
from rayinfer.deployments.prompts import PromptBuilder
from rayinfer.deployments.protocol import ChatCompletionRequest, CompletionRequest
from rayinfer.deployments.replies import HttpReply, unparsable_body, validation_to_openai
from rayinfer.deployments.runtime import ModelSource
from rayinfer.deployments.types import Delta, GenerateRequest, Timings
from rayinfer.engine.outputs import Logprob, RequestFailedError, TokenLogprobs
from rayinfer.engine.sampling_params import InvalidRequestError

CHAT = {"messages": [{"role": "user", "content": "x"}]}


def error_for(model, body: dict) -> OpenAIError:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return validation_to_openai(caught.value.errors())


@pytest.mark.parametrize(
    "model, body, param",
    [
        (ChatCompletionRequest, {}, "messages"),
        (ChatCompletionRequest, {"messages": []}, "messages"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
        ),
        (CompletionRequest, {"prompt": ""}, "prompt"),
        (CompletionRequest, {"prompt": "a", "max_tokens": -1}, "max_tokens"),
        (CompletionRequest, {"prompt": "a", "temperature": "hot"}, "temperature"),
        (CompletionRequest, {"prompt": "a", "top_p": 7}, "top_p"),
        (CompletionRequest, {"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -2.5},
            "frequency_penalty",
        ),
        (CompletionRequest, {"prompt": "a", "top_k": -2}, "top_k"),
        (CompletionRequest, {"prompt": "a", "min_p": 1.5}, "min_p"),
        (CompletionRequest, {"prompt": "a", "min_p": -0.1}, "min_p"),
        (CompletionRequest, {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
        (CompletionRequest, {"prompt": "a", "repetition_penalty": "2"}, "repetition_penalty"),
        (
            ChatCompletionRequest,
            {**CHAT, "repetition_penalty": float("inf")},
            "repetition_penalty",
        ),  # fmt: skip
        (CompletionRequest, {"prompt": "a", "min_tokens": -1}, "min_tokens"),
        (CompletionRequest, {"prompt": "a", "min_tokens": 1.5}, "min_tokens"),
        (CompletionRequest, {"prompt": "a", "stop_token_ids": [-3]}, "stop_token_ids"),
        (CompletionRequest, {"prompt": "a", "stop_token_ids": 5}, "stop_token_ids"),
        (CompletionRequest, {"prompt": "a", "stop_token_ids": [True]}, "stop_token_ids[0]"),
        (CompletionRequest, {"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids"),
        (CompletionRequest, {"prompt": "a", "allowed_token_ids": [-1]}, "allowed_token_ids"),
        (CompletionRequest, {"prompt": "a", "allowed_token_ids": 5}, "allowed_token_ids"),
        (ChatCompletionRequest, {**CHAT, "allowed_token_ids": ["5"]}, "allowed_token_ids[0]"),
        (CompletionRequest, {"prompt": "a", "bad_words": [""]}, "bad_words"),
        (CompletionRequest, {"prompt": "a", "bad_words": "word"}, "bad_words"),
        (ChatCompletionRequest, {**CHAT, "bad_words": [1]}, "bad_words[0]"),
        (CompletionRequest, {"prompt": "a", "bad_words": ["w"] * 129}, "bad_words"),
        (CompletionRequest, {"prompt": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (ChatCompletionRequest, {**CHAT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        (ChatCompletionRequest, {**CHAT, "truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
        (ChatCompletionRequest, {**CHAT, "truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
        (
            ChatCompletionRequest,
            {**CHAT, "include_stop_str_in_output": "yes"},
            "include_stop_str_in_output",
        ),
        (ChatCompletionRequest, {**CHAT, "skip_special_tokens": 0}, "skip_special_tokens"),
        (CompletionRequest, {"prompt": "a", "seed": -1}, "seed"),
        (CompletionRequest, {"prompt": "a", "seed": 2**63}, "seed"),
        (CompletionRequest, {"prompt": "a", "stop": [""]}, "stop"),
        (CompletionRequest, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CompletionRequest, {"prompt": "a", "stop": "x" * 257}, "stop"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": None}]},
            "messages[1].content",
        ),
        (CompletionRequest, {"prompt": [[False]]}, "prompt"),
        (CompletionRequest, {"prompt": ["a", [1]]}, "prompt"),
        (CompletionRequest, {"prompt": [[1], []]}, "prompt"),
        (CompletionRequest, {"prompt": ["a"] * 257}, "prompt"),
        (CompletionRequest, {"prompt": 7}, "prompt"),
        (CompletionRequest, {"prompt": "a", "max_tokens": "3"}, "max_tokens"),
        (CompletionRequest, {"prompt": "a", "stream": "true"}, "stream"),
        (CompletionRequest, {"prompt": "a", "echo": 1}, "echo"),
        (
            CompletionRequest,
            {"prompt": "a", "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        (
            ChatCompletionRequest,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                        ],
                    }
                ]
            },
            "messages[0].content",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content",
        ),
        (CompletionRequest, {"prompt": "a", "logprobs": 6}, "logprobs"),
        (CompletionRequest, {"prompt": "a", "best_of": 2}, "best_of"),
        (CompletionRequest, {"prompt": "a", "suffix": "end"}, "suffix"),
        (CompletionRequest, {"prompt": "a", "logit_bias": {"x": -100}}, "logit_bias"),
        (CompletionRequest, {"prompt": "a", "logit_bias": {"5": "1"}}, "logit_bias.5"),
        (
            CompletionRequest,
            {"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}},
            "logit_bias",
        ),
        (ChatCompletionRequest, {**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (ChatCompletionRequest, {**CHAT, "top_logprobs": 2}, "top_logprobs"),  # no logprobs
        # a union's field is named as sent, not by pydantic's member ('stop.str')
        (CompletionRequest, {"prompt": "a", "stop": 123}, "stop"),
        (CompletionRequest, {"prompt": "a", "stop": [1]}, "stop"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": ["a"]}]},
            "messages[0].content",
        ),
        (CompletionRequest, {"prompt": "a", "guided_json": 5}, "guided_json"),
        (
            CompletionRequest,
            {"prompt": "a", "structured_outputs": {"json": [1]}},
            "structured_outputs.json",
        ),
        (
            CompletionRequest,
            {
                "prompt": "a",
                "response_format": {"type": "json_schema", "json_schema": {"schema": 1}},
            },
            "response_format.json_schema.schema",
        ),
        # the nested objects take JSON's types strictly, as the body does
        (
            CompletionRequest,
            {
                "prompt": "a",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {}, "strict": "true"},
                },
            },
            "response_format.json_schema.strict",
        ),
        # a lone UTF-16 surrogate ("\ud800" in the JSON) anywhere, a key too: named where it is
        (CompletionRequest, {"prompt": "a\ud800"}, "prompt"),
        (CompletionRequest, {"prompt": ["a", "b\udc00"]}, "prompt[1]"),
        (CompletionRequest, {"prompt": "a", "model": "\udfff"}, "model"),
        (CompletionRequest, {"prompt": "a", "logit_bias": {"\ud800": 1}}, "logit_bias"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages[0].content[0].text",
        ),
        (
            ChatCompletionRequest,
            {**CHAT, "response_format": {"type": "yaml"}},  # json_object and json_schema work
            "response_format.type",
        ),
    ],
)
def test_invalid_fields_answer_400_naming_them(model, body, param):
    error = error_for(model, body)
    assert error.status == 400
    assert error.param == param
    assert error.message.startswith(f"{param}: ")
    assert error.body()["error"]["param"] == param
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_stream_options_without_a_stream_are_ignored():
    """OpenAI's and vLLM's servers refuse them; clients reuse a streamed body with stream
    false, and the options change nothing then."""
    request = CompletionRequest(prompt="a", stream_options={"include_usage": True})
    assert not request.stream


def test_unknown_fields_are_ignored_and_prompts_list_the_batch():
    request = CompletionRequest.model_validate({"prompt": [[1, 2, 3]], "user": "me"})
    assert request.prompts == [[1, 2, 3]]
    assert CompletionRequest(prompt=[1, 2]).prompts == [[1, 2]]
    batch = CompletionRequest(prompt=["a", "b"], max_tokens=3)
    assert [one.prompt for one in map(batch.for_prompt, batch.prompts)] == ["a", "b"]
    assert batch.for_prompt("b").max_tokens == 3


def test_the_image_part_error_names_its_part():
    parts = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}]
    error = error_for(ChatCompletionRequest, {"messages": [{"role": "user", "content": parts}]})
    assert "part 1 has type 'image_url'" in error.message


def test_logit_bias_reaches_the_sampling_params_with_int_ids():
    request = CompletionRequest(prompt="a", logit_bias={"5": -100, "7": 2.5})
    assert request.sampling_params(3).logit_bias == ((5, -100.0), (7, 2.5))
    assert CompletionRequest(prompt="a").sampling_params(3).logit_bias == ()


def test_vllm_sampling_extensions_reach_the_sampling_params():
    body = {
        **CHAT,
        "top_k": 0,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "stop_token_ids": [7, 9],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    params = ChatCompletionRequest.model_validate(body).sampling_params(5)
    assert (params.top_k, params.min_p, params.repetition_penalty) == (-1, 0.1, 1.2)
    assert (params.min_tokens, params.stop_token_ids) == (2, (7, 9))
    assert params.include_stop_str_in_output and not params.skip_special_tokens
    default = CompletionRequest(prompt="a").sampling_params(5)
    assert default == rayinfer.SamplingParams(max_tokens=5)
    handle = GenerateRequest(prompt=[1], min_p=0.5, stop_token_ids=(3,)).sampling_params(4)
    assert (handle.min_p, handle.stop_token_ids) == (0.5, (3,))


def test_token_filters_reach_the_sampling_params(prompts):
    body = {**CHAT, "allowed_token_ids": [9, 7, 9], "bad_words": ["day", "day"]}
    params = ChatCompletionRequest.model_validate(body).sampling_params(5)
    assert params.allowed_token_ids == (9, 7) and params.bad_words == ("day",)
    assert params.bad_words_token_ids is None  # tokenized by PromptBuilder, below
    _, built = prompts.build(CompletionRequest(prompt=[1, 2], bad_words=["day"]))
    day, spaced = (prompts.tokenizer.encode(w, add_special_tokens=False) for w in ("day", " day"))
    assert built.bad_words_token_ids == (tuple(day), tuple(spaced))
    handle = GenerateRequest(prompt=[1], allowed_token_ids=(3,), truncate_prompt_tokens=-1)
    assert handle.sampling_params(4).allowed_token_ids == (3,)


LONG = list(range(10, 80))  # more than max_model_len=64


@pytest.mark.parametrize(
    "body, param",
    [
        ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
        ({"bad_words": ["\u2003"]}, "bad_words"),  # only a space: no token
        ({"bad_words": [f"w{i}" for i in range(65)]}, "bad_words"),  # > 128 token sequences
        ({"prompt": LONG, "truncate_prompt_tokens": 60, "max_tokens": 5}, "truncate_prompt_tokens"),
        ({"prompt": LONG, "truncate_prompt_tokens": -1}, "prompt"),  # 64 kept: no room left
    ],
)
def test_token_filters_the_model_refuses_answer_400_naming_them(prompts, body, param):
    with pytest.raises(OpenAIError, match=f"^{param}: ") as error:
        prompts.build(CompletionRequest(**{"prompt": [1, 2], **body}))
    assert error.value.status == 400 and error.value.param == param


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(prompts):
    kept, params = prompts.build(CompletionRequest(prompt=LONG, truncate_prompt_tokens=20))
    assert kept == LONG[-20:] and params.max_tokens == 44  # the rest of max_model_len=64
    assert params.truncate_prompt_tokens is None  # the engine gets the prompt truncated
    kept, _ = prompts.build(CompletionRequest(prompt=LONG, truncate_prompt_tokens=-1, max_tokens=4))
    assert kept == LONG[-60:]
    text = "The quick brown fox jumps over the lazy dog and the farmer watches from the gate."
    kept, _ = prompts.build(CompletionRequest(prompt=text, truncate_prompt_tokens=6))
    whole = prompts.tokenizer.encode(text)
    assert kept == whole[:1] + whole[-5:]  # the BOS stays, as transformers' left truncation
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": text}])
    whole, _ = prompts.build(chat)
    kept, _ = prompts.build(chat.model_copy(update={"truncate_prompt_tokens": 7}))
    assert kept == whole[-7:]


def test_min_tokens_above_max_tokens_names_min_tokens(prompts):
    with pytest.raises(OpenAIError, match="^min_tokens: ") as error:
        prompts.build(CompletionRequest(prompt=[1, 2], max_tokens=3, min_tokens=4))
    assert error.value.status == 400 and error.value.param == "min_tokens"


def test_generate_request_needs_prompt_or_messages():
    with pytest.raises(ValidationError, match="exactly one of prompt or messages"):
        GenerateRequest(max_tokens=3)
    with pytest.raises(ValidationError, match="prompt must not be empty"):
        GenerateRequest(prompt=[])


@pytest.fixture(scope="module")
def prompts() -> PromptBuilder:
    return PromptBuilder(ModelSource.resolve(AppConfig(max_model_len=64)))


def test_prompt_limits_name_the_field(prompts):
    too_long = CompletionRequest(prompt=list(range(10, 80)))
    with pytest.raises(OpenAIError, match="maximum context length is 64") as error:
        prompts.build(too_long)
    assert error.value.param == "prompt"
    with pytest.raises(OpenAIError) as error:
        prompts.build(CompletionRequest(prompt=[1, 2, 3], max_tokens=62))
    assert error.value.param == "max_tokens"
    with pytest.raises(OpenAIError) as error:
        prompts.build(CompletionRequest(prompt=[1, 10**6]))
    assert error.value.param == "prompt"
    chat = ChatCompletionRequest(**CHAT, max_completion_tokens=10**6)
    with pytest.raises(OpenAIError, match="^max_completion_tokens: ") as error:
        prompts.build(chat)
    assert error.value.param == "max_completion_tokens"


def test_default_max_tokens_fills_the_context(prompts):
    prompt_ids, params = prompts.build(CompletionRequest(prompt=[5, 6, 7], temperature=0))
    assert prompt_ids == [5, 6, 7]
    assert params.max_tokens == 61 and params.is_greedy


def test_chat_prompt_uses_the_template(prompts):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    prompt_ids, _ = prompts.build(request)
    assert prompt_ids == prompts.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])


# How Qwen3's template writes an assistant's calls and a tool's result
CALLS_TEMPLATE = (
    "{% for m in messages %}{% if m.tool_calls %}{% for call in m.tool_calls %}"
    '[{{ call.id }}]<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response {{ m.tool_call_id }}>{{ m.content }}"
    "</tool_response>{% else %}{{ m.role }}: {{ m.content }}{% endif %}{% endfor %}"
)


def rendered_chat(prompts, monkeypatch, template: str, chat: ChatCompletionRequest | list) -> str:
    """The text the server's prompt builder renders for a chat request (or its messages)
    through this template."""
    texts = []

    def encode(text, add_special_tokens=True):
        texts.append(text)
        return [1]

    if isinstance(chat, list):
        chat = ChatCompletionRequest.model_validate({"messages": chat})
    with monkeypatch.context() as patch:
        patch.setattr(prompts.tokenizer, "chat_templates", {"default": template})
        patch.setattr(prompts.tokenizer, "encode", encode)
        prompts.build(chat)
    return texts[0]


def test_tool_calls_and_results_reach_the_template(prompts, monkeypatch):
    """The calls an assistant made (content null) and their results reach the template, added
    keys (a stream's index) kept; the request itself keeps the client's arguments text."""
    call = {"id": "call_1", "type": "function", "index": 0,
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    request = ChatCompletionRequest.model_validate({"messages": messages})
    text = rendered_chat(prompts, monkeypatch, CALLS_TEMPLATE, messages)
    assert text == (
        'user: Weather?[call_1]<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}'
        "</tool_call><tool_response call_1>sunny</tool_response>"
    )
    prompts.build(request)  # the tiny model's template renders it too
    sent = request.chat_messages()
    assert sent[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


# A call as real templates write it (the assistant's other messages write nothing):
# Llama 3.1's `tojson` of whatever arguments are,
LLAMA_CALL = (
    "{% for m in messages %}{% for call in m.tool_calls or [] %}"
    "{{- '{\"name\": \"' + call.function.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}' }}{% endfor %}{% endfor %}"
)
# Qwen3's and Hermes' text as it is or `tojson` of an object,
QWEN_CALL = (
    "{% for m in messages %}{% for call in m.tool_calls or [] %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    '{{- \'{"name": "\' }}{{- call.name }}{{- \'", "arguments": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}{{- '}' }}{% endfor %}{% endfor %}"
)
# DeepSeek V3's `+` of the arguments as text,
DEEPSEEK_CALL = (
    "{% for m in messages %}{% for tool in m.tool_calls or [] %}"
    "{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>' }}{% endfor %}{% endfor %}"
)
# and GLM-4.5's key/value pairs of an object.
GLM_CALL = (
    "{% for m in messages %}{% for tc in m.tool_calls or [] %}"
    "{%- if tc.function %}{%- set tc = tc.function %}{%- endif %}"
    "{{- '<tool_call>' + tc.name -}}{% set _args = tc.arguments %}"
    "{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>"
    "{% endfor %}</tool_call>{% endfor %}{% endfor %}"
)
COMPACT = '{"days":2,"city":"Paris","note":"m\\u00e9t\\u00e9o"}'  # keys out of order


def _call_history(arguments: str) -> list:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize(
    "template, arguments, written",
    [
        # JSON once, not a string of it ("{\"city\": ...}")
        (LLAMA_CALL, '{"city": "Paris", "days": 2}',
         '{"name": "weather", "parameters": {"city": "Paris", "days": 2}}'),
        # an object's tojson: the client's key order, json.dumps' spacing, no \u escapes
        (LLAMA_CALL, COMPACT,
         '{"name": "weather", "parameters": {"days": 2, "city": "Paris", "note": "météo"}}'),
        (QWEN_CALL, COMPACT,
         '{"name": "weather", "arguments": {"days": 2, "city": "Paris", "note": "météo"}}'),
        (QWEN_CALL, '{"city": "Paris", "days": 2}',
         '{"name": "weather", "arguments": {"city": "Paris", "days": 2}}'),
        # text the template adds to a string is the client's own
        (DEEPSEEK_CALL, COMPACT,
         f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{COMPACT}\n```"
         "<｜tool▁call▁end｜>"),
        (GLM_CALL, COMPACT,
         "<tool_call>weather<arg_key>days</arg_key><arg_value>2</arg_value>"
         "<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "<arg_key>note</arg_key><arg_value>météo</arg_value></tool_call>"),
    ],
    ids=["llama", "llama-compact", "qwen-compact", "qwen", "deepseek", "glm"],
)  # fmt: skip
def test_tool_call_arguments_reach_the_template_as_their_object(
    prompts, monkeypatch, template, arguments, written
):
    """As vLLM passes them and transformers' tool-use docs ask: a JSON object's text as the
    object, so that templates writing `tojson` of it encode it once."""
    assert rendered_chat(prompts, monkeypatch, template, _call_history(arguments)) == written


@pytest.mark.parametrize(
    "arguments",
    ['{"city": "Pa', "", "[1]", '"Paris"', "null", "{'city': 'Paris'}", "[" * 100_000],
    ids=["cut-off", "empty", "list", "string", "null", "python", "too-deep"],
)
def test_tool_call_arguments_not_a_json_object_reach_the_template_as_sent(
    prompts, monkeypatch, arguments
):
    """A call cut off by max_tokens, JSON that is no object, or text too deeply nested to
    parse: the client's text."""
    text = rendered_chat(prompts, monkeypatch, QWEN_CALL, _call_history(arguments))
    assert text == '{"name": "weather", "arguments": ' + arguments + "}"


def test_parsing_tool_call_arguments_leaves_the_request_as_sent(prompts, monkeypatch):
    messages = _call_history(COMPACT)
    request = ChatCompletionRequest.model_validate({"messages": messages})
    rendered_chat(prompts, monkeypatch, GLM_CALL, request)
    assert request.chat_messages()[1]["tool_calls"] == messages[1]["tool_calls"]
    assert request.messages[1].tool_calls[0]["function"]["arguments"] == COMPACT


async def deltas_then(error: Exception | None = None):
    yield Delta("Hel", [1], None, num_cached_tokens=4)
    yield Delta("lo", [2, 3], None)
    if error is not None:
        raise error
    yield Delta("!", [4], "length")


def collect_events(reply: HttpReply, deltas) -> list:
    async def run():
        return [event async for event in reply.stream(deltas, Timings(ttft_s=0.5))]

    events = asyncio.run(run())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_chat_stream_events():
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    bodies = collect_events(HttpReply("chatcmpl-1", "tiny", True, request, 7), deltas_then())
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(b["choices"][0]["delta"].get("content", "") for b in bodies[1:-1])
    assert text == "Hello!"
    assert bodies[-2]["choices"][0]["finish_reason"] == "length"
    assert bodies[-1]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 4,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert [b["usage"] for b in bodies[:-1]] == [None] * (len(bodies) - 1)  # null, as OpenAI's
    assert {b["object"] for b in bodies} == {"chat.completion.chunk"}


async def deltas_with_an_empty_text():
    yield Delta("", [9], None)  # e.g. the first byte of a character: no text yet
    yield Delta("é", [10], "length")


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_counts_every_token_even_an_empty_one(chat):
    fields = CHAT if chat else {"prompt": "x"}
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = (ChatCompletionRequest if chat else CompletionRequest)(
        **fields, stream=True, stream_options=options
    )
    reply = HttpReply("id-1", "tiny", chat, request, 3)
    bodies = collect_events(reply, deltas_with_an_empty_text())
    counts = [b["usage"]["completion_tokens"] for b in bodies]
    assert counts == ([0, 1, 2, 2] if chat else [1, 2, 2])  # role chunk, tokens, usage chunk
    assert bodies[-1]["choices"] == []


def test_usage_only_at_the_end_without_continuous_usage():
    request = CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True})
    bodies = collect_events(HttpReply("id-1", "tiny", False, request, 3), deltas_then())
    assert [b["usage"] is None for b in bodies] == [True, True, True, False]
    plain = CompletionRequest(prompt="x", stream=True)  # no usage asked: no usage key at all
    bodies = collect_events(HttpReply("id-2", "tiny", False, plain, 3), deltas_then())
    assert not any("usage" in b for b in bodies)


def test_stream_error_is_reported_in_band_then_done():
    request = CompletionRequest(prompt="x", stream=True, rayinfer_timings=True)
    reply = HttpReply("cmpl-1", "tiny", False, request, 1)
    bodies = collect_events(reply, deltas_then(RequestFailedError("cmpl-1", "NaN logits")))
    assert [b["choices"][0]["text"] for b in bodies[:2]] == ["Hel", "lo"]
    assert bodies[2]["error"]["message"] == "the engine could not finish this request: NaN logits"
    assert bodies[2]["error"]["request_id"] == "cmpl-1"
    assert bodies[3]["rayinfer_timings"]["ttft_s"] == 0.5


def ray_wrapped(cause: Exception) -> Exception:
    """What a handle raises for an exception a replica raised: the remote traceback, the pid
    and colour codes in its text."""
    from ray.exceptions import RayTaskError

    traceback = "Traceback (most recent call last):\n  File 'engine.py'\nboom"
    return RayTaskError("prefill", traceback, cause, pid=4321, ip="10.0.0.1").as_instanceof_cause()


@pytest.mark.parametrize(
    "error, status, message",
    [
        (RequestFailedError("r", "seed=3: Overflow"), 500, "could not finish this request: seed"),
        (InvalidRequestError("seed", "seed=-1 must be in 0..9"), 400, "seed: seed=-1"),
        (EngineStoppedError("ActorDiedError"), 503, "is being replaced; retry"),
        (ActorDiedError(), 503, "is being replaced; retry"),
        (RuntimeError("\x1b[31mpid=7 actor_id=abc\x1b[0m"), 500, "under request id cmpl-9"),
        # Serve cancelled the request: its client went away (no server error, no 500 logged)
        (TaskCancelledError(), 499, "the client closed the request"),
    ],
)
@pytest.mark.parametrize("wrapped", [False, True])
def test_errors_reach_the_client_without_internals(error, status, message, wrapped, caplog):
    answer = as_openai_error(ray_wrapped(error) if wrapped else error, "cmpl-9")
    assert answer.status == status and message in answer.message
    text = json.dumps(answer.body())
    for leak in ("Traceback", "actor_id", "pid=", "\x1b", "\\u001b", "10.0.0.1"):
        assert leak not in text
    assert answer.body()["error"]["request_id"] == "cmpl-9"
    if status >= 500:  # the whole error is in the server log, under the request id
        assert "cmpl-9" in caplog.text and type(error).__name__ in caplog.text
        assert not wrapped or "pid=4321" in caplog.text
    else:
        assert "Traceback" not in caplog.text


def test_client_messages_are_one_short_line_without_escapes():
    assert client_message("\x1b[1;31mboom\x1b[0m\nTraceback ...") == "boom"
    assert len(client_message("x" * 5000)) == 500
    # a lone surrogate (a model name quoted back) would make the body impossible to encode
    assert client_message("model `\ud800`") == "model `\\ud800`"


def test_an_undecodable_body_says_why():
    undecodable = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    assert "not UTF-8" in unparsable_body(undecodable)
    assert "nest too deeply" in unparsable_body(RecursionError())
    assert unparsable_body(ValueError()) == "malformed JSON body"


def test_an_empty_body_names_the_routes_required_field():
    missing_body = [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
    error = validation_to_openai(missing_body, "messages", "req-1")
    assert error.param == "messages" and error.message.startswith("messages: field required")
    assert error.body()["error"]["request_id"] == "req-1"


def test_a_huge_prompt_is_refused_before_tokenizing(prompts, monkeypatch):
    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(prompts.tokenizer, "encode", no_tokenizing)
    monkeypatch.setattr(prompts.tokenizer, "encode_chat", no_tokenizing)
    huge = "fox " * 200_000
    with pytest.raises(OpenAIError, match="800000 characters cannot fit") as error:
        prompts.build(CompletionRequest(prompt=huge))
    assert error.value.param == "prompt"
    with pytest.raises(OpenAIError) as error:
        prompts.build(ChatCompletionRequest(messages=[{"role": "user", "content": huge}]))
    assert error.value.param == "messages"


def test_a_long_text_encodes_to_the_same_ids(prompts):
    from rayinfer.engine.tokenizer import GIL_FREE_ENCODE_CHARS

    text = "The quick brown fox. " * (GIL_FREE_ENCODE_CHARS // 10)
    backend = prompts.tokenizer.backend
    assert prompts.tokenizer.encode(text) == backend.encode(text).ids


def test_choices_seeds_wrap_past_the_largest():
    from rayinfer.deployments.choices import choice_params
    from rayinfer.engine.sampling_params import MAX_SEED, SamplingParams

    seeds = [p.seed for p in choice_params(SamplingParams(seed=MAX_SEED - 1), 3)]
    assert seeds == [MAX_SEED - 1, MAX_SEED, 0]


def test_whole_reply_body():
    request = CompletionRequest(prompt="x")
    reply = HttpReply("cmpl-2", "tiny", False, request, 2)
    body = asyncio.run(reply.whole(deltas_then(), Timings()))
    assert body["choices"][0]["text"] == "Hello!"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


def test_unknown_routes_answer_with_the_openai_error_body():
    from fastapi.testclient import TestClient

    from rayinfer.deployments.ingress import app

    reply = TestClient(app).get("/v1/engines")
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "Not Found"


def test_overload_is_503_with_retry_after():
    from ray.serve.exceptions import BackPressureError

    from rayinfer.deployments.ingress import error_response
    from rayinfer.deployments.pipeline import _backpressure_as_503

    async def full_decode():
        yield "never"
        raise BackPressureError(num_queued_requests=9, max_queued_requests=8)

    async def drain():
        return [item async for item in _backpressure_as_503(full_decode(), "decode")]

    with pytest.raises(OpenAIError) as caught:
        asyncio.run(drain())
    assert caught.value.status == 503 and caught.value.code == "overloaded"
    reply = error_response(caught.value)
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"


def test_stream_starts_after_the_first_delta_and_closes_the_rest():
    from rayinfer.deployments.pipeline import first_delta, prepend

    closed = []

    async def deltas(fail: bool):
        try:
            if fail:
                raise RuntimeError("prefill replica died")
            yield Delta("a", [1], None)
            yield Delta("b", [2], "stop")
        finally:
            closed.append(fail)

    async def run():
        source = deltas(False)
        first = await first_delta(source)
        return [d.text async for d in prepend(first, source)]

    assert asyncio.run(run()) == ["a", "b"]
    with pytest.raises(RuntimeError, match="prefill replica died"):  # the route maps it
        asyncio.run(first_delta(deltas(True)))
    assert closed == [False, True]


def entry(token_id: int, text: str, logprob: float, top=()) -> TokenLogprobs:
    return TokenLogprobs(Logprob(token_id, logprob, text), [Logprob(i, lp, t) for i, t, lp in top])


async def deltas_with_logprobs():
    yield Delta("Hel", [1], None, [entry(1, "Hel", -0.5, [(1, "Hel", -0.5), (9, "Ha", -1.5)])])
    yield Delta("lo", [2], "length", [entry(2, "lo", -0.25, [(2, "lo", -0.25), (8, None, -2.0)])])


def test_chat_logprobs_in_whole_and_streamed_replies():
    request = ChatCompletionRequest(**CHAT, logprobs=True, top_logprobs=2)
    assert request.sampling_params(4).logprobs == 2
    reply = HttpReply("chatcmpl-3", "tiny", True, request, 2)
    body = asyncio.run(reply.whole(deltas_with_logprobs(), Timings()))
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hel", "lo"]
    assert [c["logprob"] for c in content] == [-0.5, -0.25]
    assert content[0]["bytes"] == list(b"Hel")
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["lo", "token_id:8"]
    streamed = collect_events(HttpReply("chatcmpl-4", "tiny", True, request, 2),
                              deltas_with_logprobs())  # fmt: skip
    assert streamed[0]["choices"][0]["logprobs"] is None  # the role chunk
    per_chunk = [b["choices"][0]["logprobs"]["content"] for b in streamed[1:]]
    assert [c[0]["token"] for c in per_chunk] == ["Hel", "lo"]


def test_completion_logprobs_hold_the_sampled_token_and_text_offsets():
    request = CompletionRequest(prompt="x", logprobs=1, stream=True)
    assert request.sampling_params(4).logprobs == 1
    bodies = collect_events(HttpReply("cmpl-5", "tiny", False, request, 1), deltas_with_logprobs())
    first, second = (b["choices"][0]["logprobs"] for b in bodies)
    assert first["tokens"] == ["Hel"] and first["token_logprobs"] == [-0.5]
    assert first["top_logprobs"] == [{"Hel": -0.5, "Ha": -1.5}]
    assert first["text_offset"] == [0] and second["text_offset"] == [3]
    assert second["top_logprobs"] == [{"lo": -0.25, "token_id:8": -2.0}]


def test_without_logprobs_the_fields_stay_null():
    request = CompletionRequest(prompt="x")
    assert request.sampling_params(4).logprobs is None
    body = asyncio.run(HttpReply("cmpl-6", "tiny", False, request, 1).whole(
        deltas_with_logprobs(), Timings()))  # fmt: skip
    assert body["choices"][0]["logprobs"] is None
    chat = ChatCompletionRequest(**CHAT, logprobs=False)
    assert chat.sampling_params(4).logprobs is None


def test_n_choices_merge_whole_and_stream_with_their_indexes():
    from rayinfer.deployments.choices import choice_params, stream_of_choices, whole_of_choices
    from rayinfer.engine.sampling_params import SamplingParams

    assert [p.seed for p in choice_params(SamplingParams(seed=7), 3)] == [7, 8, 9]
    assert [p.seed for p in choice_params(SamplingParams(), 2)] == [None, None]
    request = CompletionRequest(
        prompt="x", n=2, stream=True, stream_options={"include_usage": True}
    )

    async def choice(texts):
        for i, text in enumerate(texts):
            yield Delta(text, [i], "length" if i == len(texts) - 1 else None)

    def replies():
        return [HttpReply("cmpl-7", "tiny", False, request, 3, i) for i in range(2)]

    runs = [choice(["a", "b"]), choice(["c", "d", "e"])]
    body = asyncio.run(whole_of_choices(replies(), runs, [Timings(), Timings()], 2))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "ab"), (1, "cde")]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 5

    async def run_stream():
        runs = [choice(["a", "b"]), choice(["c", "d", "e"])]
        return [e async for e in stream_of_choices(replies(), runs, [Timings(), Timings()], 2)]

    events = asyncio.run(run_stream())
    assert events[-1] == "data: [DONE]\n\n"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    texts = {0: "", 1: ""}
    for b in bodies[:-1]:
        texts[b["choices"][0]["index"]] += b["choices"][0]["text"]
    assert texts == {0: "ab", 1: "cde"}
    assert bodies[-1]["usage"]["completion_tokens"] == 5


def test_n_is_bounded_over_http():
    assert error_for(CompletionRequest, {"prompt": "a", "n": 17}).param == "n"
    assert ChatCompletionRequest(**CHAT, n=4).n == 4
    with pytest.raises(ValidationError):  # Python handles: one choice
        GenerateRequest(prompt="a", n=2)


def test_echo_puts_the_prompt_and_its_logprobs_first():
    request = CompletionRequest(prompt="Hi", logprobs=1, echo=True)
    params = request.sampling_params(4)
    assert params.prompt_logprobs == 1 and params.logprobs == 1
    prompt_entries = [entry(5, "H", None), entry(6, "i", -2.0, [(7, "o", -1.0)])]

    async def deltas():
        yield Delta("!", [1], None, [entry(1, "!", -0.5, [(1, "!", -0.5)])], prompt_entries)
        yield Delta("?", [2], "length", [entry(2, "?", -0.25, [(2, "?", -0.25)])])

    body = asyncio.run(HttpReply("cmpl-8", "tiny", False, request, 2, 0, "Hi").whole(
        deltas(), Timings()))  # fmt: skip
    choice = body["choices"][0]
    assert choice["text"] == "Hi!?"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["H", "i", "!", "?"]
    assert logprobs["token_logprobs"] == [None, -2.0, -0.5, -0.25]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {"o": -1.0, "i": -2.0}
    assert logprobs["text_offset"] == [0, 1, 2, 3]
    streamed = collect_events(HttpReply("cmpl-9", "tiny", False, request, 2, 0, "Hi"), deltas())
    assert [b["choices"][0]["text"] for b in streamed] == ["Hi!", "?"]
    assert streamed[0]["choices"][0]["logprobs"]["tokens"] == ["H", "i", "!"]
    assert streamed[1]["choices"][0]["logprobs"]["text_offset"] == [3]
    quiet = CompletionRequest(prompt="Hi", echo=True)  # echo without logprobs: text only
    assert quiet.sampling_params(4).prompt_logprobs is None


def test_a_batch_of_prompts_numbers_choices_prompt_major_and_sums_usage():
    """Two prompts x n=2: indexes p * n + i; each prompt's tokens and cached tokens once."""
    from rayinfer.deployments.choices import whole_of_choices

    request = CompletionRequest(prompt=["x", "yy"], n=2)

    async def choice(text: str, cached: int):
        yield Delta(text, [1, 2], "length", num_cached_tokens=cached)

    replies = [
        HttpReply("cmpl-b", "tiny", False, request, num_prompt, index)
        for index, num_prompt in enumerate([3, 3, 5, 5])
    ]
    runs = [choice("a", 0), choice("b", 2), choice("c", 4), choice("d", 4)]
    body = asyncio.run(whole_of_choices(replies, runs, [Timings() for _ in range(4)], 2))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a"), (1, "b"), (2, "c"),
                                                                    (3, "d")]  # fmt: skip
    assert body["usage"] == {
        "prompt_tokens": 8,
        "completion_tokens": 8,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_text_offsets_are_positions_in_the_returned_text():
    """BOS and EOS are not in the text, nor are the halves of a character split over two
    tokens (each decodes alone to U+FFFD): they take the offset of the text that follows, and
    every other token's text starts at its offset."""
    from rayinfer.deployments.logprobs import completion_logprobs

    texts = ["<|begin_of_text|>", "The", " ca", "f", "\ufffd", "\ufffd", " is", "</s>"]
    entries = [entry(i, t, -1.0) for i, t in enumerate(texts)]
    text = "The café is"
    body, end = completion_logprobs(entries, text)
    offsets = body["text_offset"]
    assert offsets == [0, 0, 3, 6, 7, 7, 8, 11] and end == 11
    pieces = [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)])]
    assert pieces == ["", "The", " ca", "f", "", "é", " is", ""]
    # a stream continues from where the last chunk's tokens ended
    first, position = completion_logprobs(entries[:3], "The ca")
    rest, _ = completion_logprobs(entries[3:], text, position)
    assert first["text_offset"] + rest["text_offset"] == offsets
