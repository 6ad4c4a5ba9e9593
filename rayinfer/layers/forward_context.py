"""What one forward pass needs besides token ids: where each token's KV goes and what it attends to.

A batch mixes prefill chunks and decode steps. Sequence i contributes `query_lens[i]` new tokens
that sit at positions `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1` of its context; every token
attends causally to the whole context before it, read from the paged cache through its block table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from rayinfer.kernels.host_lists import device_ints

if TYPE_CHECKING:
    from rayinfer.layers.graph_pieces import Pieces


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) per token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32: block ids of each sequence, -1 padded
    query_lens_cpu: list[int]  # [B] new tokens per sequence, on the host for Python loops
    seq_lens_cpu: list[int]  # [B] context lengths, on the host
    block_size: int
    # A model with a window pool (engine/block_manager.py): each token's slot there, and each
    # sequence's window table (-1 where no window block is held); None for other models.
    window_slot_mapping: torch.Tensor | None = None  # [T] int64
    window_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    # What every layer of an eager step derives alike from these fields, made by the first
    # layer that needs it (e.g. MLA's decode rows in a mixed batch): name -> value.
    derived: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens_cpu)


@dataclass
class ForwardContext:
    """Passed explicitly through the model: metadata plus one cache tensor per layer.

    `kv_caches[layer]` is `[num_blocks, block_size, *ModelConfig.kv_shapes_per_layer(bytes)
    [layer]]` (`bytes`: its dtype's element size); a model with a window pool has its layers' window
    caches after them, `kv_caches[num_layers + layer]` `[num_window_blocks, block_size,
    ModelConfig.window_row_width]`.
    """

    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]
    # The two-batch overlap's two halves, made ahead from static buffers where the step is
    # captured in a CUDA graph (split_forward_context copies host lists); None: split on demand.
    micro_batches: tuple[ForwardContext, ForwardContext] | None = None
    # DSA: the last "full" indexer layer's selection ([S, index_topk] int32 cache slots of its
    # sparse rows), which the "shared" layers after it reuse (layers/dsa.py)
    dsa_selection: torch.Tensor | None = None
    # A forward captured in pieces: what each layer's attention does at its cut (see
    # layers/graph_pieces.py); None runs attention inline.
    pieces: Pieces | None = None
    # Told each layer's index once that layer's cache writes of the step are queued on the
    # current stream (after its attention), so the hand-off's export copies the layer out while
    # later layers compute (workers/runner/layer_export.py); None: nobody listens. A forward
    # may leave layers untold (a step replayed whole from a graph; micro-batch halves, which
    # make contexts of their own): the listener copies those after the forward.
    on_layer_cached: Callable[[int], None] | None = None

    def layer_cached(self, layer: int | None) -> None:
        if self.on_layer_cached is not None and layer is not None:
            self.on_layer_cached(layer)


def token_positions(query_lens: list[int], seq_lens: list[int]) -> np.ndarray:
    """[T] int64: the position of every new token, sequence after sequence."""
    if all(query_len == 1 for query_len in query_lens):  # decodes: one Python pass
        return np.array([seq_len - 1 for seq_len in seq_lens], dtype=np.int64)
    return np.concatenate(
        [np.arange(s - q, s, dtype=np.int64) for q, s in zip(query_lens, seq_lens)]
    )


def cache_slots(positions: np.ndarray, query_lens, block_tables, block_size: int) -> np.ndarray:
    """[T] int64: cache slot (block id * block_size + offset) of every new token."""
    slots = np.empty(positions.shape[0], dtype=np.int64)
    start = 0
    for query_len, table in zip(query_lens, block_tables):
        if query_len == 0:
            continue
        if query_len == 1:  # a decode: one slot, cheapest in plain Python
            last = int(positions[start])
            slots[start] = table[last // block_size] * block_size + last % block_size
        else:  # a prefill chunk: its blocks' ids, one per token, in numpy
            where = positions[start : start + query_len]
            first_block = int(where[0]) // block_size
            blocks = np.asarray(table[first_block : int(where[-1]) // block_size + 1])
            slots[start : start + query_len] = (
                blocks[where // block_size - first_block] * block_size + where % block_size
            )
        start += query_len
    return slots


def _padded_tables(block_tables: list[list[int]]) -> np.ndarray:
    """[B, max_blocks] int32: each table, -1 padded (one flat pass: 256 decodes' 512-block
    tables took 7.1 ms as a nested list for torch.tensor, 2.4 ms so)."""
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    width = int(lengths.max()) if len(block_tables) else 0
    padded = np.full((len(block_tables), width), -1, dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(block_tables), np.int32, count=int(lengths.sum()))
    padded[np.arange(width) < lengths[:, None]] = flat
    return padded


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    positions: np.ndarray | None = None,
    window_tables: list[list[int]] | None = None,
    slots: np.ndarray | None = None,
) -> AttentionMetadata:
    """Metadata for sequences whose last `query_lens[i]` of `seq_lens[i]` tokens are new;
    positions and slots: their `token_positions` and `cache_slots`, when the caller already has
    them. Built in numpy (a
    16k-token prompt's slots took ~1.4 ms as Python lists and tensors) and sent to the device
    without waiting for it (host_lists.device_ints)."""
    if positions is None:
        positions = token_positions(query_lens, seq_lens)
    if slots is None:
        slots = cache_slots(positions, query_lens, block_tables, block_size)
    padded = _padded_tables(block_tables)  # [B, max_blocks]
    starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=starts[1:])
    window_slots = window_padded = None
    if window_tables is not None:
        window_slots = device_ints(
            torch.from_numpy(cache_slots(positions, query_lens, window_tables, block_size)),
            torch.int64, device,
        )  # fmt: skip
        window_padded = device_ints(
            torch.from_numpy(_padded_tables(window_tables)), torch.int32, device
        )
    return AttentionMetadata(
        slot_mapping=device_ints(torch.from_numpy(slots), torch.int64, device),
        query_start_loc=device_ints(torch.from_numpy(starts), torch.int32, device),
        seq_lens=device_ints(seq_lens, torch.int32, device),
        block_tables=device_ints(torch.from_numpy(padded), torch.int32, device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
        window_slot_mapping=window_slots,
        window_tables=window_padded,
    )


def split_forward_context(ctx: ForwardContext, split_token: int) -> tuple[ForwardContext, ...]:
    """Two contexts over the same caches: the step's tokens [0, t) and [t, T).

    A sequence cut by the split becomes two chunks: the first ends at the cut, the second attends
    to it through the cache, so the first context must run (and write its KV) before the second.
    """
    attn = ctx.attn
    first_lens, first_seq_lens, first_rows = [], [], []
    second_lens, second_seq_lens, second_rows = [], [], []
    start = 0
    for row, (query_len, seq_len) in enumerate(zip(attn.query_lens_cpu, attn.seq_lens_cpu)):
        in_first = min(max(split_token - start, 0), query_len)  # this sequence's tokens before t
        if in_first:
            first_lens.append(in_first)
            first_seq_lens.append(seq_len - query_len + in_first)
            first_rows.append(row)
        if in_first < query_len:
            second_lens.append(query_len - in_first)
            second_seq_lens.append(seq_len)
            second_rows.append(row)
        start += query_len
    tokens = (slice(0, split_token), slice(split_token, None))
    parts = ((first_lens, first_seq_lens, first_rows), (second_lens, second_seq_lens, second_rows))
    return tuple(
        ForwardContext(_sub_metadata(attn, *part, token_range), ctx.kv_caches)
        for part, token_range in zip(parts, tokens)
    )


def _sub_metadata(attn, query_lens, seq_lens, rows, tokens: slice) -> AttentionMetadata:
    device = attn.seq_lens.device
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    rows = torch.tensor(rows, dtype=torch.int64, device=device)
    windowed = attn.window_tables is not None
    return AttentionMetadata(
        slot_mapping=attn.slot_mapping[tokens],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=attn.block_tables[rows],
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=attn.block_size,
        window_slot_mapping=attn.window_slot_mapping[tokens] if windowed else None,
        window_tables=attn.window_tables[rows] if windowed else None,
    )


# Tokens an idle rank runs so that it joins its peers' collectives (see idle_forward_inputs).
IDLE_FORWARD_TOKENS = 1


def idle_forward_inputs(
    ctx: ForwardContext, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    """One placeholder token for a rank (or micro-batch) with nothing to compute, so that it still
    joins every collective of the forward pass. It reads block 0, writes no cache slot (-1) and
    its output is thrown away."""
    count = IDLE_FORWARD_TOKENS
    windows = [[0]] if ctx.attn.window_tables is not None else None
    metadata = build_attention_metadata(
        [count], [1], [[0]], ctx.attn.block_size, device, window_tables=windows
    )
    metadata.slot_mapping.fill_(-1)
    if windows is not None:
        metadata.window_slot_mapping.fill_(-1)
    input_ids = torch.zeros(count, dtype=torch.int64, device=device)
    positions = torch.zeros(count, dtype=torch.int64, device=device)
    return input_ids, positions, ForwardContext(metadata, ctx.kv_caches)
