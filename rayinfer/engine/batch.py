"""What the engine sends to an executor each step: plain data that pickles cheaply to workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from rayinfer.engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the new tokens computed this step
    start_position: int  # position of token_ids[0] in the sequence (= tokens already cached)
    block_table: list[int]  # every block the sequence holds
    samples: bool  # whether to sample a next token after the last new token
    params: SamplingParams | None  # None only on the wire to a worker that holds them
    kv_partition: int = 0  # the cache partition (data-parallel attention replica) holding it
    output_token_ids: list[int] | None = None  # generated so far; sent only when penalties apply
    # With SamplingParams.structured_output: the tokens generated so far, sent the first time
    # the request samples on this executor, so that a runner without its grammar matcher (a
    # decode worker after the hand-off) rebuilds it; None on later steps.
    grammar_token_ids: list[int] | None = None
    # With SamplingParams.repetition_penalty != 1: the prompt, sent likewise only the first time
    # the request samples on this executor (the runner keeps its distinct ids); None after.
    prompt_token_ids: list[int] | None = None
    # The tokens this step may not sample: while fewer than SamplingParams.min_tokens are
    # generated, EOS (unless ignored) and the stop_token_ids; with bad_words, the last token of
    # each word whose other tokens the output ends with (engine/bad_words.py). None: none.
    suppressed_token_ids: tuple[int, ...] | None = None
    # With SamplingParams.prompt_logprobs: the prompt tokens this chunk's rows predict (row j:
    # the prompt token at start_position + j + 1), while they are prompt tokens.
    prompt_logprob_targets: list[int] | None = None
    # Sent to a worker, block_table may hold only the blocks from this index on: the worker has
    # the earlier ones from an earlier step (workers/group.py sends tables incrementally).
    block_table_from: int = 0
    # A model with a window pool: the window block of each block_table entry (-1: none held),
    # sent from the same index on as block_table (engine/block_manager.py)
    window_table: list[int] | None = None
    # A prefill-only request whose prompt this step ends: its KV is exported after the step, so
    # a worker may copy it out layer by layer during it (workers/runner/layer_export.py).
    exports_kv: bool = False

    @property
    def seq_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class ModelBatch:
    """One step's requests for one executor (or, from a WorkerGroup, for one worker: the share
    of its data-parallel replica, with what the whole group agreed on for this step)."""

    requests: list[ScheduledRequest]
    # Every rank's token count in this worker's expert-parallel group (its DP replica's tokens;
    # an idle replica's placeholder token counts 1): the token exchange then needs no gather.
    ep_tokens: list[int] | None = None
    # Set when every replica of a group with collectives runs this step as pure decodes padded
    # to this CUDA graph bucket (idle replicas replay it on padding); None: eager.
    decode_bucket: int | None = None
    # Likewise when every replica's share is one new prompt (or nothing), prefilled in this
    # prefill graph bucket of tokens (workers/runner/prefill_graphs.py).
    prefill_bucket: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def num_sampling(self) -> int:
        return sum(r.samples for r in self.requests)


class SampledLogprobs(NamedTuple):
    """A sampled token's log-probability and its request's k most likely alternatives (most
    likely first), from the raw logits' log-softmax."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SampledTokens:
    """What an executor returns for a step: the next token of every request with `samples`, in
    order, and, when any of them asked for log-probabilities, theirs (None for the others)."""

    token_ids: list[int]
    logprobs: list[SampledLogprobs | None] | None = None
    # request id -> (the chunk's start position, one entry per prompt_logprob_targets)
    prompt_logprobs: dict[str, tuple[int, list[SampledLogprobs]]] | None = None
    # request id -> why choosing its token failed (its seed, NaN logits); its token_ids entry
    # is a placeholder and the engine fails that request alone
    errors: dict[str, str] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)
