"""A conversation rendered through a checkpoint's Jinja chat template, as transformers'
`apply_chat_template` renders it: the same sandboxed environment (trim_blocks, lstrip_blocks,
loop controls, `{% generation %}`), the same helpers (`raise_exception`, `strftime_now`, a
`tojson` that leaves HTML characters and non-ASCII alone), and messages without their None
values and with their reasoning under every name templates read.

`continue_final_message` leaves the last message open, as transformers 5 does: a marker is
appended to its content, the conversation rendered, and the text cut where the marker begins
(less trailing whitespace where the template trimmed the content). The prompt then ends with
that content, without what the template writes after it (an end-of-turn token, a new header).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rayinfer.engine.sampling_params import InvalidRequestError

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # first: what templates read
CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own, its trailing space included
CONTINUE_FIELD = "continue_final_message"


def render_chat(
    source: str,
    messages: list[dict],
    variables: dict,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The conversation rendered by the template `source`. variables: the rest of what the
    template may read (tools, documents, special tokens, chat_template_kwargs)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            CONTINUE_FIELD, "cannot be true with add_generation_prompt true (its default)"
        )
    messages = [_normalize_message(message) for message in messages]
    final_text = None
    if continue_final_message:
        final_text, messages = _mark_final_message(messages, source)
    text = _compile_template(source).render(
        {**variables, "messages": messages, "add_generation_prompt": add_generation_prompt}
    )
    return text if final_text is None else _cut_at_marker(text, final_text)


def _normalize_message(message: dict) -> dict:
    """As transformers: drop None values (OpenAI clients send content=None) and copy the
    reasoning under every name templates read."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _mark_final_message(messages: list[dict], source: str) -> tuple[str, list[dict]]:
    """(the final message's text, the messages with CONTINUE_MARKER after that text): its
    content, or the last text part of a list of parts. The messages given are not changed."""
    if not messages:
        raise InvalidRequestError(CONTINUE_FIELD, "the conversation has no message to continue")
    final = dict(messages[-1])
    content = final.get("content")
    if content is None:
        raise InvalidRequestError(CONTINUE_FIELD, "the final message has no content to continue")
    if "content" not in source:
        raise InvalidRequestError(
            CONTINUE_FIELD, "the chat template never reads a message's content to leave it open"
        )
    if not isinstance(content, (list, tuple)):
        final["content"] = content + CONTINUE_MARKER
        return content, [*messages[:-1], final]
    parts = list(content)
    texts = [i for i, part in enumerate(parts) if isinstance(part, dict) and "text" in part]
    if not texts:
        raise InvalidRequestError(CONTINUE_FIELD, "the final message has no text to continue")
    text = parts[texts[-1]]["text"]
    parts[texts[-1]] = {**parts[texts[-1]], "text": text + CONTINUE_MARKER}
    final["content"] = parts
    return text, [*messages[:-1], final]


def _cut_at_marker(text: str, final_text: str) -> str:
    marker = CONTINUE_MARKER.strip()
    if final_text.strip() not in text or marker not in text:
        raise InvalidRequestError(
            CONTINUE_FIELD,
            "the chat template does not write the final message's content as given (it drops "
            "or changes part of it), so the prompt cannot end inside it",
        )
    at = text.rindex(marker)
    if text.startswith(CONTINUE_MARKER, at):
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the content: so is its open end


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile with the environment transformers uses: sandboxed, trim_blocks and lstrip_blocks."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text: render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates must not do.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
