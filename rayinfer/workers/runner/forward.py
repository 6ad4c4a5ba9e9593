"""A step's tokens through the model on one rank: eagerly from the scheduled requests, as the
forward a CUDA graph captures, or as a placeholder that only joins the group's collectives.

Where experts exchange tokens between ranks, every rank's token count is known before any work is
queued (sent with the step, or gathered once here), so that no MoE layer waits for the device to
size its exchange; two-batch overlap splits the step into two micro-batches whose exchange and
compute overlap, where that pays (layers/two_batch_overlap.py).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate, chain

import numpy as np
import torch
from torch import nn

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.kernels.host_lists import device_ints
from rayinfer.layers.forward_context import (
    ForwardContext,
    build_attention_metadata,
    idle_forward_inputs,
    token_positions,
)
from rayinfer.layers.parallel import ParallelContext
from rayinfer.layers.two_batch_overlap import forward_two_batch_overlap, worth_overlapping
from rayinfer.overlap_config import OverlapConfig
from rayinfer.workers.runner.step_timeline import StepTimeline


class StepForward:
    def __init__(
        self,
        model: nn.Module,
        parallel: ParallelContext,
        device: torch.device,
        block_size: int,
        two_batch_overlap: bool,
        overlap: OverlapConfig,
        windowed: bool = False,
    ):
        """windowed: the model keeps a window pool (requests carry window tables)."""
        self.model = model
        self.windowed = windowed
        self.parallel = parallel
        self.device = device
        self.block_size = block_size
        self.two_batch_overlap = two_batch_overlap
        self.overlap = overlap

    def eager(
        self,
        requests: list[ScheduledRequest],
        kv_caches: list[torch.Tensor],
        ep_tokens: list[int] | None,
        timeline: StepTimeline,
        on_layer_cached: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Hidden states [T, H] of the step's tokens and the row of each sampling request's last
        token. ep_tokens: every EP rank's token count, when known. timeline: the step's, marked
        as its inputs and forward are queued. on_layer_cached: ForwardContext's."""
        query_lens = [len(r.token_ids) for r in requests]
        seq_lens = [r.seq_len for r in requests]
        positions = token_positions(query_lens, seq_lens)  # [T] int64, numpy
        metadata = build_attention_metadata(
            query_lens,
            seq_lens,
            [r.block_table for r in requests],
            self.block_size,
            self.device,
            positions,
            [r.window_table for r in requests] if self.windowed else None,
        )
        ctx = ForwardContext(attn=metadata, kv_caches=kv_caches, on_layer_cached=on_layer_cached)
        tokens = chain.from_iterable(r.token_ids for r in requests)
        input_ids = np.fromiter(tokens, dtype=np.int64, count=positions.shape[0])
        input_ids = device_ints(torch.from_numpy(input_ids), torch.int64, self.device)
        positions = device_ints(torch.from_numpy(positions), torch.int64, self.device)
        timeline.mark("inputs_ready")
        hidden = self(input_ids, positions, ctx, ep_tokens)  # [T, H]
        timeline.mark("queued")
        ends = accumulate(len(r.token_ids) for r in requests)  # on the host: no device sync
        return hidden, [end - 1 for r, end in zip(requests, ends) if r.samples]

    def idle(self, kv_caches: list[torch.Tensor], ep_tokens: list[int] | None = None) -> None:
        """A rank with no requests this step still joins its peers' collectives (DP replicas
        whose experts exchange tokens), with one placeholder token that writes no cache."""
        if not self.parallel.has_collectives:
            return
        windows = [] if self.windowed else None
        empty = build_attention_metadata(
            [], [], [], self.block_size, self.device, window_tables=windows
        )
        input_ids, positions, ctx = idle_forward_inputs(
            ForwardContext(empty, kv_caches), self.device
        )
        self(input_ids, positions, ctx, ep_tokens)

    def __call__(self, input_ids, positions, ctx, ep_tokens=None) -> torch.Tensor:
        if self.parallel.experts_exchange_tokens:
            group = self.parallel.ep_group
            with group.tokens_of_step(input_ids.shape[0], self.device, known=ep_tokens):
                return self._run_model(input_ids, positions, ctx)
        return self._run_model(input_ids, positions, ctx)

    def in_graph(self, input_ids, positions, ctx) -> torch.Tensor:
        """The forward a graph captures (and runs on the CPU): with a token exchange,
        every rank holds the bucket's tokens and the exchange takes replayable options."""
        if not self.parallel.experts_exchange_tokens:
            return self.model(input_ids, positions, ctx)
        with self.parallel.ep_group.static_exchange(input_ids.shape[0]):
            if self._overlaps_in_graph(input_ids.shape[0], ctx):
                return forward_two_batch_overlap(
                    self.model, input_ids, positions, ctx, self.overlap
                )
            return self.model(input_ids, positions, ctx)

    def _overlaps_in_graph(self, num_tokens: int, ctx: ForwardContext) -> bool:
        """A captured prefill runs as two micro-batches where its inputs hold the halves."""
        has_halves = ctx.micro_batches is not None
        return self.two_batch_overlap and has_halves and self.overlap.overlaps_in_graph(num_tokens)

    def _run_model(self, input_ids, positions, ctx) -> torch.Tensor:
        if self.two_batch_overlap:
            ep_group = self.parallel.ep_group
            tokens = getattr(ep_group, "tokens_per_rank", None) or [input_ids.shape[0]]
            if worth_overlapping(tokens, self.device):
                return forward_two_batch_overlap(
                    self.model, input_ids, positions, ctx, self.overlap
                )
        return self.model(input_ids, positions, ctx)
