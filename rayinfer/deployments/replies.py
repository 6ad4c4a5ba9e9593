"""OpenAI response bodies for one request: whole, or as server-sent events ending in [DONE]."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from rayinfer.deployments.chat_reasoning import put_reasoning, reasoning_delta
from rayinfer.deployments.errors import as_openai_error
from rayinfer.deployments.logprobs import chat_logprobs, completion_logprobs
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.reasoning import ReasoningSplitter
from rayinfer.deployments.response_bodies import (
    chat_chunk_body,
    chat_completion_body,
    completion_body,
    completion_chunk_body,
    usage_body,
    usage_chunk_body,
)
from rayinfer.deployments.tool_call_formats import ALL_FORMATS, ToolCallFormats
from rayinfer.deployments.tool_calls import put_tool_calls, tool_call_stream
from rayinfer.deployments.types import Delta, Timings
from rayinfer.deployments.valid_unicode import INVALID_TEXT

# A union member's tag in a pydantic error's location ('str', 'list[str]', 'dict[str,any]',
# 'function-after[...]'): no field of the API is named so.
_UNION_TAG = re.compile(r"^[\w-]+\[.*\]$|^(str|int|float|bool|dict|list|none)$")


def validation_to_openai(
    errors: list[dict[str, Any]], body_field: str = "body", request_id: str | None = None
) -> OpenAIError:
    """The first pydantic error as a 400 naming the field (`messages[0].content`). body_field:
    the field a missing body is named by (the route's required one: `messages`, `prompt`)."""
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return OpenAIError(400, f"malformed JSON body: {detail}", request_id=request_id)
    if first["type"] == INVALID_TEXT:
        field = first["ctx"]["field"]
        return OpenAIError(400, first["msg"], param=field, request_id=request_id)
    loc = [part for part in first["loc"] if part != "body" and not _is_union_tag(part)]
    if not loc and first["type"] == "model_attributes_type":
        return OpenAIError(
            400, "the body must be a JSON object (Content-Type: application/json)",
            request_id=request_id,
        )  # fmt: skip
    if not loc and first["type"] == "missing":  # no body at all
        return OpenAIError(
            400, f"{body_field}: field required (the body is empty; send a JSON object)",
            param=body_field, request_id=request_id,
        )  # fmt: skip
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    if first["type"] == "missing":
        return OpenAIError(400, f"{param}: field required", param=param, request_id=request_id)
    message = first["msg"].removeprefix("Value error, ")
    if not message.startswith(f"{loc[-1] if loc else ''}="):  # "seed=-1 must be..." says it
        message += f" (got {_short_repr(first.get('input'))})"
    return OpenAIError(400, f"{param or 'body'}: {message}", param or None, request_id=request_id)


def unparsable_body(cause: BaseException | None) -> str:
    """Why a body is not JSON, for a failure other than a syntax error (FastAPI answers those
    'There was an error parsing the body'): `cause` is what its JSON decoder raised."""
    if isinstance(cause, UnicodeDecodeError):
        return "malformed JSON body: it is not UTF-8 (nor UTF-16 or UTF-32) text"
    if isinstance(cause, RecursionError):
        return "malformed JSON body: its arrays and objects nest too deeply"
    return "malformed JSON body"


def _is_union_tag(part) -> bool:
    return isinstance(part, str) and _UNION_TAG.match(part) is not None


def _short_repr(value: Any, limit: int = 80) -> str:
    """A value as the error quotes it: a 200,000-word prompt is not echoed back whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class HttpReply:
    """Formats one request's deltas as an OpenAI response body or as SSE events."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        request,
        num_prompt_tokens: int,
        index: int = 0,
        echo_text: str = "",
        tool_call_formats: ToolCallFormats = ALL_FORMATS,
        reasoning_start: str | None = None,
    ):
        """`index`: this reply's choice among the request's `n` (see deployments/choices.py).
        `echo_text`: the prompt's text, put before the completion with `echo` (completions).
        `tool_call_formats`: the formats of the checkpoint's tool calls (tool_call_formats.py).
        `reasoning_start`: how a chat reply starts under the server's reasoning parser
        (reasoning.py; None: no parser, the text is all content)."""
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.request = request
        self.num_prompt_tokens = num_prompt_tokens
        self.index = index
        self.echo_text = echo_text if getattr(request, "echo", False) else ""
        self.num_tokens = 0  # generated so far
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first delta's)
        self._has_cached_count = False
        self._shown_text = ""  # completions' logprobs in a stream: the text sent so far
        self._text_offset = 0  # completions' logprobs: where the next token's text is looked for
        # None: no tools to call
        self.tool_calls = tool_call_stream(request, tool_call_formats) if chat else None
        # None: no reasoning to split off; tool calls are read in the content after it
        self.reasoning = ReasoningSplitter(reasoning_start) if chat and reasoning_start else None

    async def whole(self, deltas: AsyncIterator[Delta], timings: Timings) -> dict:
        """The reply's body; a failure propagates as raised, for the route to answer and log
        once (a request of many choices fails with its first)."""
        text, finish_reason, stop_reason, entries = self.echo_text, None, None, []
        try:
            async for delta in deltas:
                text += delta.text
                self._count(delta)
                if delta.finish_reason is not None:
                    finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
                entries += self._echoed_logprobs(delta) + (delta.logprobs or [])
        finally:
            await deltas.aclose()
        build = chat_completion_body if self.chat else completion_body
        body = build(self.request_id, self.model, text, finish_reason, self.usage(),
                     self._logprobs(entries, text), stop_reason)  # fmt: skip
        choice = body["choices"][0]
        choice["index"] = self.index
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            put_reasoning(choice, reasoning if self.request.include_reasoning else None, text)
        if self.tool_calls is not None:
            put_tool_calls(choice, self.tool_calls, text or "", finish_reason)
        if self.request.rayinfer_timings:
            body["rayinfer_timings"] = timings.as_dict()
        return body

    async def stream(self, deltas: AsyncIterator[Delta], timings: Timings) -> AsyncIterator[str]:
        async for body in self.choice_events(deltas):
            yield sse(body)
        for event in self.trailer(self.usage(), timings):
            yield event

    def usage(self) -> dict:
        """This choice's usage so far (the prompt's cached tokens from its first delta)."""
        return usage_body(self.num_prompt_tokens, self.num_tokens, self.num_cached_tokens)

    def _count(self, delta: Delta) -> None:
        self.num_tokens += len(delta.token_ids)
        if not self._has_cached_count and delta.num_cached_tokens is not None:
            self.num_cached_tokens, self._has_cached_count = delta.num_cached_tokens, True

    async def choice_events(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[dict]:
        """This choice's chunk bodies; an error once streaming has started is reported in-band
        as the last one. Counts the generated tokens into `num_tokens`."""
        try:
            if self.chat:
                yield self._with_chunk_usage(self._chunk({"role": "assistant", "content": ""}))
            echo = self.echo_text
            async for delta in deltas:
                self._count(delta)
                text = echo + delta.text
                entries = self._echoed_logprobs(delta) + (delta.logprobs or [])
                logprobs = self._streamed_logprobs(entries, text)
                if self.tool_calls is not None or self.reasoning is not None:
                    for chunk in self._split_chunks(delta, logprobs):
                        yield self._with_chunk_usage(chunk)
                    continue
                chunk = self._chunk(text, delta.finish_reason, logprobs, delta.stop_reason)
                yield self._with_chunk_usage(chunk)
                echo = ""
        except Exception as error:  # the stream already started: report in-band, then end
            yield as_openai_error(error, self.request_id).body()
        finally:  # also on client disconnect: closing the pipeline aborts the request
            await deltas.aclose()

    def _split_chunks(self, delta: Delta, logprobs) -> list[dict]:
        """A chat delta's chunks when its text is split: reasoning (reasoning.py), then content
        and tool_calls deltas (deployments/tool_calls.py) read from the content after it, the
        last with the finish reason ('tool_calls' after a call). A delta whose text is all held
        back (it may be part of a tag or a call marker) gives one empty content chunk where it
        ends the reply, carries logprobs, or must show its tokens in the chunks' usage."""
        reason = delta.finish_reason
        reasoning, content = "", delta.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(content)
            if reason is not None:
                rest = self.reasoning.finish()
                reasoning, content = reasoning + rest[0], content + rest[1]
        shows_reasoning = reasoning and self.request.include_reasoning
        bodies = [reasoning_delta(reasoning)] if shows_reasoning else []
        if self.tool_calls is not None:
            bodies += self.tool_calls.deltas(content, reason)
        elif content:
            bodies.append({"content": content})
        shown = reason is not None or logprobs is not None or self.request.include_chunk_usage
        if not bodies and shown:
            bodies = [{"content": ""}]
        chunks = [self._chunk(body, None, logprobs if i == 0 else None)
                  for i, body in enumerate(bodies)]  # fmt: skip
        if reason is not None:
            last = chunks[-1]["choices"][0]
            called = self.tool_calls is not None
            last["finish_reason"] = self.tool_calls.finish_reason(reason) if called else reason
            last["stop_reason"] = delta.stop_reason
        return chunks

    def trailer(self, usage: dict, timings: Timings) -> list[str]:
        """The events after every choice's: the usage chunk when asked for, then [DONE]."""
        events = []
        if self.request.include_usage or self.request.rayinfer_timings:
            events.append(sse(self._usage_chunk(usage, timings)))
        return [*events, "data: [DONE]\n\n"]

    def _chunk(self, content, finish_reason=None, logprobs=None, stop_reason=None) -> dict:
        if not self.chat:
            body = completion_chunk_body(
                self.request_id, self.model, content, finish_reason, logprobs, stop_reason
            )
        else:
            delta = content if isinstance(content, dict) else {"content": content}
            body = chat_chunk_body(
                self.request_id, self.model, delta, finish_reason, logprobs, stop_reason
            )
        body["choices"][0]["index"] = self.index
        return body

    def _with_chunk_usage(self, body: dict) -> dict:
        """With `stream_options.continuous_usage_stats` (as vLLM's), the chunk carries this
        choice's usage so far: a token whose text is empty (part of a character, a special
        token) still shows as `completion_tokens` going up. With `include_usage` alone, the
        chunks before the usage chunk carry `usage: null`, as OpenAI's do."""
        if self.request.include_chunk_usage:
            body["usage"] = self.usage()
        elif self.request.include_usage:
            body["usage"] = None
        return body

    def _echoed_logprobs(self, delta: Delta) -> list:
        """The prompt's entries (the first delta's) when the reply echoes the prompt."""
        return (delta.prompt_logprobs or []) if self.echo_text else []

    def _logprobs(self, entries: list, text: str) -> dict | None:
        """The OpenAI logprobs object of these tokens (None when the request did not ask);
        completions' text offsets are positions in `text`, the reply's text so far."""
        if self.request.requested_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(entries)
        body, self._text_offset = completion_logprobs(entries, text, self._text_offset)
        return body

    def _streamed_logprobs(self, entries: list, chunk_text: str) -> dict | None:
        """A stream chunk's logprobs: text offsets continue across the chunks."""
        if self.request.requested_logprobs is not None and not self.chat:
            self._shown_text += chunk_text
        return self._logprobs(entries, self._shown_text)

    def _usage_chunk(self, usage: dict, timings: Timings) -> dict:
        object_name = "chat.completion.chunk" if self.chat else "text_completion"
        body = usage_chunk_body(self.request_id, self.model, object_name, usage)
        if self.request.rayinfer_timings:
            body["rayinfer_timings"] = timings.as_dict()
        return body


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
