"""A thinking model's reasoning split off its reply, as vLLM's reasoning parsers split it: the
text between `<think>` and `</think>` is the reasoning, what follows `</think>` the content.

A reply starts in one of three ways (`reply_start` in chat_reasoning.py picks one per request):

- IN_REASONING: the chat template opened `<think>` in the prompt (DeepSeek-R1, V3.1/V3.2 in
  thinking mode, GLM-4.7 and GLM-5, Qwen3-Thinking-2507): everything up to `</think>` is
  reasoning; an opening `<think>` of the reply's own (R1 writes one) is dropped.
- AT_TAG: reasoning only if the reply opens with `<think>` (Qwen3, GLM-4.5 with thinking on,
  whose model writes the tag); a reply that opens with anything else is all content.
- NO_REASONING: thinking is off for the request; all content.

Only whitespace may come before an opening `<think>`. A reply that never writes `</think>` (cut
by max_tokens) is reasoning to its end. A stream holds back only the text that may still
become a tag (`<thi`, `</th`), so pieces cut anywhere, even inside a tag, split as the whole
text does.
"""

from __future__ import annotations

from typing import Literal

from rayinfer.engine.stop_checker import streamable_length

# The app config's `reasoning_parser` values (vLLM's names)
ReasoningParserName = Literal["deepseek_r1", "deepseek_v3", "qwen3", "glm45"]
OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"

IN_REASONING = "in_reasoning"
AT_TAG = "at_tag"
NO_REASONING = "no_reasoning"
_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


class ReasoningSplitter:
    """Splits one reply's text, fed in pieces, into reasoning and content."""

    def __init__(self, start: str):
        """start: IN_REASONING, AT_TAG or NO_REASONING."""
        if start not in (IN_REASONING, AT_TAG, NO_REASONING):
            raise ValueError(f"start must be {IN_REASONING}, {AT_TAG} or {NO_REASONING}")
        self.start = start
        self.state = _CONTENT if start == NO_REASONING else _OPENING
        self.held = ""  # text not given out yet: it may still be (part of) a tag
        self.has_reasoned = False  # the reply entered its reasoning

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this piece of the reply gives out."""
        self.held += text
        reasoning = ""
        if self.state == _OPENING:
            opened = self.held.lstrip()
            if opened.startswith(OPEN_TAG):
                self.held = opened[len(OPEN_TAG) :]
                self._enter(_REASONING)
            elif OPEN_TAG.startswith(opened):  # only whitespace or the tag's beginning so far
                return "", ""
            else:
                self._enter(self._untagged_state())
        if self.state == _REASONING:
            end = self.held.find(CLOSE_TAG)
            if end < 0:
                keep = streamable_length(self.held, (CLOSE_TAG,))
                reasoning, self.held = self.held[:keep], self.held[keep:]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(CLOSE_TAG) :]
            self._enter(_CONTENT)
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) of the text held back, at the reply's end."""
        held, self.held = self.held, ""
        if self.state == _OPENING:
            self._enter(self._untagged_state())
        return (held, "") if self.state == _REASONING else ("", held)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply's (reasoning, content), as vLLM's message carries them: reasoning
        None when the reply never reasoned, content None when it was only reasoning."""
        reasoning, content = self.feed(text)
        rest_reasoning, rest_content = self.finish()
        reasoning, content = reasoning + rest_reasoning, content + rest_content
        if not self.has_reasoned:
            return None, content
        return reasoning, content or None

    def _untagged_state(self) -> str:
        return _REASONING if self.start == IN_REASONING else _CONTENT

    def _enter(self, state: str) -> None:
        self.state = state
        self.has_reasoned = self.has_reasoned or state == _REASONING
