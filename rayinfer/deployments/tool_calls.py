"""Tool calls: the tools shown to the model, and the model's text read back as `tool_calls`.

Prompt: the tools go to the checkpoint's chat template as `tools`. A template that never reads
`tools` (the tiny model's) gets them in a system message instead, with the JSON call format the
parser reads (the way Llama 3.1 prompts JSON tool calls), placed first. The calls of earlier
assistant turns reach the template with their `arguments` parsed
(engine/template_messages.py).

Reply, by tool_choice (deployments/structured_fields.py): a named function's output is its
arguments (the grammar makes it so); `required`'s is a JSON list of {"name", "parameters"}; with
`auto` the text is read in the formats of the checkpoint's family (tool_call_formats.py). Text
before the first call, less its trailing whitespace, stays `content`; what follows the first
call marker is read as calls.

Streams send content as it comes and each call as OpenAI does: first a delta with its id, type
and name (arguments ""), then its arguments in fragments as they are written. A whole reply
reads the finished text with the same readers, so its calls are what the stream's deltas
reassemble to. A reply whose call markers turn out to hold no call is sent as content at the end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from rayinfer.deployments.tool_call_formats import (
    ALL_FORMATS,
    FORMATS,
    StringParams,
    ToolCallFormats,
)
from rayinfer.deployments.tool_call_reading import PartialCall
from rayinfer.engine.stop_checker import streamable_length

TOOLS_PROMPT = (
    "You can call these functions:\n{tools}\n"
    'To call one, answer with only a JSON object {{"name": function name, "arguments": '
    "arguments object}}."
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def body(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def template_inputs(messages, tools, template_reads_tools: bool):
    """(messages, tools) for the chat template: tools in a first system message where the
    template does not read them."""
    if not tools or template_reads_tools:
        return messages, tools
    listed = "\n".join(json.dumps(tool["function"]) for tool in tools)
    system = {"role": "system", "content": TOOLS_PROMPT.format(tools=listed)}
    return [system, *messages], None


def parse_tool_calls(
    text: str,
    mode: str,
    function: str | None = None,
    formats: ToolCallFormats = ALL_FORMATS,
    string_params: StringParams | None = None,
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) read from a finished reply; calls is [] when the text holds none."""
    if mode == "named":
        return None, [ToolCall(function, text.strip())]
    start = (0, FORMATS["json"]) if mode == "required" else formats.start(text)
    if start is None:
        return text, []
    at, call_format = start
    calls = [c for c in call_format.read(text[at:], string_params or {}) if c.name is not None]
    if not calls:
        return text, []
    content = text[:at].rstrip() or None
    return content, [ToolCall(call.name, call.arguments) for call in calls]


def string_params_of(tools) -> StringParams:
    """Function name -> its parameters typed "string" in its schema, from a request's tools."""
    params = {}
    for tool in tools or ():
        properties = tool.function.parameters.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        params[tool.function.name] = frozenset(
            name for name, schema in properties.items()
            if isinstance(schema, dict) and schema.get("type") == "string"
        )  # fmt: skip
    return params


def tool_call_stream(request, formats: ToolCallFormats = ALL_FORMATS) -> ToolCallStream | None:
    """The stream reader of a chat request that may call tools, else None. formats: those of
    the checkpoint (ToolCallFormats.of_checkpoint)."""
    mode = getattr(request, "tool_call_mode", "none")
    if mode == "none":
        return None
    string_params = string_params_of(request.tools)
    return ToolCallStream(mode, request.called_function, formats, string_params)


def put_tool_calls(choice: dict, stream: ToolCallStream, text: str, reason: str | None) -> None:
    """A whole reply's choice with the calls its text holds (`message.tool_calls`); the
    message's other fields (its reasoning) stay."""
    content, calls = parse_tool_calls(
        text, stream.mode, stream.function, stream.formats, stream.string_params
    )
    if not calls:
        return
    choice["message"].update(content=content, tool_calls=[call.body() for call in calls])
    choice["finish_reason"] = "tool_calls" if reason == "stop" else reason


class ToolCallStream:
    """Turns a reply's text deltas into chat `delta` bodies with `tool_calls`."""

    def __init__(
        self,
        mode: str,
        function: str | None = None,
        formats: ToolCallFormats = ALL_FORMATS,
        string_params: StringParams | None = None,
    ):
        self.mode = mode
        self.function = function
        self.formats = formats
        self.string_params = string_params or {}
        self.text = ""
        self.num_content_chars = 0  # of `text`, sent as content
        # where the first call opens in `text`, and its format (None: no call seen yet)
        self.call_start = (0, FORMATS["json"]) if mode == "required" else None
        self.named_call: ToolCall | None = None
        self.sent_calls: list[ToolCall] = []  # the calls begun, their arguments as sent
        self.memo: dict = {}  # the call formats' place in the growing text (CallFormat.read)

    def deltas(self, text: str, finish_reason: str | None) -> list[dict]:
        """The delta bodies for this text (and, with finish_reason, all that is left)."""
        self.text += text
        if self.mode == "named":
            return self._named(text)
        out = [] if self.call_start is not None else self._content()
        if self.call_start is not None:
            at, call_format = self.call_start
            calls = call_format.read(self.text[at:], self.string_params, self.memo)
            out += self._call_deltas(calls)
        if finish_reason is not None and not self.sent_calls:  # the markers held no call
            held = self.text[self.num_content_chars :]
            self.num_content_chars = len(self.text)
            out += [{"content": held}] if held else []
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """'tool_calls' where the reply ended ("stop") having called a tool."""
        called = self.named_call is not None or bool(self.sent_calls)
        return "tool_calls" if reason == "stop" and called else reason

    def _content(self) -> list[dict]:
        """The text before any call, as far as no call marker can still start in it, less
        its trailing whitespace: sent once text follows it, dropped if a call does (or sent at
        the end of a reply without calls)."""
        self.call_start = self.formats.start(self.text)
        end = self.call_start[0] if self.call_start else streamable_length(
            self.text, self.formats.markers
        )  # fmt: skip
        end = len(self.text[:end].rstrip())
        if end <= self.num_content_chars:
            return []
        content, self.num_content_chars = self.text[self.num_content_chars : end], end
        return [{"content": content}]

    def _call_deltas(self, calls: list[PartialCall]) -> list[dict]:
        """What the calls read so far add to those sent: a new call's id, type and name, then
        the arguments written since."""
        out = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self.sent_calls):
                self.sent_calls.append(ToolCall(call.name, ""))
                head = self.sent_calls[index].body()
                out.append(_call_delta(index, head))
            sent = self.sent_calls[index]
            if len(call.arguments) > len(sent.arguments):
                new = call.arguments[len(sent.arguments) :]
                sent.arguments = call.arguments
                out.append(_call_delta(index, {"function": {"arguments": new}}))
        return out

    def _named(self, text: str) -> list[dict]:
        out = []
        if self.named_call is None:
            self.named_call = ToolCall(self.function, "")
            out.append(_call_delta(0, self.named_call.body()))
        if text:
            out.append(_call_delta(0, {"function": {"arguments": text}}))
        return out


def _call_delta(index: int, fields: dict) -> dict:
    return {"tool_calls": [{"index": index, **fields}]}
