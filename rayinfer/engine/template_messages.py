"""The messages as a chat template gets them: an assistant's tool call with its `arguments`
parsed into the object its JSON text holds, as vLLM passes them. Served chat
(deployments/prompts.py) and offline `LLM.chat` render through it alike.
"""

from __future__ import annotations

import json


class ParsedArguments(dict):
    """An assistant tool call's `arguments` as the chat template gets them: the object its
    JSON text holds, in the text's key order. Transformers' tool-use docs give templates a
    mapping, and vLLM parses the text into one: Llama 3.1's template writes `arguments | tojson`
    (a string would come out encoded twice), GLM-4.5's iterates `arguments.items()`, and Qwen3's
    and Hermes' write `tojson` of anything not a string, which writes it as transformers'
    tojson does: json.dumps' spacing (`{"city": "Paris"}`, whatever the client's) and
    non-ASCII unescaped.

    Used as text, it is the client's text: `{{ arguments }}`, `~` and `+` with a string
    (DeepSeek V3's and V3.1's templates write `'```json\\n' + arguments`) give what the client
    sent, where a plain dict would print Python's repr or raise TypeError."""

    __slots__ = ("_text",)

    def __init__(self, value: dict, text: str):
        super().__init__(value)
        self._text = text

    def __str__(self) -> str:
        return self._text

    def __add__(self, other):
        return self._text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + self._text if isinstance(other, str) else NotImplemented


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages for the chat template: an assistant tool call whose `arguments` text is a
    JSON object gets it as ParsedArguments. Text that is not JSON (a call cut off by
    max_tokens), or JSON but not an object (`[1]`), stays as sent. The messages given are not
    changed (the request keeps the client's calls)."""
    return [_with_parsed_arguments(message) for message in messages]


def _with_parsed_arguments(message: dict) -> dict:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_call_with_parsed_arguments(call) for call in calls]}


def _call_with_parsed_arguments(call):
    """Shapes are checked for the HTTP API (message_tool_fields.py), not for a handle's
    messages: anything but {"function": {"arguments": str}} stays as given."""
    function = call.get("function") if isinstance(call, dict) else None
    text = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(text, str):
        return call
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return call
    if not isinstance(value, dict):
        return call
    return {**call, "function": {**function, "arguments": ParsedArguments(value, text)}}
