"""Two-batch overlap: split a step's sequences into two micro-batches and interleave them layer by
layer so that one micro-batch's all-to-all (MoE dispatch or combine) runs while the other computes
(the DeepSeek / SGLang scheme). Per MoE layer that exchanges tokens:

    attention(A)  dispatch(A) ->            attention(B)  dispatch(B) ->
    experts(A)    combine(A) ->             experts(B)    combine(B) ->
    shared experts(A), wait combine(A)      shared experts(B), wait combine(B)

The step's tokens are halved; a sequence cut by the half becomes two chunks, the second reading the
first's KV from the cache (micro-batch A always runs a layer's attention before B does). Every rank
runs the same sequence of collectives, even with an empty micro-batch. Works for any
model whose body is `embed_tokens`, `layers` (input_layernorm, self_attn,
post_attention_layernorm, mlp) and `norm`: the DeepSeek and Llama-derived families.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayinfer.layers.forward_context import (
    ForwardContext,
    idle_forward_inputs,
    split_forward_context,
)


@dataclass
class MicroBatch:
    positions: torch.Tensor  # [t]
    ctx: ForwardContext
    hidden: torch.Tensor  # [t, H]
    residual: torch.Tensor | None = None


def supports_two_batch_overlap(model) -> bool:
    body = getattr(model, "model", None)
    return all(hasattr(body, name) for name in ("embed_tokens", "layers", "norm"))


def forward_two_batch_overlap(model, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
    """input_ids [T], positions [T] -> hidden [T, H], the same as `model(input_ids, ...)`."""
    body = model.model
    num_first = input_ids.shape[0] // 2  # a long prefill is cut in two chunks, see the split
    first_ctx, second_ctx = split_forward_context(ctx, num_first)
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
    batches = [MicroBatch(pos, part_ctx, body.embed_tokens(ids)) for ids, pos, part_ctx in parts]
    for layer in body.layers:
        if getattr(layer.mlp, "exchanges_tokens", False):
            _overlapped_layer(layer, batches)
        else:
            for batch in batches:
                batch.hidden, batch.residual = layer(
                    batch.positions, batch.hidden, batch.residual, batch.ctx
                )
    outputs = [
        body.norm(batch.hidden, batch.residual)[0][: 0 if idle else None]
        for batch, idle in zip(batches, is_idle)
    ]
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


def _overlapped_layer(layer, batches: list[MicroBatch]) -> None:
    moe = layer.mlp
    moe_inputs, dispatches = [], []
    for batch in batches:  # attention of B runs while A's tokens travel
        moe_inputs.append(_attention_half(layer, batch))
        dispatches.append(moe.start_dispatch(moe_inputs[-1]))
    combines = [moe.start_combine(pending) for pending in dispatches]  # experts(B) || combine(A)
    for batch, moe_input, pending in zip(batches, moe_inputs, combines):
        batch.hidden = moe.finish(moe_input, pending)
