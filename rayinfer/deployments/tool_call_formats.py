"""How each family writes tool calls, read as far as they have come (tool_call_reading.py), and
which formats a checkpoint's replies are read in.

- JSON: `{"name": ..., "arguments" | "parameters": {...}}`, alone, in a list, or `;`-separated
  after Llama 3's `<|python_tag|>`; also what the system prompt asks of a template that shows
  no tools (tool_calls.py), and the form tool_choice `required` is constrained to.
- `<tool_call>` tags, one call each: Qwen3 (Hermes) writes a JSON object inside; GLM-4.5 to
  GLM-5 write `NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs (GLM-4.5 puts a
  newline after the name and each tag, GLM-4.7 and later none). The first character of the
  body tells the two apart. GLM writes string values as they are and other values as JSON, so
  a value is a string where the function's schema says `"type": "string"`.
- DeepSeek V3: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>
  NAME` and the arguments in a ```json fence, or (V3.1 and V3.2-Exp) `NAME<｜tool▁sep｜>ARGS`,
  each up to `<｜tool▁call▁end｜>`.
- DSML, DeepSeek V3.2 (`<｜DSML｜function_calls>`) and V4 (`<｜DSML｜tool_calls>`): per call
  `<｜DSML｜invoke name="NAME">` with `<｜DSML｜parameter name="K" string="true|false">V
  </｜DSML｜parameter>` elements: string="true" values are strings as written, the others JSON.

A checkpoint's replies are read in the formats its family's chat template teaches (by config.json
`architectures`), or, where the template shows no tools, in JSON alone, which is what the system
prompt then asks for; JSON is read for every family (models fall back to it). A family not
listed here is read in every format.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping

from rayinfer.deployments.tool_call_reading import (
    Param,
    PartialCall,
    ScanMemo,
    json_calls,
    params_json,
    skip_whitespace,
    stripped_so_far,
    until,
)

# function name -> the names of its parameters whose schema type is "string"
StringParams = Mapping[str, frozenset[str]]


class CallFormat(ABC):
    markers: tuple[str, ...] = ()  # the texts that open this format's calls

    def start(self, text: str) -> int | None:
        """Where this format's first call opens in text, or None."""
        found = [text.find(marker) for marker in self.markers if marker in text]
        return min(found) if found else None

    @abstractmethod
    def read(
        self, text: str, string_params: StringParams, memo: dict | None = None
    ) -> list[PartialCall]:
        """The calls of text, which starts where `start` found the first one. memo: a dict kept
        across the reads of a text that grows (a stream's), where a format may keep its place."""


class JsonCalls(CallFormat):
    markers = ("<|python_tag|>",)

    def start(self, text: str) -> int | None:
        found = super().start(text)
        opened = len(text) - len(text.lstrip())  # a reply that is JSON from its first character
        if text[opened : opened + 1] in ("{", "["):
            return opened if found is None else min(found, opened)
        return found

    def read(
        self, text: str, string_params: StringParams, memo: ScanMemo | None = None
    ) -> list[PartialCall]:
        return json_calls(text.removeprefix(self.markers[0]), memo)


class TaggedCalls(CallFormat):
    """`<tool_call>` ... `</tool_call>`, each holding a Hermes JSON call or a GLM call."""

    markers = ("<tool_call>",)
    END = "</tool_call>"

    def read(
        self, text: str, string_params: StringParams, memo: dict | None = None
    ) -> list[PartialCall]:
        calls, position = [], 0
        while text.startswith(self.markers[0], position):
            start = position + len(self.markers[0])
            body, is_closed = until(text, self.END, start)
            first = body.lstrip()[:1]
            if first in ("{", "["):  # one scan memo per body: positions are the body's
                calls += json_calls(body, None if memo is None else memo.setdefault(start, {}))
            elif first or is_closed:
                calls.append(glm_call(body, is_closed, string_params))
            if not is_closed:
                break
            position = skip_whitespace(text, start + len(body) + len(self.END))
        return calls


GLM_KEY, GLM_KEY_END = "<arg_key>", "</arg_key>"
GLM_VALUE, GLM_VALUE_END = "<arg_value>", "</arg_value>"


def glm_call(body: str, is_closed: bool, string_params: StringParams) -> PartialCall:
    """A GLM call from the text inside its tags (all of it once `is_closed`)."""
    lead = skip_whitespace(body, 0)
    ends = [i for i in (body.find("\n", lead), body.find(GLM_KEY, lead)) if i >= 0]
    if not ends and not is_closed:
        return PartialCall(None)  # the name may go on
    name_end = min(ends) if ends else len(body)
    name = body[lead:name_end].strip()
    strings = string_params.get(name, frozenset())
    params, position = [], name_end
    while True:
        position = skip_whitespace(body, position)
        if not body.startswith(GLM_KEY, position):
            break
        key, has_key = until(body, GLM_KEY_END, position + len(GLM_KEY))
        value_start = skip_whitespace(body, position + len(GLM_KEY) + len(key) + len(GLM_KEY_END))
        if not has_key or not body.startswith(GLM_VALUE, value_start):
            break
        value_start += len(GLM_VALUE)
        value, has_value = until(body, GLM_VALUE_END, value_start)
        if not has_value and is_closed:  # the call closed around an open value: all of it
            value, has_value = body[value_start:], True
        params.append(Param(key.strip(), value, key.strip() in strings, has_value))
        if not has_value:
            break
        position = value_start + len(value) + len(GLM_VALUE_END)
    is_complete = is_closed and all(param.is_complete for param in params)
    return PartialCall(name, params_json(params, is_complete), is_complete)


class DeepSeekCalls(CallFormat):
    markers = ("<｜tool▁calls▁begin｜>",)
    END, CALL, CALL_END, SEP = (
        "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    )  # fmt: skip

    def read(
        self, text: str, string_params: StringParams, memo: dict | None = None
    ) -> list[PartialCall]:
        block, _ = until(text, self.END, len(self.markers[0]))
        calls, position = [], skip_whitespace(block, 0)
        while block.startswith(self.CALL, position):
            call, position = self._call(block, position + len(self.CALL))
            calls.append(call)
            if position is None:
                break
            position = skip_whitespace(block, position)
        return calls

    def _call(self, block: str, start: int) -> tuple[PartialCall, int | None]:
        """The call from after its begin marker, and where the next may begin (None: not yet)."""
        sep = block.find(self.SEP, start)
        if sep < 0:
            return PartialCall(None), None
        head, after = block[start:sep], sep + len(self.SEP)
        if head.strip() == "function":  # V3: NAME, then the arguments in a ```json fence
            name_end = block.find("\n", after)
            if name_end < 0:
                return PartialCall(None), None
            name = block[after:name_end].strip()
            fence_end = block.find("\n", name_end + 1)
            if fence_end < 0:
                return PartialCall(name), None
            arguments, is_complete = until(block, "\n```", fence_end + 1)
            end = fence_end + 1 + len(arguments) + len("\n```")
        else:  # V3.1 and later: NAME<｜tool▁sep｜>ARGS
            name = head.strip()
            arguments, is_complete = until(block, self.CALL_END, after)
            end = after + len(arguments)
        call = PartialCall(name, stripped_so_far(arguments, is_complete), is_complete)
        call_end = block.find(self.CALL_END, end) if is_complete else -1
        return call, None if call_end < 0 else call_end + len(self.CALL_END)


class DsmlCalls(CallFormat):
    markers = ("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>")  # V3.2's, V4's
    INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>')
    INVOKE_END = "</｜DSML｜invoke>"
    PARAM = re.compile(r'<｜DSML｜parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>')
    PARAM_END = "</｜DSML｜parameter>"

    def read(
        self, text: str, string_params: StringParams, memo: dict | None = None
    ) -> list[PartialCall]:
        opening = next((marker for marker in self.markers if text.startswith(marker)), None)
        if opening is None:  # the marker itself has not all come
            return []
        block, is_closed = until(text, "</" + opening[1:], len(opening))
        calls, position = [], skip_whitespace(block, 0)
        while invoke := self.INVOKE.match(block, position):
            call, position = self._invoke(block, invoke.group(1), invoke.end(), is_closed)
            calls.append(call)
            if not call.is_complete:
                break
            position = skip_whitespace(block, position)
        return calls

    def _invoke(self, block: str, name: str, position: int, block_closed: bool):
        params = []
        while True:
            position = skip_whitespace(block, position)
            if block.startswith(self.INVOKE_END, position):
                return PartialCall(name, params_json(params, True), True), position + len(
                    self.INVOKE_END
                )
            param = self.PARAM.match(block, position)
            if param is None:
                is_complete = block_closed  # the block closed around the call: all of it
                return PartialCall(name, params_json(params, is_complete), is_complete), position
            value, has_value = until(block, self.PARAM_END, param.end())
            params.append(Param(param.group(1), value, param.group(2) == "true", has_value))
            if not has_value:
                return PartialCall(name, params_json(params, False)), len(block)
            position = param.end() + len(value) + len(self.PARAM_END)


FORMATS: dict[str, CallFormat] = {
    "json": JsonCalls(),
    "tool_call": TaggedCalls(),
    "deepseek": DeepSeekCalls(),
    "dsml": DsmlCalls(),
}
# The formats each family's chat template teaches.
BY_ARCHITECTURE: dict[str, tuple[str, ...]] = {
    "DeepseekV2ForCausalLM": ("deepseek",),
    "DeepseekV3ForCausalLM": ("deepseek",),
    "DeepseekV32ForCausalLM": ("dsml", "deepseek"),  # V3.2's DSML; V3.2-Exp writes V3.1's
    "DeepseekV4ForCausalLM": ("dsml",),
    "GlmMoeDsaForCausalLM": ("tool_call",),
    "Qwen3MoeForCausalLM": ("tool_call",),
    "Qwen3ForCausalLM": ("tool_call",),
    "Qwen2ForCausalLM": ("tool_call",),
    "LlamaForCausalLM": (),
}


class ToolCallFormats:
    """The formats one checkpoint's replies are read in."""

    def __init__(self, names: tuple[str, ...]):
        self.names = tuple(dict.fromkeys((*names, "json")))  # JSON last, and always
        self.formats = [FORMATS[name] for name in self.names]
        self.markers = tuple(marker for f in self.formats for marker in f.markers)

    @classmethod
    def of_checkpoint(cls, architecture: str | None, template_reads_tools: bool):
        """The formats of a family's template where it shows the tools, else JSON alone."""
        if not template_reads_tools:
            return cls(())
        return cls(BY_ARCHITECTURE.get(architecture, tuple(FORMATS)))

    def start(self, text: str) -> tuple[int, CallFormat] | None:
        """Where the first call opens and its format, or None."""
        found = [(at, f) for f in self.formats if (at := f.start(text)) is not None]
        return min(found, key=lambda pair: pair[0]) if found else None


ALL_FORMATS = ToolCallFormats(tuple(FORMATS))
