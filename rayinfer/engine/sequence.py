"""One request's tokens and its place in the paged cache, as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rayinfer.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int = 0
    prefill_only: bool = False  # stop after the first token and keep the KV for a hand-off
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # the window pool's block per block_table entry, -1 where none is held (engine/block_manager.py)
    window_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    kv_partition: int | None = None  # cache partition (DP attention replica) once admitted

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building token_ids (a step reads a few tokens of a
        sequence that may hold thousands)."""
        prompt = self.prompt_token_ids
        num_prompt = len(prompt)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        tokens = self.num_tokens if num_tokens is None else num_tokens
        return -(-tokens // block_size)
