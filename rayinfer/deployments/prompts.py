"""Turn an API request into prompt token ids and SamplingParams, or a 400 naming the field.

A text that cannot fit max_model_len even at the tokenizer's longest token is refused before it
is tokenized (a 200,000-word prompt answers 400 at once); the rest is tokenized whole. vLLM's
truncate_prompt_tokens then keeps the prompt's last tokens (engine/prompt_truncation.py): it
shortens texts that pass that check, unlike vLLM, which tokenizes any text it is to truncate.
"""

from __future__ import annotations

from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.protocol import ChatCompletionRequest
from rayinfer.deployments.runtime import ModelSource
from rayinfer.deployments.tool_call_formats import ToolCallFormats
from rayinfer.deployments.tool_calls import template_inputs
from rayinfer.engine.bad_words import with_bad_words_tokenized
from rayinfer.engine.chat_prompt import ChatOptions, encode_conversation
from rayinfer.engine.prompt_truncation import keep_last, prompt_token_limit
from rayinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from rayinfer.engine.tokenizer import TokenizerError

# Slack on max_model_len x the longest token's characters: a normalizer (NFKD, accent stripping)
# can fold several characters of a text into one of a token.
CHARS_PER_TOKEN_SLACK = 4


class PromptBuilder:
    def __init__(self, source: ModelSource):
        self.tokenizer = source.load_tokenizer()
        self.max_model_len = source.max_model_len
        self.vocab_size = source.model_config.vocab_size
        self.max_text_chars = None  # more characters than this cannot fit max_model_len tokens
        if self.tokenizer is not None:
            per_token = self.tokenizer.max_token_chars * CHARS_PER_TOKEN_SLACK
            self.max_text_chars = self.max_model_len * per_token
        self.tool_call_formats = ToolCallFormats.of_checkpoint(
            source.model_config.architecture, self._template_reads_tools()
        )  # the formats tool calls in replies are read in

    def build(self, request) -> tuple[list[int], SamplingParams]:
        """request: ChatCompletionRequest, CompletionRequest or GenerateRequest."""
        is_chat = isinstance(request, ChatCompletionRequest)
        messages = request.chat_messages() if is_chat else getattr(request, "messages", None)
        field = "messages" if messages is not None else "prompt"
        limit = self._prompt_limit(request)
        if messages is not None:
            texts = [m.get("content") for m in messages]
            self._check_text_length(sum(len(t) for t in texts if isinstance(t, str)), field)
            tools = request.template_tools() if is_chat else None
            options = request.chat_options()  # chat completions' and a handle's fields
            prompt_ids = self.encode_chat(messages, tools, options)
        else:
            prompt_ids = self._encode_prompt(request.prompt, limit)
        prompt_ids = keep_last(prompt_ids, limit)  # a chat's or token ids (a text's already is)
        max_tokens = self._max_tokens(request, len(prompt_ids), field)
        try:
            params = with_bad_words_tokenized(request.sampling_params(max_tokens), self.tokenizer)
            params.check_vocabulary(self.vocab_size)
        except InvalidRequestError as error:
            raise OpenAIError(400, str(error), param=error.field) from None
        return prompt_ids, params

    def encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        options: ChatOptions | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The prompt ids of a conversation, as offline `LLM.chat` renders it
        (engine/chat_prompt.py). tools: a chat request's tools for the template
        (deployments/tool_calls.py). `messages` is unchanged."""
        if self.tokenizer is None:
            raise OpenAIError(400, "messages: this model has no tokenizer", param="messages")
        try:
            if tools:
                reads_tools = self.tokenizer.template_reads_tools()
                messages, tools = template_inputs(messages, tools, reads_tools)
            return encode_conversation(self.tokenizer, messages, tools, options, add_special_tokens)
        except InvalidRequestError as error:  # the chat options against these messages
            raise OpenAIError(400, str(error), param=error.field) from None
        except Exception as error:  # TokenizerError, or the template raised
            raise OpenAIError(400, f"messages: {error}", param="messages") from None

    def _template_reads_tools(self) -> bool:
        """False too without a chat template (a chat then answers 400 anyway)."""
        try:
            return self.tokenizer is not None and self.tokenizer.template_reads_tools()
        except TokenizerError:
            return False

    def _encode_prompt(self, prompt: str | list[int], limit: int | None = None) -> list[int]:
        """limit: the tokens truncate_prompt_tokens keeps of a text (None: all)."""
        if not prompt:
            raise OpenAIError(400, "prompt: must not be empty", param="prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise OpenAIError(
                    400, "prompt: this model has no tokenizer; send token ids", param="prompt"
                )
            self._check_text_length(len(prompt), "prompt")
            if limit is not None:
                return self.tokenizer.encode_last(prompt, limit)
            return self.tokenizer.encode(prompt)
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise OpenAIError(
                400, f"prompt: token ids must lie in [0, {self.vocab_size})", param="prompt"
            )
        return list(prompt)

    def _prompt_limit(self, request) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps (None: all), or a 400 naming it
        when it does not fit beside the requested max_tokens (none requested counts 0)."""
        try:
            return prompt_token_limit(
                request.truncate_prompt_tokens,
                self.max_model_len,
                request.requested_max_tokens or 0,
            )
        except InvalidRequestError as error:
            raise OpenAIError(400, str(error), param=error.field) from None

    def _check_text_length(self, num_chars: int, field: str) -> None:
        if self.max_text_chars is not None and num_chars > self.max_text_chars:
            raise OpenAIError(
                400,
                f"{field}: {num_chars} characters cannot fit this model's maximum context length "
                f"of {self.max_model_len} tokens; shorten the prompt",
                param=field,
            )

    def _max_tokens(self, request, num_prompt_tokens: int, field: str) -> int:
        """field: the prompt's (`messages` or `prompt`); the limit's own is the request's
        `max_tokens_field` (chat's max_completion_tokens when it gave that one)."""
        requested, limit_field = request.requested_max_tokens, request.max_tokens_field
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise OpenAIError(
                400,
                f"{field}: the prompt has {num_prompt_tokens} tokens; this model's maximum "
                f"context length is {self.max_model_len} tokens, which leaves no room to "
                "generate. Shorten the prompt.",
                param=field,
            )
        if requested is not None and requested > room:
            raise OpenAIError(
                400,
                f"{limit_field}: {requested} tokens requested, but the prompt has "
                f"{num_prompt_tokens} tokens and this model's maximum context length is "
                f"{self.max_model_len}; use {limit_field} <= {room}",
                param=limit_field,
            )
        return requested or room
