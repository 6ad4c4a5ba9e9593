"""Mixed steps (decodes beside prompt chunks, several prompts, a chunk over a cached prefix)
through CUDA graphs captured in pieces: per token-count bucket, the forward's work between two
layers' attentions is one graph, and the attentions run eagerly between the replays over the
step's own metadata (layers/graph_pieces.py).

Such a step queues ~1,000 kernels eagerly, about 65 ms of host time on the GPU machine for a
DeepSeek-V2-Lite-shaped model, whatever its token count: a step of 16 decodes and a 512-token
chunk, which the GPU runs in ~9 ms, is host-bound 7 times over, so chunked prefill beside decodes
(what keeps a colocated server's time per output token low) costs more than it saves. In pieces,
the host queues one graph and one attention per layer.

The static inputs hold the step's tokens first, then the bucket's padding: token 0 at position 0,
slot -1 (no cache write), zero attention output. Everything captured takes its shape from the
bucket alone (MoE sorts into its worst-case padded size and reads the real row count on the
device). Only a forward without collectives is captured in pieces (one GPU per replica): with
collectives every rank would have to replay the same bucket. On the CPU nothing is captured:
`run` runs the forward eagerly over the same padded inputs with the same staging, so padding,
staging and slicing are tested there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.layers.forward_context import (
    AttentionMetadata,
    ForwardContext,
    build_attention_metadata,
    cache_slots,
    token_positions,
)
from rayinfer.layers.graph_pieces import CapturedPieces, EagerPieces, StagingBuffers
from rayinfer.workers.runner.decode_inputs import PAD_SLOT, PAD_TOKEN
from rayinfer.workers.runner.graph_buckets import bucket_for
from rayinfer.workers.runner.graph_capture import WARMUP_RUNS

logger = logging.getLogger(__name__)

SMALLEST_BUCKET = 32


def piecewise_graph_sizes(max_tokens: int) -> list[int]:
    """Ascending token buckets up to max_tokens: 32, 64, 128, 256, then steps of at most 1.5x
    (384, 512, 768, 1024, ...) and max_tokens itself; [] for 0."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens={max_tokens} must be >= 0")
    if max_tokens == 0:
        return []
    candidates, size = [], SMALLEST_BUCKET
    while size < 256:
        candidates.append(size)
        size *= 2
    while size < max_tokens:
        candidates += [size, size * 3 // 2]
        size *= 2
    return [s for s in candidates if s < max_tokens] + [max_tokens]


class StaticStepInputs:
    """Device buffers for up to max_tokens tokens, refilled every step: token ids, positions
    and cache slots (int64 [3, T]), one host-to-device copy from a pinned twin."""

    def __init__(self, max_tokens: int, block_size: int, kv_caches, device: torch.device):
        self.max_tokens, self.block_size = max_tokens, block_size
        self.kv_caches, self.device = kv_caches, device
        pin = device.type == "cuda"
        self.host_tokens = torch.zeros(3, max_tokens, dtype=torch.int64, pin_memory=pin)
        self.tokens = torch.zeros(3, max_tokens, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None
        self._arguments: dict[int, tuple] = {}  # bucket -> the captured forward's arguments

    def fill(self, requests: list[ScheduledRequest], bucket: int) -> tuple[tuple, ForwardContext]:
        """(the captured forward's arguments over the bucket, the step's own context): the
        requests' tokens in the first rows, padding after."""
        if self._copied is not None:
            self._copied.synchronize()  # the pinned twin is free again
        query_lens = [len(r.token_ids) for r in requests]
        seq_lens = [r.seq_len for r in requests]
        tables = [r.block_table for r in requests]
        num_tokens = sum(query_lens)
        if not num_tokens <= bucket <= self.max_tokens:
            raise ValueError(f"{num_tokens} tokens in a bucket of {bucket} ({self.max_tokens})")
        host = self.host_tokens.numpy()  # [3, T]: ids, positions, slots
        host[0, num_tokens:bucket], host[1, num_tokens:bucket] = PAD_TOKEN, 0
        host[2, num_tokens:bucket] = PAD_SLOT
        positions = token_positions(query_lens, seq_lens) if requests else np.zeros(0, np.int64)
        slots = cache_slots(positions, query_lens, tables, self.block_size)
        if requests:
            host[0, :num_tokens] = np.fromiter(
                (t for r in requests for t in r.token_ids), dtype=np.int64, count=num_tokens
            )
            host[1, :num_tokens], host[2, :num_tokens] = positions, slots
        is_cuda = self.device.type == "cuda"
        self.tokens.copy_(self.host_tokens, non_blocking=is_cuda)  # whole rows: one dense copy
        if is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        step = build_attention_metadata(
            query_lens, seq_lens, tables, self.block_size, self.device, positions, slots=slots
        )
        return self.arguments(bucket), ForwardContext(step, self.kv_caches)

    def arguments(self, bucket: int) -> tuple:
        """input_ids [b], positions [b] and a context whose only field the pieces read is the
        slot mapping [b]; the rest describes the bucket as one sequence of new tokens (what
        warm-up attends over). Made once per bucket."""
        if bucket in self._arguments:
            return self._arguments[bucket]
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=self.tokens[2, :bucket],
            query_start_loc=torch.tensor([0, bucket], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([bucket], dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            query_lens_cpu=[bucket],
            seq_lens_cpu=[bucket],
            block_size=self.block_size,
        )
        ctx = ForwardContext(metadata, self.kv_caches)
        arguments = self._arguments[bucket] = (
            self.tokens[0, :bucket],
            self.tokens[1, :bucket],
            ctx,
        )
        return arguments


class PiecewiseGraphs:
    """One chain of pieces per token bucket, captured largest first into one memory pool."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],  # input_ids [T], positions [T], ctx -> [T, H]
        kv_caches: list[torch.Tensor],
        max_tokens: int,
        block_size: int,
        device: torch.device,
    ):
        self.forward, self.device = forward, device
        self.sizes = piecewise_graph_sizes(max_tokens)
        self.inputs = StaticStepInputs(self.sizes[-1], block_size, kv_caches, device)
        self.staging = StagingBuffers(self.sizes[-1], device)
        # bucket -> its pieces and the last piece's output [bucket, H]
        self.pieces: dict[int, tuple[CapturedPieces, torch.Tensor]] = {}
        self.enabled = True  # False: the runner takes its eager path (benchmarks compare both)
        self.capture_seconds = 0.0

    def bucket_of(self, requests: list[ScheduledRequest]) -> int | None:
        """The bucket a step of these requests runs in, or None (too many tokens, none at
        all, or the graphs switched off)."""
        num_tokens = sum(len(r.token_ids) for r in requests)
        if not self.enabled or not 0 < num_tokens <= self.sizes[-1]:
            return None
        return bucket_for(num_tokens, self.sizes)

    @torch.inference_mode()
    def capture(self) -> None:
        """Per bucket, largest first: the forward eagerly over padding (Triton compiles, cuBLAS
        picks), then captured in pieces. CUDA only."""
        if self.device.type != "cuda":
            return
        start, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in sorted(self.sizes, reverse=True):
            (input_ids, positions, ctx), _ = self.inputs.fill([], bucket)
            for _ in range(WARMUP_RUNS):
                ctx.pieces = EagerPieces(self.staging, ctx, bucket)
                self.forward(input_ids, positions, ctx)
            torch.cuda.synchronize(self.device)
            pieces = CapturedPieces(self.staging, pool)
            ctx.pieces = pieces
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                pieces.begin()
                output = self.forward(input_ids, positions, ctx)
                pieces.end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.pieces[bucket] = (pieces, output)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d piecewise CUDA graphs of %d pieces (buckets %s) in %.1f s",
            len(self.sizes), len(pieces.graphs), self.sizes, self.capture_seconds,
        )  # fmt: skip

    def run(
        self,
        requests: list[ScheduledRequest],
        bucket: int,
        on_layer_cached: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [n, H] of the step's n tokens; valid until the next `run` (a view of
        the last piece's static output on CUDA). on_layer_cached: told at each layer's cut
        (ForwardContext's)."""
        (input_ids, positions, ctx), step_ctx = self.inputs.fill(requests, bucket)
        step_ctx.on_layer_cached = on_layer_cached
        num_tokens = sum(step_ctx.attn.query_lens_cpu)
        captured = self.pieces.get(bucket)
        if captured is None:  # the CPU, or before capture
            ctx.pieces = EagerPieces(self.staging, step_ctx, num_tokens)
            return self.forward(input_ids, positions, ctx)[:num_tokens]
        pieces, output = captured
        pieces.replay(step_ctx, num_tokens)
        return output[:num_tokens]
