"""The tool fields of a chat request's messages, typed as OpenAI's API (and vLLM's) types them:
an assistant's `tool_calls` is a list of `{"id": str, "type": "function", "function": {"name":
str, "arguments": str}}`, a tool message's `tool_call_id` a string. A malformed one answers 400
naming its path (`messages[1].tool_calls[0].function.name`).

The checks only look: the request keeps each field as the client sent it, `arguments` the
JSON text and any keys the client added still there. Nor is `arguments` checked to be JSON: a
reply cut off inside a call (finish_reason `length`) comes back with half of it. The chat
template gets `arguments` parsed where the text is a JSON object, else the text
(engine/template_messages.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, TypeAdapter, model_validator

CALL_SHAPE = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}'
# Added keys (a stream's `index`, a family's own fields) go on to the template as sent.
AS_SENT = ConfigDict(extra="allow", strict=True)


class CalledFunction(BaseModel):
    model_config = AS_SENT

    name: str
    arguments: str  # JSON text, as in a reply's tool call

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, value):
        if not isinstance(value, dict):
            raise ValueError('must be an object {"name": ..., "arguments": "{...}"}')
        return value


class MessageToolCall(BaseModel):
    model_config = AS_SENT

    id: str
    type: Literal["function"]
    function: CalledFunction

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, value):
        if not isinstance(value, dict):
            raise ValueError(f"must be an object {CALL_SHAPE}")
        return value


_CALLS = TypeAdapter(list[MessageToolCall])


def _checked_calls(value):
    """value unchanged where it has the shape of tool calls; the errors are located inside it
    (`tool_calls[0].function.name`)."""
    if value is None:
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be a list of tool calls, each {CALL_SHAPE}")
    _CALLS.validate_python(value)
    return value


# An assistant message's tool calls: checked as MessageToolCalls, kept as the client's dicts.
ToolCallsAsSent = Annotated[list[dict[str, Any]] | None, BeforeValidator(_checked_calls)]
