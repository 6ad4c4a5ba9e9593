"""What the engine sends to an executor each step: plain data that pickles cheaply to workers."""

from __future__ import annotations

from dataclasses import dataclass

from rayinfer.engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the new tokens computed this step
    start_position: int  # position of token_ids[0] in the sequence (= tokens already cached)
    block_table: list[int]  # every block the sequence holds
    samples: bool  # whether to sample a next token after the last new token
    params: SamplingParams
    kv_partition: int = 0  # the cache partition (data-parallel attention replica) holding it
    output_token_ids: list[int] | None = None  # generated so far; sent only when penalties apply

    @property
    def seq_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class ModelBatch:
    requests: list[ScheduledRequest]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def num_sampling(self) -> int:
        return sum(r.samples for r in self.requests)
