"""One streamed request to an OpenAI-compatible server, folded into a RequestResult.

TTFT is the arrival of the first chunk that carries a generated token, even one whose text is
empty (part of a multi-byte character, a special token). Where the server puts the usage so far
on every chunk (`stream_options.continuous_usage_stats`: rayinfer and vLLM), a chunk carries a
token when `completion_tokens` goes up; elsewhere (transformers serve sends usage only at the
end, and no chunk for a token without text), when its text is not empty. A completed request
whose every chunk was empty takes its TTFT at its first chunk: never 0, never left out.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from rayinfer.bench.serve_dataset import SampleRequest

BACKENDS = ("rayinfer", "vllm", "openai", "transformers")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# rayinfer_timings' parts of the hand-off: device -> pinned host copy and object-store put on
# export, object-store get and host -> device copy on import (deployments/types.py, Timings)
HANDOFF_PARTS = ("kv_export_copy_s", "kv_put_s", "kv_get_s", "kv_import_copy_s")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0  # the server's usage; the client's count if it sends none
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0  # end to end: sent -> the stream's end
    itl_s: list[float] = field(default_factory=list)  # between chunks that carry tokens
    sent_s: float = 0.0  # when it was sent, from the pass's start
    has_chunk_usage: bool = False  # the server counted tokens on every chunk
    num_token_chunks: int = 0
    first_chunk_s: float | None = None  # the first chunk with a choice, token or not
    last_token_s: float | None = None
    kv_export_s: float = 0.0
    kv_import_s: float = 0.0
    kv_bytes: float = 0.0
    kv_parts_s: dict[str, float] = field(default_factory=dict)  # HANDOFF_PARTS the server sent
    kv_path: str = ""  # how its KV came: shm, object_store or arena_via_object_store
    kv_copies: str = ""  # how export/import copied: batched, staged, host (Timings.kv_copies)
    text: str = ""  # what was generated, as streamed

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(request: SampleRequest, model: str, endpoint: str, backend: str,
                 response_format: dict | None = None) -> dict:  # fmt: skip
    """A streamed, greedy request for exactly `output_len` tokens, in the backend's dialect;
    `response_format` as OpenAI's (structured output), when given."""
    body = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if backend == "transformers":  # refuses unknown fields (422); no ignore_eos
        config = {"max_new_tokens": request.output_len, "min_new_tokens": request.output_len}
        body["generation_config"] = json.dumps(config | {"do_sample": False})
    elif backend in ("rayinfer", "vllm"):
        body["ignore_eos"] = True
        body["stream_options"]["continuous_usage_stats"] = True
    if backend == "rayinfer":
        body["rayinfer_timings"] = True
    if response_format is not None:
        body["response_format"] = response_format
    return body


def choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def error_message(error) -> str:
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)


def record_event(result: RequestResult, event: dict, elapsed_s: float) -> None:
    """Fold one SSE event, received elapsed_s after the request was sent, into result."""
    if "error" in event:
        result.error = error_message(event["error"])
        return
    choices = event.get("choices") or []
    usage = event.get("usage")
    if choices:
        result.text += choice_text(choices[0])
        if result.first_chunk_s is None:
            result.first_chunk_s = elapsed_s
            result.has_chunk_usage = usage is not None
        if result.has_chunk_usage and usage is not None:
            carries_token = usage["completion_tokens"] > result.output_tokens
        else:
            carries_token = bool(choice_text(choices[0]))
        if carries_token:
            mark_token(result, elapsed_s)
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.output_tokens = usage.get("completion_tokens", result.output_tokens)
    timings = event.get("rayinfer_timings") or {}
    result.kv_export_s = timings.get("kv_export_s", result.kv_export_s)
    result.kv_import_s = timings.get("kv_import_s", result.kv_import_s)
    result.kv_bytes = timings.get("kv_bytes", result.kv_bytes)
    result.kv_parts_s |= {part: timings[part] for part in HANDOFF_PARTS if part in timings}
    result.kv_path = timings.get("kv_path", result.kv_path)
    result.kv_copies = timings.get("kv_copies", result.kv_copies)


def mark_token(result: RequestResult, elapsed_s: float) -> None:
    if result.ttft_s is None:
        result.ttft_s = elapsed_s
    else:
        result.itl_s.append(elapsed_s - result.last_token_s)
    result.last_token_s = elapsed_s
    result.num_token_chunks += 1


def finish(result: RequestResult, latency_s: float, request: SampleRequest) -> RequestResult:
    result.latency_s = latency_s
    result.prompt_tokens = result.prompt_tokens or request.prompt_len
    result.output_tokens = result.output_tokens or result.num_token_chunks
    result.ok = not result.error and result.output_tokens > 0
    if result.ok and result.ttft_s is None:  # every chunk was empty text, no usage per chunk
        result.ttft_s = result.first_chunk_s if result.first_chunk_s is not None else latency_s
    return result


async def send_one(
    session: aiohttp.ClientSession, url: str, body: dict, request: SampleRequest, endpoint: str
) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with session.post(url + ENDPOINTS[endpoint], json=body) as reply:
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {(await reply.text())[:300]}"
                return result
            async for raw_line in reply.content:
                line = raw_line.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                record_event(result, json.loads(line[5:]), time.perf_counter() - start)
                if result.error:
                    return result
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as error:
        result.error = repr(error)
        return result
    return finish(result, time.perf_counter() - start, request)
