"""The static inputs a captured decode graph reads: device buffers sized for the largest bucket,
refilled in place every step (a graph replays fixed addresses, so nothing is reallocated).

A batch of n decodes in bucket b fills rows [0, n) with the real sequences and rows [n, b) with
padding that costs nothing and writes nothing: token 0 at position 0, slot -1 (the cache write
skips it), context length 1 read from block 0 (any real block; only read). Block tables are
padded to the widest a sequence can be (max_model_len), so the split-K decode picks its splits
from the bucket and max_model_len alone, never from this step's context lengths.

Host side: two pinned staging buffers (int64 tokens, int32 lengths and tables) laid out like the
device ones, so a step is two host-to-device copies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.layers.forward_context import AttentionMetadata, ForwardContext

PAD_TOKEN = 0
PAD_SLOT = -1  # the cache writes skip negative slots
PAD_BLOCK = 0  # padding rows read block 0 (context length 1) and use nothing they read


def fits_static_decode(request: ScheduledRequest, max_blocks_per_seq: int) -> bool:
    """One new token, and a block table no wider than the static tables."""
    return len(request.token_ids) == 1 and len(request.block_table) <= max_blocks_per_seq


class GraphStep(NamedTuple):
    """A captured forward's arguments: views of static buffers (decode or prefill graphs)."""

    input_ids: torch.Tensor  # [b] int64: a view of the static buffer
    positions: torch.Tensor  # [b] int64
    ctx: ForwardContext  # metadata over the static buffers' first b rows


class StaticDecodeInputs:
    def __init__(
        self,
        max_batch_size: int,
        max_blocks_per_seq: int,
        block_size: int,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        windowed: bool = False,
    ):
        """windowed: the model keeps a window pool; requests carry window tables, which get
        their own static [B, W] table and a fourth token row (each token's window slot)."""
        self.windowed = windowed
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.kv_caches = kv_caches
        self.device = device
        rows, width = max_batch_size, max_blocks_per_seq
        pin = device.type == "cuda"
        # int64 [3, B]: token ids, positions, slots. int32 [B + B * W]: context lengths, then the
        # block tables [B, W] (both contiguous for any first b rows).
        token_rows = 4 if windowed else 3
        self.host_tokens = torch.zeros(token_rows, rows, dtype=torch.int64, pin_memory=pin)
        self.host_lengths = torch.zeros(rows + rows * width, dtype=torch.int32, pin_memory=pin)
        self.tokens = torch.zeros(token_rows, rows, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(rows + rows * width, dtype=torch.int32, device=device)
        self.host_windows = self.windows = None  # [B, W] int32 window tables
        if windowed:
            self.host_windows = torch.zeros(rows, width, dtype=torch.int32, pin_memory=pin)
            self.windows = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # [B + 1]
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy

    @property
    def seq_lens(self) -> torch.Tensor:  # [B] int32
        return self.lengths[: self.max_batch_size]

    @property
    def block_tables(self) -> torch.Tensor:  # [B, W] int32
        return self.lengths[self.max_batch_size :].view(self.max_batch_size, -1)

    def fits(self, request: ScheduledRequest) -> bool:
        return fits_static_decode(request, self.max_blocks_per_seq)

    def fill(self, requests: list[ScheduledRequest], bucket: int) -> GraphStep:
        """Copy one decode per request into rows [0, n), padding into [n, bucket)."""
        num_real = len(requests)
        if not 0 <= num_real <= bucket <= self.max_batch_size:
            raise ValueError(
                f"{num_real} requests in a bucket of {bucket} (max {self.max_batch_size})"
            )
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free again
        tokens = self.host_tokens.numpy()  # [3, B]
        lengths = self.host_lengths.numpy()
        seq_lens = lengths[: self.max_batch_size]  # [B]
        tables = lengths[self.max_batch_size :].reshape(self.max_batch_size, -1)  # [B, W]
        block_size = self.block_size
        tables[:bucket] = -1
        # Per-row scalars go in as whole columns (one numpy call each, not three per row).
        positions = [r.start_position for r in requests]  # of each new token, cached at its slot
        pad = bucket - num_real
        tokens[0, :bucket] = [r.token_ids[0] for r in requests] + [PAD_TOKEN] * pad
        tokens[1, :bucket] = positions + [0] * pad
        tokens[2, :bucket] = [
            r.block_table[p // block_size] * block_size + p % block_size
            for r, p in zip(requests, positions)
        ] + [PAD_SLOT] * pad
        context_lens = [p + 1 for p in positions] + [1] * pad
        seq_lens[:bucket] = context_lens
        for row, request in enumerate(requests):
            tables[row, : len(request.block_table)] = request.block_table
        tables[num_real:bucket, 0] = PAD_BLOCK
        if self.windowed:
            windows = self.host_windows.numpy()
            windows[:bucket] = -1
            tokens[3, :bucket] = [
                r.window_table[p // block_size] * block_size + p % block_size
                for r, p in zip(requests, positions)
            ] + [PAD_SLOT] * pad
            for row, request in enumerate(requests):
                windows[row, : len(request.window_table)] = request.window_table
            windows[num_real:bucket, 0] = PAD_BLOCK
        self._copy_to_device(bucket)
        return self.step(bucket, context_lens)

    def fill_padding(self, bucket: int) -> GraphStep:
        """Every row of the bucket padding: what warm-up and capture run (writes no cache)."""
        return self.fill([], bucket)

    def step(self, bucket: int, context_lens: list[int]) -> GraphStep:
        """Views of the first `bucket` rows. `context_lens` only fills the host-side
        `seq_lens_cpu`; a captured graph must not read it (it keeps the capture's values)."""
        metadata = AttentionMetadata(
            slot_mapping=self.tokens[2, :bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=context_lens,
            block_size=self.block_size,
            window_slot_mapping=self.tokens[3, :bucket] if self.windowed else None,
            window_tables=self.windows[:bucket] if self.windowed else None,
        )
        ctx = ForwardContext(metadata, self.kv_caches)
        return GraphStep(self.tokens[0, :bucket], self.tokens[1, :bucket], ctx)

    def _copy_to_device(self, bucket: int) -> None:
        used = self.max_batch_size + bucket * self.max_blocks_per_seq  # lengths + b table rows
        is_cuda = self.device.type == "cuda"
        self.tokens.copy_(self.host_tokens, non_blocking=is_cuda)
        self.lengths[:used].copy_(self.host_lengths[:used], non_blocking=is_cuda)
        if self.windowed:
            self.windows[:bucket].copy_(self.host_windows[:bucket], non_blocking=is_cuda)
        if is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
