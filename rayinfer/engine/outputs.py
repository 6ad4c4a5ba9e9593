"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # every generated token so far
    text: str = ""  # detokenized generated text so far (stop string cut off)
    new_token_ids: list[int] = field(default_factory=list)  # generated in the last step
    new_text: str = ""  # text added in the last step (safe to stream)
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
