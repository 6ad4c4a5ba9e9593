"""Log-probabilities a step returns: of the sampled tokens (with the top alternatives where asked)
and of the prompt tokens that a prefill chunk's rows predict."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rayinfer.engine.batch import SampledLogprobs, ScheduledRequest
from rayinfer.layers.sampler import gather_logprobs


def sampled_logprobs(
    raw: tuple, token_ids: list[int], wanted: list[int | None]
) -> list[SampledLogprobs | None]:
    """Per sampling row, its token's log-probability and the `wanted` top alternatives (None
    where not asked); raw: `log_probabilities` of the logits before penalties and masks."""
    picked = gather_logprobs(*raw, [max(t, 0) for t in token_ids], wanted)  # NO_TOKEN: any id
    return [None if entry is None else SampledLogprobs(*entry) for entry in picked]


def prompt_logprobs(
    hidden: torch.Tensor,
    requests: list[ScheduledRequest],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    rows_at_once: int = 256,
) -> dict[str, tuple[int, list[SampledLogprobs]]] | None:
    """Log-probabilities of the prompt tokens that this step's prefill rows predict, for the
    requests that asked (hidden [T, H] in batch order), by request id: (the position of the
    first, one entry per token). Logits are made `rows_at_once` rows at a time: a whole chunk's
    [T, V] float32 would be gigabytes at large vocabularies."""
    if not any(r.prompt_logprob_targets for r in requests):
        return None
    found, first_row = {}, 0
    for request in requests:
        targets = request.prompt_logprob_targets
        if targets:
            k = request.params.prompt_logprobs
            entries = []
            for start in range(0, len(targets), rows_at_once):
                part = targets[start : start + rows_at_once]
                rows = hidden[first_row + start : first_row + start + len(part)]
                log_probs = torch.log_softmax(compute_logits(rows).float(), -1)
                picked = gather_logprobs(log_probs, list(range(len(part))), part,
                                         [k] * len(part))  # fmt: skip
                entries += [SampledLogprobs(*entry) for entry in picked]
            found[request.request_id] = (request.start_position, entries)
        first_row += len(request.token_ids)
    return found
