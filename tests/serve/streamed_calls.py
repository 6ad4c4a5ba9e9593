"""A streamed chat reply as the openai client reads it: its content, its tool calls put together
from their deltas, and in which chunk each part came, so that tests can tell a call streamed as
it was written from one sent whole at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StreamedCall:
    id: str | None
    name: str
    arguments: str = ""
    head_chunk: int = -1  # the chunk that began the call (its id, type and name)
    argument_chunks: list[int] = field(default_factory=list)  # those with argument fragments


@dataclass
class StreamedReply:
    content: str = ""
    content_chunks: list[int] = field(default_factory=list)  # those with non-empty content
    calls: list[StreamedCall] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)


def read_stream(chunks) -> StreamedReply:
    """The reply of one choice's `chat.completion.chunk`s (an openai client stream)."""
    reply, calls = StreamedReply(), {}
    for number, chunk in enumerate(chunks):
        for choice in chunk.choices:
            if choice.finish_reason:
                reply.finish_reasons.append(choice.finish_reason)
            if choice.delta.content:
                reply.content += choice.delta.content
                reply.content_chunks.append(number)
            for part in choice.delta.tool_calls or []:
                function = part.function
                if part.index not in calls:
                    assert part.id and part.type == "function" and function.name, part
                    calls[part.index] = StreamedCall(part.id, function.name, head_chunk=number)
                call = calls[part.index]
                if function is not None and function.arguments:
                    call.arguments += function.arguments
                    call.argument_chunks.append(number)
    reply.calls = [calls[index] for index in sorted(calls)]
    return reply
