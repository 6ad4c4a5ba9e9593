"""The sampling state of one runner's requests, and a step's logits turned into their tokens.

Each request that samples at a temperature above 0 keeps its own torch.Generator (seeded from
`SamplingParams.seed`, else from the OS), so that a seeded request samples the same tokens
whatever else shares its batch; its state travels with the KV hand-off. Structured-output
requests keep a grammar matcher (grammar_matchers.py) whose masks limit their logits.
Requests with a repetition_penalty keep their prompt's distinct token ids on the logits' device,
received once (ScheduledRequest.prompt_token_ids, the first time the request samples on this
runner: after a hand-off, the decode runner's first step); the generated tokens come with every
step, as for presence and frequency penalties. Requests with allowed_token_ids keep those ids on
the logits' device, made from their params the first time they sample here (every step's
request carries its params: a worker fills in those its group sent once, workers/worker.py).
bad_words need nothing here: the engine sends the tokens each step may not sample
(ScheduledRequest.suppressed_token_ids).

Logits pass, in vLLM's order: grammar mask, allowed_token_ids, the suppressed tokens (bad_words'
and min_tokens'), logit_bias, the repetition penalty, presence/frequency penalties, then
temperature and top-k/top-p/min-p. Each stage is skipped when no row of the step uses it. A row
that these masks leave no token fails alone (layers/sampler.py).

Under tensor parallelism every rank of a replica samples the same rows, but only the first
rank's tokens are returned (workers/group.py), and an unseeded request's generator is seeded by
each rank's OS, so the ranks' own draws differ. That is harmless except for grammar matchers,
whose state is the tokens they accepted: in a step that holds a grammar, the ranks therefore all
take the first rank's tokens (one all-gather of B ids over the TP group) before any matcher
advances, so every rank's matchers, masks and returned tokens are the replica's.
"""

from __future__ import annotations

import torch

from rayinfer.config import ModelConfig
from rayinfer.engine.batch import ScheduledRequest
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.kernels.host_lists import device_ints
from rayinfer.layers.parallel import LayerGroup
from rayinfer.layers.sampler import (
    NO_TOKEN,
    SampledRows,
    allow_only_tokens,
    apply_logit_bias,
    apply_penalties,
    apply_repetition_penalty,
    apply_token_bitmask,
    sample_tokens,
    suppress_tokens,
)
from rayinfer.workers.runner.grammar_matchers import GrammarMasks, GrammarMatchers


class RequestSampler:
    def __init__(
        self,
        model_config: ModelConfig,
        pin: bool,
        tp_group: LayerGroup | None = None,
        device: torch.device | None = None,
    ):
        """pin: page-locked host grammar masks (on CUDA); tp_group: the replica's tensor-
        parallel group (None or size 1: this rank samples alone), whose collectives run on
        `device`."""
        self.generators: dict[str, torch.Generator] = {}
        self.prompt_ids: dict[str, torch.Tensor] = {}  # [P] int64: a prompt's distinct ids
        self.allowed_ids: dict[str, torch.Tensor] = {}  # [A] int64: allowed_token_ids
        self.tp_group = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.device = device or torch.device("cpu")
        self.grammars = GrammarMatchers(
            model_config.path, model_config.vocab_size, model_config.eos_token_ids, pin=pin
        )

    def masks(self, sampling: list[ScheduledRequest]) -> GrammarMasks | None:
        """The grammar masks of the step's sampling requests; None when none has a grammar.
        Called after the forward is queued: on a GPU the host fills them while it runs."""
        return self.grammars.masks(sampling) if GrammarMatchers.needed(sampling) else None

    def sample(
        self, logits: torch.Tensor, sampling: list[ScheduledRequest], masks: GrammarMasks | None
    ) -> SampledRows:
        """[B, V] logits (penalized and masked in place) -> the next token of each sampling
        request. A request whose generator cannot be made (its seed), whose grammar cannot be
        used or whose row cannot be sampled fails alone (`errors`, by row); the others sample as
        they would without it."""
        if masks is not None:
            apply_token_bitmask(logits, masks.bitmask, masks.rows)
        if any(r.params.allowed_token_ids for r in sampling):
            allow_only_tokens(logits, [self.allowed(r, logits.device) for r in sampling])
        if any(r.suppressed_token_ids for r in sampling):
            suppress_tokens(logits, [r.suppressed_token_ids for r in sampling])
        if any(r.params.logit_bias for r in sampling):
            apply_logit_bias(logits, [r.params.logit_bias for r in sampling])
        if any(r.output_token_ids is not None for r in sampling):
            self.penalize(logits, sampling)
        generators, setup_errors = [], {}
        for row, request in enumerate(sampling):
            try:
                generators.append(self.generator(request.request_id, request.params))
            except (RuntimeError, ValueError, OverflowError) as error:  # torch refused the seed
                generators.append(None)
                setup_errors[row] = f"seed={request.params.seed!r}: {error}"
        temperatures = [0 if row in setup_errors else r.params.temperature
                        for row, r in enumerate(sampling)]  # fmt: skip
        min_ps = [r.params.min_p for r in sampling]
        rows = sample_tokens(
            logits,
            temperatures,
            [r.params.top_k for r in sampling],
            [r.params.top_p for r in sampling],
            generators,
            min_ps if any(min_ps) else None,
        )
        if masks is not None:
            setup_errors.update(masks.errors)
        for row in setup_errors:
            rows.token_ids[row] = NO_TOKEN
        errors = {**rows.errors, **setup_errors}
        token_ids = rows.token_ids
        if masks is not None:
            token_ids = self.first_rank_tokens(token_ids)
            errors.update(self.grammars.accept(sampling, masks, token_ids))
        return SampledRows(token_ids, errors)

    def allowed(self, request: ScheduledRequest, device: torch.device) -> torch.Tensor | None:
        """[A] the request's allowed_token_ids on `device`, kept until it is freed; None: any."""
        ids = request.params.allowed_token_ids
        if ids is None:
            return None
        if request.request_id not in self.allowed_ids:
            self.allowed_ids[request.request_id] = device_ints(ids, torch.int64, device)
        return self.allowed_ids[request.request_id]

    def penalize(self, logits: torch.Tensor, sampling: list[ScheduledRequest]) -> None:
        """[B, V] logits: the repetition penalty, then presence and frequency penalties, on the
        rows that carry their generated tokens (ScheduledRequest.output_token_ids)."""
        for r in sampling:
            if r.prompt_token_ids is not None:
                ids = torch.tensor(r.prompt_token_ids, dtype=torch.int64).unique()
                self.prompt_ids[r.request_id] = ids.to(logits.device)
        if any(r.params.repetition_penalty != 1 for r in sampling):
            apply_repetition_penalty(
                logits,
                [self.prompt_ids.get(r.request_id) for r in sampling],
                [r.output_token_ids for r in sampling],
                [r.params.repetition_penalty for r in sampling],
            )
        if any(r.params.has_additive_penalties and r.output_token_ids for r in sampling):
            apply_penalties(
                logits,
                [r.output_token_ids if r.params.has_additive_penalties else None
                 for r in sampling],
                [r.params.presence_penalty for r in sampling],
                [r.params.frequency_penalty for r in sampling],
            )  # fmt: skip

    def first_rank_tokens(self, token_ids: list[int]) -> list[int]:
        """[B] the tokens the TP group's first rank sampled (this rank's own without a group).
        Every rank of the group must call it in the same step: a step holds a grammar on all of
        them or on none, since they sample the same requests."""
        if self.tp_group is None:
            return token_ids
        mine = torch.tensor(token_ids, dtype=torch.int64, device=self.device)  # [B]
        every = self.tp_group.all_gather_concat(mine, 0)  # [tp * B], rank order
        return every[: len(token_ids)].tolist()

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        """The request's generator, made at its first sampled token; None when greedy."""
        if params.is_greedy:
            return None
        if request_id not in self.generators:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
            self.generators[request_id] = generator
        return self.generators[request_id]

    def generator_state(self, request_id: str) -> torch.Tensor | None:
        """uint8 state of the request's generator, for the hand-off; None when it has none."""
        generator = self.generators.get(request_id)
        return generator.get_state() if generator is not None else None

    def restore_generator(self, request_id: str, state: torch.Tensor) -> None:
        """Continue a handed-off request's sampling from the state its prefill exported."""
        generator = torch.Generator()
        generator.set_state(state)
        self.generators[request_id] = generator

    def free(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)
            self.prompt_ids.pop(request_id, None)
            self.allowed_ids.pop(request_id, None)
        self.grammars.free(request_ids)
