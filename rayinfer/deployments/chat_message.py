"""A chat message as a request sends it: its role, its content (text, or text parts), an
assistant's tool calls and reasoning, a tool result's call id; checked so that a malformed one
answers 400 naming its field (the tool calls' shape: deployments/message_tool_fields.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rayinfer.deployments.message_tool_fields import ToolCallsAsSent

TOOL_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name")
# An assistant's reasoning, under vLLM's old and current names; templates that render earlier
# turns' thinking read it (engine/chat_template.py passes it under every name they read)
REASONING_MESSAGE_FIELDS = ("reasoning_content", "reasoning")
# Roles whose messages must carry `content` (an assistant's may be null beside `tool_calls`).
ROLES_WITH_CONTENT = ("system", "user", "developer", "tool")
TEXT_PART_TYPES = ("text", "refusal")  # the content parts a text model reads
TEXT_PART_SHAPE = '{"type": "text", "text": ...}'


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # validate_default: a missing content or tool_call_id is checked like an explicit null
    content: str | list[dict[str, Any]] | None = Field(None, validate_default=True)
    tool_calls: ToolCallsAsSent = None  # an assistant's; the template gets them as sent
    tool_call_id: str | None = Field(None, validate_default=True)  # a tool result's call
    name: str | None = None
    reasoning_content: str | None = Field(
        None, description="extension (vLLM's): an assistant's reasoning, for the template"
    )
    reasoning: str | None = Field(None, description="extension (vLLM's): reasoning_content")

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value):
        """One message for any wrong type (the union's errors would name its members)."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"must be a string or a list of content parts ({TEXT_PART_SHAPE})")
        for index, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f"part {index} must be an object ({TEXT_PART_SHAPE})")
        return value

    @field_validator("content")
    @classmethod
    def _content_where_required(cls, value, info: ValidationInfo):
        role = info.data.get("role")
        if value is None and role in ROLES_WITH_CONTENT:
            raise ValueError(f"a {role} message needs content (a string or a list of parts)")
        return value

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value):
        """A text model reads text parts; an image or audio part would be silently dropped."""
        for index, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type")
            if kind not in TEXT_PART_TYPES:
                raise ValueError(
                    f"part {index} has type {kind!r}; this model reads only text parts "
                    f"(type {' or '.join(map(repr, TEXT_PART_TYPES))})"
                )
            if not isinstance(part.get(kind), str):
                raise ValueError(f"part {index}: a {kind} part needs a string {kind!r} field")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_result_names_its_call(cls, value, info: ValidationInfo):
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(
                part.get("text", "") for part in self.content if part.get("type") == "text"
            )
        return self.content or ""

    def as_sent(self) -> dict[str, Any]:
        """The message as sent, content as text, the tool fields the client gave beside it,
        and an assistant's reasoning (other roles' is dropped, as vLLM drops it)."""
        fields = TOOL_MESSAGE_FIELDS
        if self.role == "assistant":
            fields += REASONING_MESSAGE_FIELDS
        sent = {k: getattr(self, k) for k in fields if k in self.model_fields_set}
        return {"role": self.role, "content": self.text(), **sent}
