"""Two-batch overlap: split a step's sequences into two micro-batches and interleave them layer by
layer so that one micro-batch's all-to-all (MoE dispatch or combine) runs while the other computes
(the DeepSeek / SGLang scheme). Each micro-batch queues its work on its own CUDA stream (a lane);
the exchanges run on the transport's streams and hold up only the lane that waits for them. Per
MoE layer that exchanges tokens, the host queues

    lane A: attention(A)  dispatch(A)                experts(A) combine(A)   + shared(A)
    lane B:               attention(B)  dispatch(B)             experts(B) combine(B) + shared(B)

(each lane's shared experts start on a side stream of the lane once its dispatch has packed the
rows to send).

Each lane exchanges on its own channel of the transport (host-staged: its own copy streams,
slots and flags), and both lanes' dispatches are queued before either combine (NCCL runs all
channels on one stream, first in, first out). Where dispatch must read the routed counts
(deduplicated dispatch: a sync of its own lane only), the GPU goes on with the other lane's
queued work: attention(B) under the exchange of A, experts(A) under the exchange of B,
combine(A) under experts(B), combine(B) under the next layer's attention(A). With the
all-tokens dispatch (every rank's micro-batch sizes known from the step's, see
OverlapConfig.micro_batch_sizes) nothing waits for the device and the host queues ahead.

The step's tokens are split at OverlapConfig.first_share (a half by default); a sequence cut
there becomes two chunks, the second reading the
first's KV from the cache (lane B waits for lane A's attention of the same layer). Every rank
runs the same sequence of collectives, even with an empty micro-batch. On CPU the lanes are one
and the same (the order of the work is unchanged, so CI checks it). Works for any
model whose body is `embed_tokens`, `layers` (input_layernorm, self_attn,
post_attention_layernorm, mlp) and `norm`: the DeepSeek and Llama-derived families.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from rayinfer.layers.forward_context import (
    ForwardContext,
    idle_forward_inputs,
    split_forward_context,
)
from rayinfer.overlap_config import DEFAULT_OVERLAP, OverlapConfig


@dataclass
class MicroBatch:
    positions: torch.Tensor  # [t]
    ctx: ForwardContext
    hidden: torch.Tensor  # [t, H]
    residual: torch.Tensor | None = None


# On CUDA two lanes cost the host about twice the launches of one: with fewer tokens per rank
# than this the GPU runs out of queued work. `bench parallel --overlap off on` on 2x H200,
# DeepSeek-V2-Lite shapes, dp=2 ep=2 host-staged FP8, transformers' rate per GPU, overlap off
# against on: 8k tokens per rank 1.35x against 0.71x, 12k 1.37x against 1.47x, two 16k prompts
# 1.40x against 1.56x (benchmarks/RESULTS.md, prefill thresholds). Every rank decides from the
# same counts.
MIN_TOKENS_TO_OVERLAP_ON_CUDA = 12288


def worth_overlapping(tokens_per_rank: list[int], device: torch.device) -> bool:
    """Whether a step with these token counts (every rank's that shares its collectives) runs
    as two micro-batches; on CPU always (the lanes there exist to check the logic)."""
    return device.type != "cuda" or max(tokens_per_rank) >= MIN_TOKENS_TO_OVERLAP_ON_CUDA


def supports_two_batch_overlap(model) -> bool:
    body = getattr(model, "model", None)
    return all(hasattr(body, name) for name in ("embed_tokens", "layers", "norm"))


class Lane:
    """A CUDA stream for one micro-batch (on CPU: the current thread, no stream)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def active(self):
        return torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()

    def wait_for(self, other: Lane | None = None) -> None:
        """Work queued on this lane from now on waits for what `other` (default: the current
        stream) has queued so far."""
        if self.stream is not None:
            self.stream.wait_stream(other.stream if other else torch.cuda.current_stream())

    def join(self) -> None:
        """The current stream waits for this lane."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)


_lanes: dict[torch.device, tuple[Lane, Lane]] = {}


def lanes_for(device: torch.device) -> tuple[Lane, Lane]:
    if device not in _lanes:
        _lanes[device] = (Lane(device), Lane(device))
    return _lanes[device]


def forward_two_batch_overlap(
    model, input_ids, positions, ctx: ForwardContext, overlap: OverlapConfig = DEFAULT_OVERLAP
) -> torch.Tensor:
    """input_ids [T], positions [T] -> hidden [T, H], the same as `model(input_ids, ...)`."""
    body = model.model
    num_first = overlap.first_micro_batch_tokens(input_ids.shape[0])  # may cut a prompt
    first_ctx, second_ctx = ctx.micro_batches or split_forward_context(ctx, num_first)
    parts = [
        (input_ids[:num_first], positions[:num_first], first_ctx),
        (input_ids[num_first:], positions[num_first:], second_ctx),
    ]
    # An empty micro-batch computes one placeholder token so that it joins every exchange.
    is_idle = [part_ctx.attn.num_seqs == 0 for _, _, part_ctx in parts]
    parts = [
        idle_forward_inputs(part_ctx, input_ids.device) if idle else (ids, pos, part_ctx)
        for (ids, pos, part_ctx), idle in zip(parts, is_idle)
    ]
    sizes = overlap.micro_batch_sizes(input_ids.shape[0])
    if tuple(ids.shape[0] for ids, _, _ in parts) != sizes:
        raise RuntimeError(f"micro-batch split of {input_ids.shape[0]} tokens broke its rule")
    lanes = lanes_for(input_ids.device)
    batches = []
    for lane, (ids, pos, part_ctx) in zip(lanes, parts):
        lane.wait_for()
        with lane.active():
            batches.append(MicroBatch(pos, part_ctx, body.embed_tokens(ids)))
    for layer in body.layers:
        if getattr(layer.mlp, "exchanges_tokens", False):
            _overlapped_layer(layer, batches, lanes, overlap)
        else:
            _sequential_layer(layer, batches, lanes)
    outputs = []
    for batch, idle, lane in zip(batches, is_idle, lanes):
        with lane.active():
            outputs.append(body.norm(batch.hidden, batch.residual)[0][: 0 if idle else None])
        lane.join()
    return torch.cat(outputs)


def _attention_half(layer, batch: MicroBatch) -> torch.Tensor:
    """Norm, attention and the post-attention norm; returns the MoE input [t, H]."""
    if batch.residual is None:
        batch.residual, hidden = batch.hidden, layer.input_layernorm(batch.hidden)
    else:
        hidden, batch.residual = layer.input_layernorm(batch.hidden, batch.residual)
    hidden = layer.self_attn(batch.positions, hidden, batch.ctx)
    hidden, batch.residual = layer.post_attention_layernorm(hidden, batch.residual)
    return hidden


def _sequential_layer(layer, batches: list[MicroBatch], lanes) -> None:
    for i, (batch, lane) in enumerate(zip(batches, lanes)):
        if i:  # B may read the KV that A's attention wrote
            lane.wait_for(lanes[0])
        with lane.active():
            batch.hidden, batch.residual = layer(
                batch.positions, batch.hidden, batch.residual, batch.ctx
            )


def _overlapped_layer(layer, batches: list[MicroBatch], lanes, overlap: OverlapConfig) -> None:
    moe = layer.mlp
    moe_inputs = []
    for i, (batch, lane) in enumerate(zip(batches, lanes)):
        if i:  # B may read the KV that A's attention wrote
            lane.wait_for(lanes[0])
        with lane.active():
            moe_inputs.append(_attention_half(layer, batch))
    # Each lane exchanges on its own channel (the host transport's copy streams run first in,
    # first out: on one pipeline B's dispatch waited behind A's combine, which waits for A's
    # experts), and both dispatches are queued before either combine (NCCL has one stream).
    step_tokens = moe.parallel.ep_group.tokens_per_rank  # every EP rank's T, when known
    received = []
    beside_combine = overlap.shared_experts_beside_combine
    for i, (moe_input, lane) in enumerate(zip(moe_inputs, lanes)):  # A's under B's attention
        tokens = None
        if step_tokens is not None:
            tokens = [overlap.micro_batch_sizes(t)[i] for t in step_tokens]
        with lane.active():  # the shared experts start beside the lane's dispatch or combine
            received.append(
                moe.dispatch_tokens(
                    moe_input, tokens, channel=i, shared_beside_dispatch=not beside_combine[i]
                )
            )
    for i, (arrived, batch, lane) in enumerate(zip(received, batches, lanes)):
        with lane.active():  # A's combine under B's experts
            batch.hidden = moe.experts_and_combine(arrived, channel=i)
