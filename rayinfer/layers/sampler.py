"""Choose the next token of each row from its logits: greedy, or temperature, top-k, top-p and
min-p sampling with a per-request random generator (so a seeded request samples the same tokens
whatever else shares its batch)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayinfer.kernels.host_lists import device_ints

NO_TOKEN = -1  # the token of a row whose sampling failed
NO_TOKEN_LEFT = (
    "every token is masked: allowed_token_ids, bad_words, min_tokens and the grammar together "
    "leave none to sample"
)
FLOAT32_TINY = torch.finfo(torch.float32).tiny


class SampledRows(NamedTuple):
    token_ids: list[int]  # [B]; NO_TOKEN where the row failed
    errors: dict[int, str]  # row -> why its token could not be chosen


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32: penalized in place
    output_token_ids: list[list[int] | None],  # [B] generated tokens; None: no penalty
    presence: list[float],  # [B] OpenAI presence_penalty
    frequency: list[float],  # [B] OpenAI frequency_penalty
) -> None:
    """logits -= presence * (count > 0) + frequency * count, counts over the generated tokens.
    One count matrix for every penalized row (a handful of launches per step, not per row)."""
    rows = [row for row, generated in enumerate(output_token_ids) if generated]
    if not rows:
        return
    device, dtype = logits.device, logits.dtype
    flat = [token for row in rows for token in output_token_ids[row]]
    lengths = torch.tensor([len(output_token_ids[row]) for row in rows], device=device)
    which = torch.repeat_interleave(
        torch.arange(len(rows), device=device), lengths, output_size=len(flat)
    )  # [N]: the row of each token (output_size given: no device sync)
    ids = torch.tensor(flat, dtype=torch.int64, device=device)  # [N]
    counts = torch.zeros(len(rows), logits.shape[1], dtype=dtype, device=device)  # [R, V]
    counts.index_put_((which, ids), torch.ones_like(ids, dtype=dtype), accumulate=True)
    scale = torch.tensor([[presence[r], frequency[r]] for r in rows], dtype=dtype, device=device)
    penalty = scale[:, :1] * (counts > 0).to(dtype) + scale[:, 1:] * counts  # [R, V]
    index = torch.tensor(rows, device=device)
    logits.index_put_((index,), logits[index] - penalty)


def apply_repetition_penalty(
    logits: torch.Tensor,  # [B, V] float32: penalized in place
    prompt_ids: list[torch.Tensor | None],  # [B] each [P] int64 on logits' device, or None
    output_token_ids: list[list[int] | None],  # [B] generated tokens, or None
    penalties: list[float],  # [B] repetition_penalty; 1.0 is off
) -> None:
    """logit / p where logit > 0 else logit * p, for every token in the row's prompt or output
    (CTRL's rule). One seen-mask for every penalized row, filled by one scatter."""
    rows = [row for row, penalty in enumerate(penalties) if penalty != 1.0]
    if not rows:
        return
    device = logits.device
    arange = torch.arange(len(rows), device=device)
    prompts = [prompt_ids[row] for row in rows]
    outputs = [output_token_ids[row] or [] for row in rows]
    prompt_lengths = [0 if p is None else p.numel() for p in prompts]
    flat = [token for generated in outputs for token in generated]
    ids = torch.cat(
        [p for p in prompts if p is not None]
        + [torch.tensor(flat, dtype=torch.int64, device=device)]
    )  # [N]: every row's prompt ids, then every row's generated ids
    # the row of each id; output_size given: no device sync
    which = torch.cat([
        torch.repeat_interleave(arange, torch.tensor(prompt_lengths, device=device),
                                output_size=sum(prompt_lengths)),
        torch.repeat_interleave(arange, torch.tensor([len(g) for g in outputs], device=device),
                                output_size=len(flat)),
    ])  # fmt: skip
    seen = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=device)  # [R, V]
    seen[which, ids] = True
    index = torch.tensor(rows, device=device)
    chosen = logits[index]  # [R, V]
    scale = torch.tensor([penalties[r] for r in rows], dtype=logits.dtype, device=device)[:, None]
    penalized = torch.where(chosen > 0, chosen / scale, chosen * scale)
    logits.index_put_((index,), torch.where(seen, penalized, chosen))


def suppress_tokens(
    logits: torch.Tensor,  # [B, V] float32: masked in place
    token_ids: list[tuple[int, ...] | None],  # [B] tokens the row may not sample; None: none
) -> None:
    """logits[row, token] = -inf for every listed token (min_tokens' EOS and stop ids)."""
    pairs = [(row, token) for row, given in enumerate(token_ids) for token in given or ()]
    if not pairs:
        return
    rows, tokens = zip(*pairs)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))  # [N] each
    logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


def allow_only_tokens(
    logits: torch.Tensor,  # [B, V] float32: masked in place
    token_ids: list[torch.Tensor | None],  # [B] each [A] int64 on logits' device; None: any
) -> None:
    """logits[row, t] = -inf for every token t outside the row's list (vLLM's
    allowed_token_ids): one [R, V] mask for the listed rows, filled by one scatter, no host
    sync. Columns past the listed ids (a padded vocabulary) are masked too."""
    rows = [row for row, ids in enumerate(token_ids) if ids is not None]
    if not rows:
        return
    device = logits.device
    chosen = [token_ids[row] for row in rows]
    lengths = [ids.numel() for ids in chosen]
    which = torch.repeat_interleave(
        torch.arange(len(rows), device=device),
        device_ints(lengths, torch.int64, device),
        output_size=sum(lengths),
    )  # [N]: the mask row of each allowed id (output_size given: no device sync)
    banned = torch.ones(len(rows), logits.shape[1], dtype=torch.bool, device=device)  # [R, V]
    banned[which, torch.cat(chosen)] = False
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(banned, float("-inf"))
        return
    index = device_ints(rows, torch.int64, device)
    masked = logits.index_select(0, index).masked_fill_(banned, float("-inf"))  # [R, V]
    logits.index_copy_(0, index, masked)


def apply_logit_bias(
    logits: torch.Tensor,  # [B, V] float32: biased in place
    biases: list[tuple[tuple[int, float], ...]],  # [B] (token id, bias) pairs; () for none
) -> None:
    """logits[row, token] += bias for every pair, in one scatter for the whole batch."""
    pairs = [(row, token, bias) for row, given in enumerate(biases) for token, bias in given]
    if not pairs:
        return
    rows, tokens, values = zip(*pairs)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))  # [N] each
    logits.index_put_(
        index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True
    )


def apply_token_bitmask(
    logits: torch.Tensor,  # [B, V] float32: masked in place
    bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32, on the host: bit j of word w allows 32w + j
    rows: list[int],  # [R] the row of logits each bitmask row masks
) -> None:
    """logits[rows[r], t] = -inf where bitmask[r] forbids token t. The mask is copied to the
    logits' device without waiting (from page-locked memory on CUDA; the host refills it only
    after this step's tokens have come back, which waits for the copy) and unpacked there: no
    host sync of its own."""
    device, vocab = logits.device, logits.shape[1]
    mask = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((mask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [R, V]
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = device_ints(rows, torch.int64, device)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))  # [R, V]
    logits.index_copy_(0, index, masked)


def log_probabilities(
    logits: torch.Tensor,  # [B, V] float32, raw (before penalties and temperature)
    wanted: list[int | None],  # [B] alternatives each row wants; None: no log-probabilities
) -> tuple[torch.Tensor, list[int]] | None:
    """([R, V] float32 log-softmax of the rows that want log-probabilities, those rows), or None
    when no row does. Taken before penalties change the logits in place."""
    rows = [row for row, k in enumerate(wanted) if k is not None]
    if not rows:
        return None
    chosen = logits if len(rows) == logits.shape[0] else logits[rows]
    return torch.log_softmax(chosen.float(), dim=-1), rows


def gather_logprobs(
    log_probs: torch.Tensor,  # [R, V] from log_probabilities
    rows: list[int],  # [R] their rows in the batch
    token_ids: list[int],  # [B] the sampled tokens
    wanted: list[int | None],  # [B] as for log_probabilities
) -> list[tuple[float, list[int], list[float]] | None]:
    """[B] (log-probability of the sampled token, the k most likely ids, their log-probabilities)
    for the rows that want them, None for the others; one device-to-host copy."""
    device = log_probs.device
    ids = torch.tensor([token_ids[row] for row in rows], device=device)
    chosen = log_probs.gather(1, ids[:, None])[:, 0]  # [R]
    most = max(wanted[row] for row in rows)
    if most:
        top_values, top_ids = log_probs.topk(most, dim=-1)  # [R, most]
    else:
        top_values = top_ids = log_probs.new_empty(len(rows), 0)
    host = torch.cat([chosen[:, None], top_values, top_ids.to(log_probs.dtype)], dim=1).tolist()
    out: list[tuple[float, list[int], list[float]] | None] = [None] * len(token_ids)
    for index, row in enumerate(rows):
        k, values = wanted[row], host[index]
        out[row] = (values[0], [int(i) for i in values[1 + most : 1 + most + k]], values[1 : 1 + k])
    return out


def sample_tokens(
    logits: torch.Tensor,  # [B, V] float32
    temperatures: list[float],  # [B]; 0 is greedy
    top_ks: list[int],  # [B]; -1 is off
    top_ps: list[float],  # [B]; 1.0 is off
    generators: list[torch.Generator | None],  # [B]; CPU generators, None for greedy rows
    min_ps: list[float] | None = None,  # [B]; 0.0 is off; None: off for every row
) -> SampledRows:
    """The next token of each row. A row whose logits hold a NaN, whose every token is masked
    (-inf), or whose sampling raises, fails alone: the other rows' tokens are what they would be
    without it."""
    greedy = logits.argmax(dim=-1)  # [B]: every row, overwritten when sampling
    has_nan = logits.isnan().any(dim=-1)  # [B]
    none_left = logits.gather(1, greedy[:, None])[:, 0] == float("-inf")  # [B]: the best is -inf
    flags = torch.stack([greedy, has_nan.to(greedy.dtype), none_left.to(greedy.dtype)])
    tokens, nan_rows, empty_rows = flags.tolist()  # one copy
    errors = {row: "the model's logits hold NaN" for row, bad in enumerate(nan_rows) if bad}
    for row, empty in enumerate(empty_rows):
        if empty and row not in errors:
            errors[row] = NO_TOKEN_LEFT
    sampled_rows = [
        row
        for row, temperature in enumerate(temperatures)
        if temperature != 0 and row not in errors
    ]
    if sampled_rows:
        # One device-to-host copy for all sampled rows: the generators are per request, on the CPU.
        host_logits = logits[sampled_rows].float().cpu()  # [S, V]
        for host_row, row in enumerate(sampled_rows):
            try:
                tokens[row] = _sample_row(
                    host_logits[host_row], temperatures[row], top_ks[row], top_ps[row],
                    min_ps[row] if min_ps else 0.0, generators[row],
                )  # fmt: skip
            except RuntimeError as error:  # torch refuses the row's probabilities
                errors[row] = f"sampling failed: {error}"
    for row in errors:
        tokens[row] = NO_TOKEN
    return SampledRows(tokens, errors)


def _sample_row(
    logits: torch.Tensor,  # [V] float32, on the CPU
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    generator: torch.Generator | None,
) -> int:
    # Shifted so the largest is 0 before dividing (softmax is unchanged by the shift), and the
    # temperature kept above float32's smallest normal number: a tiny temperature (1e-300, 0 in
    # float32) then sends the other tokens to -inf instead of making 0/0 or inf - inf NaN.
    scaled = (logits - logits.max()) / max(temperature, FLOAT32_TINY)
    probs = _filtered_probs(scaled, top_k, top_p, min_p)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _filtered_probs(
    scaled: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """[V] scaled logits -> [V] probabilities with tokens outside top-k / top-p / min-p zeroed.
    min-p compares each probability with the most likely one's: a ratio that renormalizing
    after top-k / top-p leaves unchanged, so the set it keeps is that of the full softmax."""
    sorted_logits, order = scaled.sort(descending=True)  # [V], [V]
    if 0 < top_k < sorted_logits.numel():
        sorted_logits[top_k:] = float("-inf")
    sorted_probs = sorted_logits.softmax(dim=-1)
    if top_p < 1.0:
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [V]
        sorted_probs[mass_before >= top_p] = 0.0  # always keeps the most likely token
    if min_p > 0:
        sorted_probs[sorted_probs < min_p * sorted_probs[0]] = 0.0  # [0]: the most likely
    probs = torch.zeros_like(sorted_probs).scatter_(0, order, sorted_probs)
    return probs / probs.sum()
