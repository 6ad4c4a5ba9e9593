"""The app config's `reasoning_parser` applied to chat requests and replies: how each reply
starts (reasoning.py splits it), the structured outputs refused beside reasoning, and the
reasoning's fields in the reply bodies. Completions are not split, as in vLLM.

The parsers (vLLM's names), and where a reply starts:

- `deepseek_r1`: inside the reasoning, always (R1's template opens `<think>` in the prompt;
  the model may also write it). chat_template_kwargs do not change it.
- `deepseek_v3` (V3.1, V3.2): inside the reasoning when chat_template_kwargs turn `thinking`
  (or `enable_thinking`) on, or the rendered prompt ends with `<think>` (the template opened
  it); else no reasoning, the templates' default.
- `qwen3` and `glm45` (Qwen3, GLM-4.5 to GLM-5): no reasoning with chat_template_kwargs
  `{"enable_thinking": false}`; else inside the reasoning when the rendered prompt ends with
  `<think>` (Qwen3-Thinking-2507, Qwen3.5, GLM-4.7 and GLM-5 open it there), else reasoning
  only when the reply opens with `<think>` (Qwen3, GLM-4.5: the model writes both tags).

Reasoning goes out under both names clients read: `reasoning_content` (DeepSeek's API's and
older vLLM's, which most clients read) and `reasoning` (vLLM's current name).
"""

from __future__ import annotations

from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.reasoning import AT_TAG, IN_REASONING, NO_REASONING, OPEN_TAG

REASONING_FIELDS = ("reasoning_content", "reasoning")
PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens read for a `<think>` the template opened
_THINKING_SWITCH = {  # parser -> how a request turns its thinking off, for the 400's hint
    "deepseek_r1": "its template always thinks: serve without reasoning_parser",
    "deepseek_v3": 'leave chat_template_kwargs "thinking" unset or false',
    "qwen3": 'send chat_template_kwargs {"enable_thinking": false}',
    "glm45": 'send chat_template_kwargs {"enable_thinking": false}',
}


def reply_start(parser: str, template_kwargs: dict | None, prompt_tail: str) -> str:
    """How a chat reply starts: IN_REASONING, AT_TAG or NO_REASONING. template_kwargs: the
    request's chat_template_kwargs; prompt_tail: the rendered prompt's last tokens as text."""
    kwargs = template_kwargs or {}
    opened = prompt_tail.rstrip().endswith(OPEN_TAG)
    if parser == "deepseek_r1":
        return IN_REASONING
    if parser == "deepseek_v3":
        thinking = kwargs.get("thinking") or kwargs.get("enable_thinking") or opened
        return IN_REASONING if thinking else NO_REASONING
    if kwargs.get("enable_thinking") is False:  # what Qwen3's and GLM's templates test
        return NO_REASONING
    return IN_REASONING if opened else AT_TAG


class ChatReasoning:
    """The server's reasoning parser over its tokenizer, for each chat request."""

    def __init__(self, parser: str, tokenizer):
        self.parser = parser
        self.tokenizer = tokenizer

    def start_of(self, request, prompt_ids: list[int]) -> str:
        """The reply's start for a chat request and its rendered prompt; a 400 where the request
        constrains a reply that may reason."""
        tail = self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        start = reply_start(self.parser, request.chat_template_kwargs, tail)
        if start != NO_REASONING:
            self._refuse_constraint(request)
        return start

    def _refuse_constraint(self, request) -> None:
        """rayinfer's grammars mask a reply from its first token, where vLLM's begin after the
        reasoning: under one, the reasoning could not be written."""
        field = constrained_field(request)
        if field is None:
            return
        raise OpenAIError(
            400,
            f"{field}: cannot constrain a reply that may start with reasoning (the server's "
            f"reasoning_parser is {self.parser}): the grammar would apply from the reply's "
            f"first token, inside the reasoning; to constrain it, turn thinking off "
            f"({_THINKING_SWITCH[self.parser]})",
            param=field,
        )


def constrained_field(request) -> str | None:
    """The field whose grammar constrains a chat request's reply (None: nothing does), in the
    order request.structured_output() reads them."""
    if request.structured_output() is None:
        return None
    if request.tool_call_mode in ("named", "required"):
        return "tool_choice"
    if request.response_format is not None:
        return "response_format"
    if request.structured_outputs is not None:
        return "structured_outputs"
    given = ("guided_json", "guided_regex", "guided_choice")
    return next(name for name in given if getattr(request, name) is not None)


def reasoning_delta(reasoning: str) -> dict:
    """A stream chunk's delta that carries reasoning."""
    return dict.fromkeys(REASONING_FIELDS, reasoning)


def put_reasoning(choice: dict, reasoning: str | None, content: str | None) -> None:
    """A whole reply's message with its reasoning (null when none) beside its content."""
    message = choice["message"]
    message["content"] = content
    message.update(dict.fromkeys(REASONING_FIELDS, reasoning))
