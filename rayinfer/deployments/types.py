"""What the deployments pass each other, and what Python handle callers send and receive."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from rayinfer.deployments.chat_template_fields import ChatTemplateFields
from rayinfer.deployments.sampling_fields import SamplingFields
from rayinfer.engine.kv_handoff import KVHandoff
from rayinfer.engine.outputs import TokenLogprobs
from rayinfer.engine.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class Delta:
    """A piece of one choice's stream as the ingress receives it from the engines."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None  # engine.outputs.TokenLogprobs per token id, when asked
    prompt_logprobs: list | None = None  # the first delta's, with SamplingParams.prompt_logprobs
    num_cached_tokens: int | None = None  # the first delta's: prompt tokens from the prefix cache
    stop_reason: int | str | None = None  # with finish_reason "stop": RequestOutput's (vLLM's)


class GenerateRequest(SamplingFields, ChatTemplateFields):
    """A request through a Python handle: `prompt` (text or token ids) or chat `messages`,
    rendered with the chat template's fields as chat completions are (add_generation_prompt,
    continue_final_message, chat_template_kwargs: deployments/chat_template_fields.py).

    The sampling fields are those of the OpenAI API (max_tokens, temperature, top_p, top_k, stop,
    seed, ignore_eos); `max_tokens=None` generates up to max_model_len. `logprobs=k` reports each
    generated token's log-probability and its k most likely alternatives (engine TokenLogprobs).
    Python values convert as pydantic's lax mode does (a tuple of stops, a numpy int), unlike
    the HTTP bodies' strict JSON types.
    """

    model_config = ConfigDict(extra="ignore", strict=False)

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt is not None and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if self.messages is not None and len(self.messages) == 0:
            raise ValueError("messages must not be empty")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs


@dataclass
class GenerateChunk:
    """One step of a streamed generation: the text and tokens added, and why it ended."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, with `logprobs` asked
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class GenerateResponse:
    request_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: str | None
    timings: dict[str, float | int | bool] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, with `logprobs` asked
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class PrefillResult:
    """The first token and, unless the request already ended, the KV hand-off.

    `handoff.payload` holds ObjectRefs owned by the prefill workers (nested, so Serve passes them
    by reference); decode pulls the KV from the object store itself.
    """

    request_id: str
    first_token_id: int
    first_text: str  # the first token's text that is safe to stream (no stop-string prefix)
    text: str  # the whole text when the request ended at its first token
    finish_reason: str | None  # None when decode continues
    handoff: KVHandoff | None
    num_cached_tokens: int = 0
    first_logprobs: Any = None  # engine.outputs.TokenLogprobs when the request asked for them
    prompt_logprobs: list | None = None  # per prompt token, with SamplingParams.prompt_logprobs
    stop_reason: int | str | None = None  # when the request ended at its first token by a stop


@dataclass
class DecodeRequest:
    prefill: PrefillResult
    params: SamplingParams


@dataclass
class EngineRequest:
    """A whole request for a colocated Engine replica: it prefills and decodes it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class DecodeChunk:
    """What a Decode (or colocated Engine) replica streams: the tokens of one engine step."""

    new_text: str
    new_token_ids: list[int]
    finish_reason: str | None
    kv_import_s: float | None = None  # set on the first chunk
    kv_timings: dict | None = None  # the first chunk's: the hand-off's copies (Timings.add_handoff)
    was_recomputed: bool = False  # the KV was lost and decode recomputed the prompt
    new_logprobs: list | None = None  # engine.outputs.TokenLogprobs of new_token_ids, if asked
    prompt_logprobs: list | None = None  # an Engine's first chunk, with prompt_logprobs asked
    num_cached_tokens: int | None = None  # an Engine's first chunk: prompt tokens from the cache
    stop_reason: int | str | None = None  # the last chunk's, with finish_reason "stop"


@dataclass
class Timings:
    """Per-request timings in seconds (with `rayinfer_timings=true`, also in the HTTP reply)."""

    ttft_s: float = 0.0
    prefill_s: float = 0.0
    kv_export_s: float = 0.0  # the prefill worker's export, beside its steps: copies and puts
    kv_import_s: float = 0.0  # the decode worker's import: object-store get and copies in
    kv_bytes: int = 0
    # Where the hand-off's time went: device -> host copies (into pinned memory or the
    # prefill worker's arena) and object-store puts on export; object-store get (or the
    # arena's mapping) and host -> device copies on import.
    kv_export_copy_s: float = 0.0
    kv_put_s: float = 0.0
    kv_get_s: float = 0.0
    kv_import_copy_s: float = 0.0
    # How the KV came: "shm" (mapped from the prefill worker's arena on the same node),
    # "object_store", or "arena_via_object_store" (an arena on another node); "" without one.
    kv_path: str = ""
    # How each side copied, "export/import": "batched" (row copies on the copy engines),
    # "staged" (device staging and one kernel), "host" (a CPU cache), "converted" (dtypes).
    kv_copies: str = ""
    was_recomputed: bool = False
    was_resumed: bool = False  # a decode replica died mid-stream and another one finished it

    def as_dict(self) -> dict[str, float | int | bool | str]:
        return asdict(self)

    def add_handoff(self, kv_timings: dict | None) -> None:
        """A decode worker's import timings (WorkerGroup.finish_import), the export's inside."""
        if not kv_timings:
            return
        export = kv_timings.get("export", {})
        self.kv_export_s = export.get("export_s", 0.0)
        self.kv_export_copy_s = export.get("copy_s", 0.0)
        self.kv_put_s = export.get("put_s", 0.0)
        self.kv_get_s = kv_timings.get("get_s", 0.0)
        self.kv_import_copy_s = kv_timings.get("copy_s", 0.0)
        self.kv_path = kv_timings.get("path", "")
        self.kv_copies = f"{export.get('way', '')}/{kv_timings.get('way', '')}"
        self.kv_import_s = self.kv_get_s + self.kv_import_copy_s
