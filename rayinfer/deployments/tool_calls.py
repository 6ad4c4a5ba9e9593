"""Tool calls: the tools shown to the model, and the model's text read back as `tool_calls`.

Prompt: the tools go to the checkpoint's chat template as `tools`. A template that never reads
`tools` (the tiny model's) gets them in a system message instead, with the JSON call format the
parser reads (the way Llama 3.1 prompts JSON tool calls), placed first.

Reply, by tool_choice (deployments/structured_fields.py): a named function's output is its
arguments (the grammar makes it so); `required`'s is a JSON list of {"name", "parameters"}; with
`auto` the text is read in the format of the family that wrote it:
- Qwen3 (Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
- DeepSeek V3 / V3.1+: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  ```json ARGS```<｜tool▁call▁end｜>` (V3.1 and later: `NAME<｜tool▁sep｜>ARGS`), repeated;
- Llama 3: `<|python_tag|>` and/or a bare `{"name": ..., "parameters": {...}}`, `;`-separated.
Text before the first call stays `content`. Streams send content as it comes, hold everything
from the first call marker on (a text that starts with `{` counts as one), and send the calls
at the end: each as one delta with its id, type and name, then one with its arguments. A named
function streams its arguments as they come.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from rayinfer.engine.stop_checker import streamable_length

QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
DEEPSEEK_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n"
    r"(?P<args>.*?)\n```|(?P<name31>[^<]+?)<｜tool▁sep｜>(?P<args31>.*?))<｜tool▁call▁end｜>",
    re.DOTALL,
)
LLAMA_TAG = "<|python_tag|>"
MARKERS = ("<tool_call>", DEEPSEEK_BEGIN, LLAMA_TAG)
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


def parse_tool_calls(text: str, mode: str, function: str | None = None):
    """(content, calls) read from a finished reply; calls is [] when the text holds none."""
    if mode == "named":
        return None, [ToolCall(function, text.strip())]
    if mode == "required":
        return None, _json_calls(text)
    start = _call_start(text)
    if start is None:
        return text, []
    calls = _calls_in(text[start:])
    if not calls:
        return text, []
    content = text[:start].strip() or None
    return content, calls


def _call_start(text: str) -> int | None:
    found = [text.find(marker) for marker in MARKERS if marker in text]
    if text.lstrip().startswith(("{", "[")):
        found.append(len(text) - len(text.lstrip()))
    return min(found) if found else None


def _calls_in(text: str) -> list[ToolCall]:
    if text.startswith("<tool_call>"):
        return [c for body in QWEN_CALL.findall(text) for c in _json_calls(body)]
    if text.startswith(DEEPSEEK_BEGIN):
        return [_deepseek_call(match) for match in DEEPSEEK_CALL.finditer(text)]
    text = text.removeprefix(LLAMA_TAG)
    return [c for part in text.split(";") for c in _json_calls(part)]


def _deepseek_call(match: re.Match) -> ToolCall:
    name = match.group("name") or match.group("name31")
    args = match.group("args") if match.group("name") else match.group("args31")
    return ToolCall(name.strip(), args.strip())


def _json_calls(text: str) -> list[ToolCall]:
    """Calls from JSON text: one {"name", "arguments" | "parameters"} object or a list."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def tool_call_stream(request) -> ToolCallStream | None:
    """The stream reader of a chat request that may call tools, else None."""
    mode = getattr(request, "tool_call_mode", "none")
    return None if mode == "none" else ToolCallStream(mode, request.called_function)


def put_tool_calls(choice: dict, stream: ToolCallStream, text: str, reason: str | None) -> None:
    """A whole reply's choice with the calls its text holds (`message.tool_calls`)."""
    content, calls = parse_tool_calls(text, stream.mode, stream.function)
    if not calls:
        return
    choice["message"] = {"role": "assistant", "content": content,
                         "tool_calls": [call.body() for call in calls]}  # fmt: skip
    choice["finish_reason"] = "tool_calls" if reason == "stop" else reason


class ToolCallStream:
    """Turns a reply's text deltas into chat `delta` bodies with `tool_calls`."""

    def __init__(self, mode: str, function: str | None = None):
        self.mode = mode
        self.function = function
        self.text = ""
        self.num_content_chars = 0  # of `text`, sent as content
        self.is_holding = mode == "required"  # the rest of the text is a call
        self.named_call: ToolCall | None = None
        self._parsed_calls: list[ToolCall] = []

    def deltas(self, text: str, finish_reason: str | None) -> list[dict]:
        """The delta bodies for this text; with finish_reason, the calls as well."""
        self.text += text
        if self.mode == "named":
            return self._named(text)
        out = []
        if not self.is_holding:
            start = _call_start(self.text)
            end = start if start is not None else streamable_length(self.text, MARKERS)
            if self.text[:end].strip() == "" and finish_reason is None:
                end = 0  # only whitespace yet: the reply may still start with a JSON call
            if end > self.num_content_chars:
                out.append({"content": self.text[self.num_content_chars : end]})
                self.num_content_chars = end
            self.is_holding = start is not None
        if finish_reason is not None:
            out += self._finish()
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """'tool_calls' where the reply ended ("stop") having called a tool."""
        called = self.named_call is not None or bool(self._parsed_calls)
        return "tool_calls" if reason == "stop" and called else reason

    def _named(self, text: str) -> list[dict]:
        out = []
        if self.named_call is None:
            self.named_call = ToolCall(self.function, "")
            out.append(_call_delta(0, self.named_call.body()))
        if text:
            out.append(_call_delta(0, {"function": {"arguments": text}}))
        return out

    def _finish(self) -> list[dict]:
        held = self.text[self.num_content_chars :]
        content, calls = parse_tool_calls(held, self.mode)
        self._parsed_calls = calls
        if not calls:
            return [{"content": held}] if held else []
        out = [{"content": content}] if content else []
        for index, call in enumerate(calls):
            head = call.body()
            head["function"] = {"name": call.name, "arguments": ""}
            out.append(_call_delta(index, head))
            out.append(_call_delta(index, {"function": {"arguments": call.arguments}}))
        return out


def _call_delta(index: int, fields: dict) -> dict:
    return {"tool_calls": [{"index": index, **fields}]}
