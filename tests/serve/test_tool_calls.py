"""Tool-call parsing of fixed strings per family, and stream deltas that reassemble to the
calls of the whole text; the request fields' 400s (no server needed)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rayinfer.deployments.protocol import ChatCompletionRequest
from rayinfer.deployments.replies import validation_to_openai
from rayinfer.deployments.tool_calls import ToolCallStream, parse_tool_calls, template_inputs

ARGS = {"city": "Paris", "days": 2}
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
CASES = {
    "qwen3": 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": '
    + json.dumps(ARGS)
    + '}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',
    "deepseek_v3": "Let me look."
    + DS
    + "function<｜tool▁sep｜>weather\n```json\n"
    + json.dumps(ARGS)
    + "\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>time\n```json\n{}\n```"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v31": "Let me look."
    + DS
    + "weather<｜tool▁sep｜>"
    + json.dumps(ARGS)
    + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>",
    "llama3": 'Let me look.<|python_tag|>{"name": "weather", "parameters": '
    + json.dumps(ARGS)
    + '}; {"name": "time", "parameters": {}}',
}


def _calls(calls):
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("family", sorted(CASES))
def test_auto_reads_each_familys_calls(family):
    content, calls = parse_tool_calls(CASES[family], "auto")
    assert content == "Let me look."
    assert _calls(calls) == [("weather", ARGS), ("time", {})]


def test_a_bare_json_call_and_plain_text():
    content, calls = parse_tool_calls(' {"name": "weather", "arguments": {"city": "Oslo"}}', "auto")
    assert content is None and _calls(calls) == [("weather", {"city": "Oslo"})]
    assert parse_tool_calls("no call here", "auto") == ("no call here", [])
    assert parse_tool_calls("<tool_call>{broken</tool_call>", "auto")[1] == []


def test_required_and_named_formats():
    text = json.dumps([{"name": "weather", "parameters": ARGS}])
    assert _calls(parse_tool_calls(text, "required")[1]) == [("weather", ARGS)]
    content, calls = parse_tool_calls(json.dumps(ARGS), "named", "weather")
    assert content is None and _calls(calls) == [("weather", ARGS)]


def _reassemble(stream: ToolCallStream, pieces: list[str]):
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        for delta in stream.deltas(piece, "stop" if i == len(pieces) - 1 else None):
            content += delta.get("content") or ""
            for part in delta.get("tool_calls", []):
                call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
                call["name"] += part.get("function", {}).get("name", "")
                call["arguments"] += part.get("function", {}).get("arguments", "")
                assert "id" in part or call["name"]  # the first delta of a call has its id
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize("family", sorted(CASES))
def test_streamed_deltas_reassemble_to_the_whole_texts_calls(family):
    text = CASES[family]
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    stream = ToolCallStream("auto")
    content, calls = _reassemble(stream, pieces)
    assert content.strip() == "Let me look."
    assert calls == _calls(parse_tool_calls(text, "auto")[1])
    assert stream.finish_reason("stop") == "tool_calls"


def test_named_stream_sends_arguments_as_they_come():
    stream = ToolCallStream("named", "weather")
    text = json.dumps(ARGS)
    assert _reassemble(stream, [text[:5], text[5:]]) == ("", [("weather", ARGS)])


def test_text_without_calls_streams_as_content():
    stream = ToolCallStream("auto")
    assert _reassemble(stream, ["Hello", " there"]) == ("Hello there", [])
    assert stream.finish_reason("stop") == "stop"


def test_tools_go_to_a_system_message_where_the_template_ignores_them():
    tools = [{"type": "function", "function": {"name": "weather"}}]
    messages = [{"role": "user", "content": "hi"}]
    assert template_inputs(messages, tools, True) == (messages, tools)
    shown, none = template_inputs(messages, tools, False)
    assert none is None and shown[0]["role"] == "system" and '"weather"' in shown[0]["content"]


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]},
         "tools[0].function.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)  # fmt: skip
def test_bad_fields_answer_400_naming_the_field(fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate(body)
    answer = validation_to_openai(error.value.errors())
    assert answer.status == 400 and answer.param == param, answer.message
