"""OpenAI-compatible response bodies: completions and chat completions, their stream chunks,
token usage, and the model list.

Each choice also carries vLLM's `stop_reason` beside `finish_reason`: the stop token id (an int
from `stop_token_ids`) or the stop string that ended it; null for EOS or `length`, and on a
stream's chunks before the one that carries the finish reason."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


def usage_body(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None
) -> dict[str, Any]:
    """num_cached_tokens: the prompt tokens served from the prefix cache, when known."""
    usage: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }
    if num_cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return usage


def chat_completion_body(
    request_id, model, text, finish_reason, usage, logprobs=None, stop_reason=None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "logprobs": logprobs,
            }
        ],
        "usage": usage,
    }


def completion_body(
    request_id, model, text, finish_reason, usage, logprobs=None, stop_reason=None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_text_choice(text, finish_reason, stop_reason, logprobs)],
        "usage": usage,
    }


def chat_chunk_body(
    request_id, model, delta: dict, finish_reason=None, logprobs=None, stop_reason=None
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "delta": delta,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "logprobs": logprobs,
    }
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def completion_chunk_body(
    request_id, model, text, finish_reason=None, logprobs=None, stop_reason=None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_text_choice(text, finish_reason, stop_reason, logprobs)],
    }


def _text_choice(text, finish_reason, stop_reason, logprobs) -> dict[str, Any]:
    return {
        "index": 0,
        "text": text,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "logprobs": logprobs,
    }


def usage_chunk_body(request_id, model, object_name: str, usage: dict) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": object_name,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage,
    }


class ModelCard(BaseModel):
    """`GET /v1/models/{id}`, and each entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "rayinfer"
    max_model_len: int = Field(description="extension (vLLM's): prompt plus completion tokens")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def models_body(served_model_name: str, max_model_len: int) -> dict[str, Any]:
    card = ModelCard(id=served_model_name, max_model_len=max_model_len)
    return ModelList(data=[card]).model_dump()
