"""Tool-call parsing of each family's real strings, read in the formats its checkpoint picks;
stream deltas that begin each call (id, type, name) before its arguments and send the arguments
in fragments, reassembling to the whole text's calls; the request fields' 400s, and those of
the messages' tool calls and tool results (no server)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rayinfer.deployments.protocol import ChatCompletionRequest
from rayinfer.deployments.replies import validation_to_openai
from rayinfer.deployments.tool_call_formats import FORMATS, ToolCallFormats
from rayinfer.deployments.tool_calls import (
    ToolCallStream,
    parse_tool_calls,
    string_params_of,
    template_inputs,
)

ARGS = {"city": "Paris", "days": 2}
TOOLS = ChatCompletionRequest.model_validate({
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [
        {"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        }}},
        {"type": "function", "function": {"name": "time"}},
    ],
}).tools  # fmt: skip
STRING_PARAMS = string_params_of(TOOLS)
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
DSML_CALLS = (
    '<｜DSML｜invoke name="weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="time">\n'
    "</｜DSML｜invoke>\n"
)
# family -> (its checkpoint's architectures entry, a reply with two calls as the family writes
# them: the formats of each family's chat template, or encoding script for DeepSeek V3.2 / V4)
CASES = {
    "qwen3": ("Qwen3MoeForCausalLM", 'Let me look.\n<tool_call>\n{"name": "weather", '
              '"arguments": ' + json.dumps(ARGS) + '}\n</tool_call>\n<tool_call>\n'
              '{"name": "time", "arguments": {}}\n</tool_call>'),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "Let me look." + DS + "function<｜tool▁sep｜>"
                    "weather\n```json\n" + json.dumps(ARGS) + "\n```<｜tool▁call▁end｜>"
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>time\n```json\n{}\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "deepseek_v31": ("DeepseekV3ForCausalLM", "Let me look." + DS + "weather<｜tool▁sep｜>"
                     + json.dumps(ARGS) + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>time"
                     "<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "deepseek_v32": ("DeepseekV32ForCausalLM", "Let me look.\n\n<｜DSML｜function_calls>\n"
                     + DSML_CALLS + "</｜DSML｜function_calls>"),
    "deepseek_v4": ("DeepseekV4ForCausalLM", "Let me look.\n\n<｜DSML｜tool_calls>\n"
                    + DSML_CALLS + "</｜DSML｜tool_calls>"),
    "glm45": ("GlmMoeDsaForCausalLM", "Let me look.\n<tool_call>weather\n<arg_key>city"
              "</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
              "<arg_value>2</arg_value>\n</tool_call>\n<tool_call>time\n</tool_call>"),
    "glm5": ("GlmMoeDsaForCausalLM", "Let me look.<tool_call>weather<arg_key>city</arg_key>"
             "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
             "</tool_call><tool_call>time</tool_call>"),
    "llama3": ("LlamaForCausalLM", 'Let me look.<|python_tag|>{"name": "weather", '
               '"parameters": ' + json.dumps(ARGS) + '}; {"name": "time", "parameters": {}}'),
}  # fmt: skip


def _formats(family: str) -> ToolCallFormats:
    return ToolCallFormats.of_checkpoint(CASES[family][0], template_reads_tools=True)


def _calls(calls):
    return [(call.name, json.loads(call.arguments)) for call in calls]


def _parse(text: str, family: str):
    return parse_tool_calls(text, "auto", None, _formats(family), STRING_PARAMS)


@pytest.mark.parametrize("family", sorted(CASES))
def test_auto_reads_each_familys_calls(family):
    content, calls = _parse(CASES[family][1], family)
    assert content == "Let me look."
    assert _calls(calls) == [("weather", ARGS), ("time", {})]


def test_a_checkpoint_reads_its_familys_formats_and_json():
    assert _formats("glm5").names == ("tool_call", "json")
    assert _formats("deepseek_v32").names == ("dsml", "deepseek", "json")
    assert _formats("llama3").names == ("json",)
    assert ToolCallFormats.of_checkpoint("Qwen3MoeForCausalLM", False).names == ("json",)
    assert ToolCallFormats.of_checkpoint("SomeNewForCausalLM", True).names == tuple(FORMATS)
    text = CASES["deepseek_v4"][1]  # DSML from a Qwen3 checkpoint is text, not a call
    assert _parse(text, "qwen3") == (text, [])


def test_glm_values_are_strings_where_the_schema_says_so():
    text = ("<tool_call>weather<arg_key>city</arg_key><arg_value>2</arg_value><arg_key>days"
            "</arg_key><arg_value>3</arg_value><arg_key>note</arg_key><arg_value>a b"
            "</arg_value></tool_call>")  # fmt: skip
    _, calls = _parse(text, "glm5")  # city is typed string; note has no schema: a bare word
    assert _calls(calls) == [("weather", {"city": "2", "days": 3, "note": "a b"})]


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


def _stream(stream: ToolCallStream, pieces: list[str], reason: str = "stop") -> list[dict]:
    """Every delta body, each with the number of characters fed when it was sent."""
    fed, bodies = 0, []
    for i, piece in enumerate(pieces):
        fed += len(piece)
        for delta in stream.deltas(piece, reason if i == len(pieces) - 1 else None):
            bodies.append({**delta, "fed": fed})
    return bodies


def _reassemble(bodies: list[dict]):
    content, calls = "", {}
    for delta in bodies:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            assert ("id" in part) == (call["name"] == "")  # the first delta has id and name
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part.get("function", {}).get("arguments", "")
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("size", [1, 3])
def test_streamed_deltas_reassemble_to_the_whole_texts_calls(family, size):
    text = CASES[family][1]
    stream = ToolCallStream("auto", None, _formats(family), STRING_PARAMS)
    bodies = _stream(stream, [text[i : i + size] for i in range(0, len(text), size)])
    content, calls = _reassemble(bodies)
    whole = _parse(text, family)[1]
    assert content == "Let me look."
    assert calls == [(call.name, call.arguments) for call in whole]
    assert stream.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("family", sorted(CASES))
def test_reads_of_a_growing_reply_only_add_to_its_calls(family):
    """What a stream relies on: over every prefix, a call once named keeps its name, and its
    arguments are a prefix of the whole reply's."""
    text = CASES[family][1]
    at, call_format = _formats(family).start(text)
    whole = call_format.read(text[at:], STRING_PARAMS)
    for end in range(at, len(text) + 1):
        for call, final in zip(call_format.read(text[at:end], STRING_PARAMS), whole):
            assert call.name in (None, final.name), (end, call)
            assert final.arguments.startswith(call.arguments), (end, call)


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_call_streams_its_name_first_then_its_arguments_in_fragments(family):
    """Fed a character at a time: the first call's head goes out long before the reply ends,
    and its arguments in several deltas (a parameter's value, or JSON, as it is written)."""
    text = CASES[family][1]
    bodies = _stream(ToolCallStream("auto", None, _formats(family), STRING_PARAMS), list(text))
    first = [b for b in bodies if b.get("tool_calls", [{}])[0].get("index") == 0]
    assert first[0]["tool_calls"][0]["function"] == {"name": "weather", "arguments": ""}
    assert first[0]["fed"] < text.index("Paris")  # named before its arguments are written
    fragments = [b for b in first[1:] if b["tool_calls"][0]["function"].get("arguments")]
    assert len(fragments) >= 2 and fragments[0]["fed"] < text.index("days")
    assert all(b["fed"] < text.index("time") for b in first)  # done before the next call


@pytest.mark.parametrize("size", [1, 2, 5])
def test_json_arguments_stream_as_written_across_escapes_and_brackets_in_strings(size):
    arguments = '{"code": "a[\\"}\\\\\\"]b\\n", "n": [1, {"x": "]{"}], "s": "\\u00e9"}'
    text = f'<tool_call>{{"name": "weather", "arguments": {arguments}}}</tool_call>'
    stream = ToolCallStream("auto", None, _formats("qwen3"))
    _, calls = _reassemble(_stream(stream, [text[i : i + size] for i in range(0, len(text), size)]))
    assert calls == [("weather", arguments)]
    assert _calls(_parse(text, "qwen3")[1]) == [("weather", json.loads(arguments))]


def test_required_calls_stream_as_they_are_written():
    text = json.dumps([{"name": "weather", "parameters": ARGS}, {"name": "time", "parameters": {}}])
    bodies = _stream(ToolCallStream("required"), list(text))
    assert _reassemble(bodies)[1] == [("weather", json.dumps(ARGS)), ("time", "{}")]
    assert bodies[0]["fed"] < text.index("Paris") and bodies[0]["tool_calls"][0]["id"]


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_reply_cut_off_inside_a_call_streams_what_the_whole_reply_holds(family):
    text = CASES[family][1]
    cut = text[: text.index("Paris") + 3]  # max_tokens ran out inside the first call
    stream = ToolCallStream("auto", None, _formats(family), STRING_PARAMS)
    content, calls = _reassemble(_stream(stream, list(cut), reason="length"))
    whole_content, whole = _parse(cut, family)
    assert calls == [(call.name, call.arguments) for call in whole] != []
    assert calls[0][0] == "weather" and content == whole_content
    assert stream.finish_reason("length") == "length"


def test_named_stream_sends_arguments_as_they_come():
    stream = ToolCallStream("named", "weather")
    text = json.dumps(ARGS)
    assert _reassemble(_stream(stream, [text[:5], text[5:]])) == ("", [("weather", text)])


@pytest.mark.parametrize(
    "text", ["Hello there ", " \n", "<tool_call>{broken</tool_call>", ' {"a": 1}\n']
)
def test_text_without_calls_streams_as_content(text):
    stream = ToolCallStream("auto")
    assert _reassemble(_stream(stream, [text[:4], text[4:]])) == (text, [])
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
        ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "objekt"}}}]}, "tools[0].function.parameters"),
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
    assert answer.message.startswith(f"{param}: "), answer.message


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip


def _call(**fields) -> dict:
    """CALL with these fields of its function replaced (None: left out)."""
    function = {**CALL["function"], **fields}
    return {**CALL, "function": {k: v for k, v in function.items() if v is not None}}


def _without(key: str) -> dict:
    return {k: v for k, v in CALL.items() if k != key}


def _history(calls, *later) -> list[dict]:
    """A conversation whose messages[1] is an assistant's call (content null, as the openai
    SDK and LangChain send it)."""
    called = {"role": "assistant", "content": None, "tool_calls": calls}
    return [{"role": "user", "content": "hi"}, called, *later]


@pytest.mark.parametrize(
    "messages, param",
    [
        (_history("x"), "messages[1].tool_calls"),
        (_history({"0": CALL}), "messages[1].tool_calls"),
        (_history([5]), "messages[1].tool_calls[0]"),
        (_history([_without("id")]), "messages[1].tool_calls[0].id"),
        (_history([{**CALL, "id": 7}]), "messages[1].tool_calls[0].id"),
        (_history([_without("type")]), "messages[1].tool_calls[0].type"),
        (_history([{**CALL, "type": "custom"}]), "messages[1].tool_calls[0].type"),
        (_history([_without("function")]), "messages[1].tool_calls[0].function"),
        (_history([{**CALL, "function": "weather"}]), "messages[1].tool_calls[0].function"),
        (_history([CALL, _call(name=None)]), "messages[1].tool_calls[1].function.name"),
        (_history([_call(name=["weather"])]), "messages[1].tool_calls[0].function.name"),
        (_history([_call(arguments=None)]), "messages[1].tool_calls[0].function.arguments"),
        (_history([_call(arguments={"city": "Paris"})]),
         "messages[1].tool_calls[0].function.arguments"),
        (_history([CALL], {"role": "tool", "content": "sunny"}), "messages[2].tool_call_id"),
        (_history([CALL], {"role": "tool", "content": "sunny", "tool_call_id": 1}),
         "messages[2].tool_call_id"),
        (_history([CALL], {"role": "tool", "tool_call_id": "call_1"}), "messages[2].content"),
        ([{"role": "user", "content": "hi", "name": 3}], "messages[0].name"),
    ],
)  # fmt: skip
def test_malformed_tool_calls_and_results_answer_400_naming_the_field(messages, param):
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate({"messages": messages})
    answer = validation_to_openai(error.value.errors())
    assert answer.status == 400 and answer.param == param, answer.message
    assert answer.message.startswith(f"{param}: "), answer.message


@pytest.mark.parametrize("calls", [None, [], [CALL, _call(arguments="")]])
def test_well_formed_tool_calls_are_accepted(calls):
    """null and [] as vLLM takes them; arguments any string (a cut-off call's, or empty)."""
    result = {"role": "tool", "content": [{"type": "text", "text": "sunny"}],
              "tool_call_id": "call_1", "name": "weather"}  # fmt: skip
    request = ChatCompletionRequest.model_validate({"messages": _history(calls, result)})
    assert request.chat_messages()[1]["tool_calls"] == calls
