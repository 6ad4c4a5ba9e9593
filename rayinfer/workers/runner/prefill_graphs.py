"""New prompts prefilled through CUDA graphs: one graph per token-count bucket, captured at start.

A prefill step's host work is the same at any length: ~1,000 kernels for a DeepSeek-V2-Lite-shaped
model, each queued by Python (Triton's launcher, cuBLAS's), about 65 ms on the GPU machine's host.
At 4k tokens the GPU runs the step in less than that, so eagerly the step is host-bound, and with
experts exchanging tokens across GPUs each rank also waits for its peer's host. A graph queues the
whole forward at once.

What a graph can run: one new prompt per rank (a data-parallel replica's share: nothing cached
before it, no prompt log-probabilities), padded at its end to the bucket. Causal attention keeps
the real rows exact: no real token attends to a later one, so the padding changes nothing they
compute. Padding rows are token 0 at the positions past the prompt; they write no cache slot (-1)
and read block 0 past the prompt's own blocks. Everything shape-bearing is the bucket's: one
sequence of `bucket` tokens (the attention's bounds are device constants per bucket), every token
to every expert-parallel rank (see ModelRunner._graph_forward).

Buckets run from 256 tokens up to `max_tokens` in steps of at most 1.5x (the padding is at most a
third of a step's work). Each bucket's inputs also hold the two-batch overlap's halves, so a
captured forward may split the step (OverlapConfig.overlaps_in_graph). On the CPU
nothing is captured: `run` pads the same way and runs the forward eagerly over the static inputs,
so padding, static buffers and slicing are tested there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.layers.forward_context import AttentionMetadata, ForwardContext
from rayinfer.overlap_config import DEFAULT_OVERLAP, OverlapConfig
from rayinfer.workers.runner.decode_inputs import PAD_BLOCK, PAD_SLOT, PAD_TOKEN, GraphStep
from rayinfer.workers.runner.graph_buckets import bucket_for
from rayinfer.workers.runner.graph_capture import BucketGraphs

SMALLEST_BUCKET = 256


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Ascending token buckets up to max_tokens: 256, 512, then 1024, 1536, 2048, 3072, 4096,
    6144, ... (each at most 1.5x the one before), and max_tokens itself; [] for 0."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens={max_tokens} must be >= 0")
    if max_tokens == 0:
        return []
    candidates, power = [SMALLEST_BUCKET, 2 * SMALLEST_BUCKET], 4 * SMALLEST_BUCKET
    while power < max_tokens:
        candidates += [power, power * 3 // 2]
        power *= 2
    return [size for size in candidates if size < max_tokens] + [max_tokens]


def fits_static_prefill(request: ScheduledRequest, max_tokens: int) -> bool:
    """A whole new prompt's first step (nothing cached before it), of 2..max_tokens tokens,
    without prompt log-probabilities (those need every row's logits, not the graph's output)."""
    return (
        request.start_position == 0
        and 1 < len(request.token_ids) <= max_tokens
        and not request.prompt_logprob_targets
    )


def shared_prefill_bucket(shares: list[list[ScheduledRequest]], sizes: list[int]) -> int | None:
    """The one bucket in which every share (a data-parallel replica's requests) runs this step
    as one padded new prompt, or None when some share cannot (two requests, a decode, a chunk
    over a cached prefix, a prompt past the largest bucket, or nothing to run at all). Empty
    shares replay the bucket on padding."""
    if not sizes or not any(shares) or any(len(share) > 1 for share in shares):
        return None
    if not all(fits_static_prefill(share[0], sizes[-1]) for share in shares if share):
        return None
    return bucket_for(max(len(share[0].token_ids) for share in shares if share), sizes)


class StaticPrefillInputs:
    """Device buffers for one prompt of up to max_tokens tokens, refilled in place every step:
    token ids and cache slots (int64 [2, T]) and the block table (int32 [W]), each one
    host-to-device copy from a pinned twin. Everything else never changes, so each bucket's
    forward arguments (views of these buffers, and device constants for the bounds) are made
    once: positions 0..T-1, one sequence of `bucket` tokens, and the two-batch overlap's halves."""

    def __init__(
        self,
        sizes: list[int],
        block_size: int,
        kv_caches,
        device: torch.device,
        overlap: OverlapConfig = DEFAULT_OVERLAP,
    ):
        self.sizes, self.block_size, self.overlap = sizes, block_size, overlap
        self.kv_caches, self.device = kv_caches, device
        rows = sizes[-1]
        width = -(-rows // block_size)
        pin = device.type == "cuda"
        self.host_tokens = torch.zeros(2, rows, dtype=torch.int64, pin_memory=pin)
        self.host_table = torch.zeros(width, dtype=torch.int32, pin_memory=pin)
        self.tokens = torch.zeros(2, rows, dtype=torch.int64, device=device)  # ids, slots
        self.table = torch.zeros(1, width, dtype=torch.int32, device=device)  # [1, W]
        self.positions = torch.arange(rows, dtype=torch.int64, device=device)
        self.steps = {size: self._step(size) for size in sizes}  # bucket -> its arguments
        self._copied: torch.cuda.Event | None = None

    def fill(self, requests: list[ScheduledRequest], bucket: int) -> GraphStep:
        """Copy the prompt (none: all padding) into the first rows of the bucket."""
        if len(requests) > 1 or bucket not in self.steps:
            raise ValueError(f"{len(requests)} prompts in a bucket of {bucket} ({self.sizes})")
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free again
        tokens, table = self.host_tokens.numpy(), self.host_table.numpy()
        width = -(-bucket // self.block_size)
        tokens[0, :bucket], tokens[1, :bucket], table[:width] = PAD_TOKEN, PAD_SLOT, PAD_BLOCK
        if requests:
            request = requests[0]
            num_tokens = len(request.token_ids)
            if not 0 < num_tokens <= bucket:
                raise ValueError(f"a prompt of {num_tokens} tokens in a bucket of {bucket}")
            blocks = np.asarray(request.block_table[:width], dtype=np.int64)
            table[: len(blocks)] = blocks
            where = np.arange(num_tokens)
            tokens[0, :num_tokens] = request.token_ids
            tokens[1, :num_tokens] = blocks[where // self.block_size] * self.block_size + (
                where % self.block_size
            )
        is_cuda = self.device.type == "cuda"
        self.tokens.copy_(self.host_tokens, non_blocking=is_cuda)
        self.table.copy_(self.host_table[None], non_blocking=is_cuda)
        if is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.steps[bucket]

    def fill_padding(self, bucket: int) -> GraphStep:
        """Every row padding: what warm-up, capture and an idle replica run (writes no cache)."""
        return self.fill([], bucket)

    def _step(self, bucket: int) -> GraphStep:
        """Views of the bucket's rows; the context also holds the two-batch overlap's halves:
        the prompt's first t tokens, then the rest as a chunk over them."""
        cut = self.overlap.first_micro_batch_tokens(bucket)
        whole = self._context(bucket, 0, bucket, bucket)
        whole.micro_batches = (
            self._context(bucket, 0, cut, cut),
            self._context(bucket, cut, bucket, bucket),
        )
        return GraphStep(self.tokens[0, :bucket], self.positions[:bucket], whole)

    def _context(self, bucket: int, start: int, end: int, seq_len: int) -> ForwardContext:
        """One sequence of the bucket: rows [start, end) are its new tokens, the last of its
        seq_len tokens; query starts [0, end - start] and its length [seq_len] on the device."""
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=self.tokens[1, start:end],
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_tables=self.table[:, : -(-bucket // self.block_size)],
            query_lens_cpu=[end - start],
            seq_lens_cpu=[seq_len],
            block_size=self.block_size,
        )
        return ForwardContext(metadata, self.kv_caches)


class PrefillGraphs(BucketGraphs):
    kind = "prefill"

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],  # input_ids [T], positions [T], ctx -> [T, H]
        kv_caches: list[torch.Tensor],
        max_tokens: int,
        block_size: int,
        device: torch.device,
        overlap: OverlapConfig = DEFAULT_OVERLAP,  # where the two-batch overlap cuts a prompt
    ):
        sizes = prefill_graph_sizes(max_tokens)
        inputs = StaticPrefillInputs(sizes, block_size, kv_caches, device, overlap)
        super().__init__(forward, sizes, inputs, device)

    def bucket_of(self, requests: list[ScheduledRequest]) -> int | None:
        """The bucket a step of one new prompt runs in, or None (see shared_prefill_bucket)."""
        if not self.enabled:
            return None
        return shared_prefill_bucket([requests], self.sizes)

    def run(self, requests: list[ScheduledRequest], bucket: int) -> torch.Tensor:
        """Hidden states [n, H] of the prompt's n tokens ([0, H] for none); valid until the
        next `run` (a view of the graph's static output on CUDA)."""
        return self.replay(requests, bucket)[: sum(len(r.token_ids) for r in requests)]
