"""DeepSeek-V4's compressor: one pooled entry per `rate` tokens, kept in the paged cache.

Each token's projections `kv = wkv(x)` and `gate = wgate(x)` are cached in its window-pool row
(config_v4.V4WindowRow). When a step holds the last token of a window w (positions
[w * rate, (w + 1) * rate)), the window's rows are read back and pooled per channel,

    entry_w = norm( sum_j softmax_j(gate_j + ape_j) * kv_j ),  roped at position w * rate,

and written spread over the paged-cache rows of the window's tokens (config_v4.EntrySpread).
With `overlap` (CSA layers and the indexer) the projections are twice as wide: the second half
of window w's columns and the first half of window w-1's pool together (2 * rate tokens; window
-1 does not exist and weighs nothing). Rows a step reads may come from earlier steps, a cached
prefix or a hand-off (ModelConfig.window_span covers the tokens before the step it reads).
"""

from __future__ import annotations

import torch
from torch import nn

from rayinfer.config_v4 import EntrySpread
from rayinfer.kernels import ops
from rayinfer.kernels.dsa.v4_attention import slots_of
from rayinfer.layers.linear import ReplicatedLinear
from rayinfer.layers.mlp import copy_checked
from rayinfer.layers.norm import RMSNorm
from rayinfer.layers.v4_rotary import V4Rotary


def token_seq_ids(attn) -> torch.Tensor:
    """[T] int64: the sequence of every token of the step (a pure decode's without host lists,
    so a CUDA graph captures it)."""
    device = attn.seq_lens.device
    if attn.is_pure_decode:
        return torch.arange(attn.num_seqs, device=device)
    counts = torch.tensor(attn.query_lens_cpu, device=device)
    return torch.repeat_interleave(torch.arange(attn.num_seqs, device=device), counts)


def context_bound(attn) -> int:
    """A host bound on every sequence's length: a pure decode's is its tables' width (what a
    CUDA graph captures: max_model_len), a prefill's the longest sequence."""
    if attn.is_pure_decode:
        return attn.block_tables.shape[1] * attn.block_size
    return max(attn.seq_lens_cpu, default=1)


class Compressor(nn.Module):
    """`wkv`, `wgate` [c * D, H] (c = 2 with overlap), `ape` [rate, c * D] float32, `norm` [D];
    its columns of the window row: `kv_col` (projections; gates `pool_width` further), and
    where its entries lie in the paged cache (`spread`)."""

    def __init__(self, hidden_size: int, dim: int, rate: int, overlap: bool, eps: float,
                 rotary: V4Rotary, kv_col: int, pool_width: int,
                 spread: EntrySpread):  # fmt: skip
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = (2 if overlap else 1) * dim
        self.wkv = ReplicatedLinear(hidden_size, width)
        self.wgate = ReplicatedLinear(hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32), requires_grad=False)
        self.ape.weight_loader = copy_checked
        self.norm = RMSNorm(dim, eps)
        self.rotary = rotary
        self.kv_cols = slice(kv_col, kv_col + width)
        self.gate_cols = slice(kv_col + pool_width, kv_col + pool_width + width)
        self.spread = spread
        self.entry_rows = -(-dim // spread.share)  # rows an entry spreads over (<= rate)

    @property
    def spread_args(self) -> tuple[int, int, int]:
        """(rate, share, column): the kernels' description of where the entries lie."""
        return self.spread.rate, self.spread.share, self.spread.column

    def forward(self, x, positions, seq_ids, attn, window_rows, rows) -> None:
        """Cache the step's projections (x [T, H]; window_rows: the window pool as [slots, Ww])
        and pool every window that one of the step's tokens closes into `rows` (the paged
        cache as [slots, Wm]).

        A pure decode pools for every token and writes only the closing ones' (no
        data-dependent shape: a CUDA graph captures it); a prefill pools only the windows it
        closes."""
        kv, gate = self.wkv(x), self.wgate(x)  # [T, c * D] each
        window_slots = attn.window_slot_mapping
        ops.v4_write_rows(window_rows, window_slots, kv, self.kv_cols.start)
        ops.v4_write_rows(window_rows, window_slots, gate, self.gate_cols.start)
        closes = (attn.slot_mapping >= 0) & ((positions + 1) % self.rate == 0)  # [T]
        if attn.is_pure_decode:
            pooled = self._pool(positions, seq_ids, attn, window_rows, x.dtype)
            self._write_entries(rows, attn, positions, seq_ids, pooled, closes)
            return
        closing = torch.nonzero(closes)[:, 0]
        if closing.numel():
            pooled = self._pool(positions[closing], seq_ids[closing], attn, window_rows, x.dtype)
            self._write_entries(rows, attn, positions[closing], seq_ids[closing], pooled, None)

    def _write_entries(self, rows, attn, ends, seq_ids, pooled, keep) -> None:
        """Spread the entries [W, D] of the windows ending at `ends` [W] over their tokens'
        rows (`keep` [W] bool: only those; None: all)."""
        count, share = self.entry_rows, self.spread.share
        first = torch.div(ends + 1, self.rate, rounding_mode="floor") * self.rate - self.rate
        where = first[:, None] + torch.arange(count, device=ends.device)  # [W, count]
        slots = slots_of(attn.block_tables, seq_ids[:, None], where, attn.block_size)
        if keep is not None:
            slots = torch.where(keep[:, None], slots, -1)
        pieces = torch.nn.functional.pad(pooled, (0, count * share - self.dim))
        ops.v4_write_rows(rows, slots.flatten(), pieces.reshape(-1, share), self.spread.column)

    def _pool(self, ends, seq_ids, attn, window_rows, dtype) -> torch.Tensor:
        """The roped entries [W, D] of the windows whose last tokens are at `ends` [W]."""
        window = torch.div(ends + 1, self.rate, rounding_mode="floor") - 1  # [W]
        span = (2 if self.overlap else 1) * self.rate
        first = (window - (1 if self.overlap else 0)) * self.rate  # [W]
        where = first[:, None] + torch.arange(span, device=ends.device)  # [W, span]
        source = slots_of(attn.window_tables, seq_ids[:, None], where, attn.block_size)
        kv_rows = window_rows[source.clamp(min=0), self.kv_cols].to(dtype)  # [W, span, c * D]
        gate_rows = window_rows[source.clamp(min=0), self.gate_cols].float()
        if self.overlap:  # window w-1's first half, then window w's second half
            d, r = self.dim, self.rate
            kv_rows = torch.cat([kv_rows[:, :r, :d], kv_rows[:, r:, d:]], dim=1)
            bias = torch.cat([self.ape[:, :d], self.ape[:, d:]], dim=0)  # [2 * rate, D]
            gate_rows = torch.cat([gate_rows[:, :r, :d], gate_rows[:, r:, d:]], dim=1) + bias
            gate_rows = gate_rows.masked_fill((where < 0)[..., None], float("-inf"))
        else:
            gate_rows = gate_rows + self.ape
        weights = gate_rows.softmax(dim=1).to(kv_rows.dtype)
        pooled = self.norm((kv_rows * weights).sum(dim=1))  # [W, D]
        cos_sin = self.rotary.cos_sin(window.clamp(min=0) * self.rate, pooled.dtype)
        return self.rotary.rotate(pooled, cos_sin)
