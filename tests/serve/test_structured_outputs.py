"""End to end with the openai SDK against a real `serve run` (disaggregated, so every grammar
crosses the prefill -> decode hand-off): JSON-schema replies that validate for 20 seeds from the
random-weights tiny model (only the grammar makes them valid), json_object, a named-function
tool call, streamed tool-call deltas that reassemble to the whole reply's call (an `auto` call,
whose text a regex makes the model write, streams its name first and then its arguments as
they are written), and the 400s.

The server (disaggregated, max_model_len=512) is shared with test_bench_serve.py and
test_openai_clients.py (tests/serve/conftest.py): starting one costs ~45 s on 2 cores.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.serve.streamed_calls import read_stream

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the river."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client(disaggregated_server):
    url = disaggregated_server.http_url + "/v1"
    return openai.OpenAI(base_url=url, api_key="unused", timeout=120)


def _chat(client, **fields):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **fields)


def test_json_schema_replies_validate_for_20_seeds(client):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    # All at once, as concurrent users send them: each request keeps its own grammar and seed
    # in the shared decode batch (one at a time, the 20 took ~33 s on 2 cores).
    with ThreadPoolExecutor(max_workers=20) as pool:
        replies = list(
            pool.map(
                lambda seed: _chat(
                    client, response_format=response_format, seed=seed, max_tokens=120
                ),
                range(20),
            )
        )
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_take_response_format_as_vllm_does(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = client.completions.create(model="tiny", prompt="a b c", seed=4, max_tokens=120,
                                      extra_body={"response_format": response_format})  # fmt: skip
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].text
    jsonschema.validate(json.loads(reply.choices[0].text), PERSON)


def test_json_object_reply_is_an_object(client):
    reply = _chat(client, response_format={"type": "json_object"}, seed=1, max_tokens=200)
    content = reply.choices[0].message.content
    assert content.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_vllm_choice_and_regex(client):
    reply = _chat(client, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, seed=2)
    assert reply.choices[0].message.content in ("yes", "no")
    reply = client.completions.create(
        model="tiny", prompt="a b c", seed=3, max_tokens=20, extra_body={"guided_regex": "[0-9]{4}"}
    )
    assert len(reply.choices[0].text) == 4 and reply.choices[0].text.isdigit()


def _named(seed: int, **fields) -> dict:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    return dict(tools=[WEATHER, CLOCK], tool_choice=choice, seed=seed, max_tokens=80, **fields)


def test_named_tool_call_arguments_validate(client):
    for seed in range(3):
        choice = _chat(client, **_named(seed)).choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("mode", ["named", "required"])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_replys_call(client, mode):
    fields = _named(5) if mode == "named" else dict(
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, seed=5, max_tokens=80
    )  # fmt: skip
    whole = _chat(client, **fields).choices[0]
    streamed = read_stream(_chat(client, stream=True, **fields))
    assert streamed.finish_reasons == [whole.finish_reason] == ["tool_calls"]
    expected = [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]
    assert [(c.name, json.loads(c.arguments)) for c in streamed.calls] == expected


# What the tiny model's system prompt asks for (its template shows no tools), after some text
AUTO_CALL = (
    r'Let me check\.<\|python_tag\|>\{"name": "get_weather", "arguments": \{"city": '
    r'"[a-z]{3,8}", "unit": "(celsius|fahrenheit)"\}\}'
)


def test_an_auto_call_streams_its_name_then_its_arguments_as_written(client):
    fields = dict(tools=[WEATHER, CLOCK], seed=7, max_tokens=190,
                  extra_body={"structured_outputs": {"regex": AUTO_CALL}})  # fmt: skip
    whole = _chat(client, **fields).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    (call,) = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = read_stream(_chat(client, stream=True, **fields))
    assert streamed.content == "Let me check." and streamed.finish_reasons == ["tool_calls"]
    (streamed_call,) = streamed.calls
    assert (streamed_call.name, streamed_call.arguments) == (call.function.name,
                                                           call.function.arguments)  # fmt: skip
    # the text first, then the call's head, then its arguments over many chunks
    assert max(streamed.content_chunks) < streamed_call.head_chunk
    assert streamed_call.head_chunk < streamed_call.argument_chunks[0]
    # several fragments (fewer than tokens where a loaded server coalesces a stream's tokens)
    assert len(streamed_call.argument_chunks) >= 2


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "intege"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]},
         "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "objekt"}}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_fields_answer_400_and_the_next_request_succeeds(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, max_tokens=4, **fields)
    assert caught.value.body["param"] == param, caught.value.body
    # ignore_eos: an unseeded draw from the random model may end early at EOS
    after = _chat(client, max_tokens=4, extra_body={"ignore_eos": True}).choices[0]
    assert after.finish_reason == "length"


def test_a_tool_conversation_is_served_and_a_malformed_call_named(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}, result]
    served = client.chat.completions.create(
        model="tiny", messages=history, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert served.choices[0].finish_reason == "length"
    history[1]["tool_calls"] = [{**call, "function": {"arguments": "{}"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    assert caught.value.body["param"] == "messages[1].tool_calls[0].function.name"
