"""A conversation's prompt ids, the same offline (`LLM.chat`) and served
(deployments/prompts.py): vLLM's chat options (`add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`) checked as vLLM checks them, and the messages
as the template gets them (engine/template_messages.py).

`chat_template_kwargs` are variables for the template (Qwen3's `enable_thinking`), over the
special tokens and `documents`. A key that names what the renderer sets itself is refused
(`chat_template` and `tokenize`, as vLLM refuses them; `messages`, whose render vLLM fails; and
`tools`, which come from the request's own field: rayinfer reads the reply's calls by them), or,
for `add_generation_prompt` and `continue_final_message`, left out: the request's own fields win,
as in vLLM's merge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rayinfer.engine.chat_template import CONTINUE_FIELD
from rayinfer.engine.sampling_params import InvalidRequestError
from rayinfer.engine.template_messages import template_messages

KWARGS_FIELD = "chat_template_kwargs"
REFUSED_KWARGS = {  # key -> why
    "messages": "the conversation is the request's messages",
    "tools": "tools are the request's own tools field",
    "chat_template": "a request cannot choose the chat template",
    "tokenize": "the rendered prompt is always tokenized",
}
OVERRIDDEN_KWARGS = ("add_generation_prompt", "continue_final_message")


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered; `checked` makes them from what a request gave."""

    add_generation_prompt: bool = True  # the template's header of a new assistant turn
    continue_final_message: bool = False  # the prompt ends inside the last (assistant) message
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # more template variables

    @classmethod
    def checked(
        cls,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatOptions:
        """Raises InvalidRequestError naming the field at fault."""
        flags = {"add_generation_prompt": add_generation_prompt}
        flags[CONTINUE_FIELD] = continue_final_message
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise InvalidRequestError(name, f"must be true or false, got {value!r}")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                CONTINUE_FIELD,
                "cannot be true with add_generation_prompt true (its default): set "
                "add_generation_prompt to false to continue the final message",
            )
        variables = template_variables(chat_template_kwargs)
        return cls(add_generation_prompt, continue_final_message, variables)

    def check_conversation(self, messages: list[dict]) -> None:
        """continue_final_message continues an assistant's message: it must be the last."""
        if not self.continue_final_message:
            return
        role = messages[-1].get("role") if messages else None
        if role != "assistant":
            raise InvalidRequestError(
                CONTINUE_FIELD,
                f"continues the last message, which must be an assistant's; "
                f"messages[{len(messages) - 1}] is a {role} message",
            )


def template_variables(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The template variables of chat_template_kwargs, less those the request's own fields
    override; raises InvalidRequestError for a refused key."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise InvalidRequestError(
            KWARGS_FIELD, 'must be an object of template variables, e.g. {"enable_thinking": false}'
        )
    for key in chat_template_kwargs:
        if not isinstance(key, str):
            raise InvalidRequestError(KWARGS_FIELD, f"keys are variable names, got {key!r}")
        if key in REFUSED_KWARGS:
            raise InvalidRequestError(KWARGS_FIELD, f"{key!r} is refused: {REFUSED_KWARGS[key]}")
    return {k: v for k, v in chat_template_kwargs.items() if k not in OVERRIDDEN_KWARGS}


def encode_conversation(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    options: ChatOptions | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The prompt ids of `messages` rendered by the tokenizer's (engine/tokenizer.py) chat
    template. Raises InvalidRequestError (the options against the messages), TokenizerError
    (no template), or what the template raised."""
    options = options or ChatOptions()
    options.check_conversation(messages)
    return tokenizer.encode_chat(
        template_messages(messages),
        options.add_generation_prompt,
        tools,
        continue_final_message=options.continue_final_message,
        template_kwargs=options.template_kwargs,
        add_special_tokens=add_special_tokens,
    )
