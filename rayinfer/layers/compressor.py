"""DeepSeek-V4's compressor: one pooled entry per `rate` tokens, kept in the paged cache.

Each token's projections `kv = wkv(x)` and `gate = wgate(x)` are cached in its row
(config_v4.V4CacheRow). When a step holds the last token of a window w (positions
[w * rate, (w + 1) * rate)), the window's rows are read back and pooled per channel,

    entry_w = norm( sum_j softmax_j(gate_j + ape_j) * kv_j ),  roped at position w * rate,

and written into the row of that last token. With `overlap` (CSA layers and the indexer) the
projections are twice as wide: the second half of window w's columns and the first half of
window w-1's pool together (2 * rate tokens; window -1 does not exist and weighs nothing).
Rows a step reads may come from earlier steps, a cached prefix or a hand-off: a row depends only
on its token and the tokens before it.
"""

from __future__ import annotations

import torch
from torch import nn

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
    its columns of the row: `kv_col` (projections; gates right after, `c * D` further) and
    `entry_col`."""

    def __init__(self, hidden_size: int, dim: int, rate: int, overlap: bool, eps: float,
                 rotary: V4Rotary, kv_col: int, pool_width: int, entry_col: int):  # fmt: skip
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
        self.entry_cols = slice(entry_col, entry_col + dim)

    def forward(self, x, positions, slots, seq_ids, attn, rows) -> None:
        """Cache the step's projections (x [T, H] at `slots` [T]; rows: the cache as
        [slots, width]) and pool every window that one of the step's tokens closes.

        A pure decode pools for every token and writes only the closing ones' (no
        data-dependent shape: a CUDA graph captures it); a prefill pools only the windows it
        closes."""
        kv, gate = self.wkv(x), self.wgate(x)  # [T, c * D] each
        ops.v4_write_rows(rows, slots, kv, self.kv_cols.start)
        ops.v4_write_rows(rows, slots, gate, self.gate_cols.start)
        closes = (slots >= 0) & ((positions + 1) % self.rate == 0)  # [T]
        if attn.is_pure_decode:
            pooled = self._pool(positions, seq_ids, attn, rows, x.dtype)
            ops.v4_write_rows(rows, torch.where(closes, slots, -1), pooled, self.entry_cols.start)
            return
        closing = torch.nonzero(closes)[:, 0]
        if closing.numel():
            pooled = self._pool(positions[closing], seq_ids[closing], attn, rows, x.dtype)
            ops.v4_write_rows(rows, slots[closing], pooled, self.entry_cols.start)

    def _pool(self, ends, seq_ids, attn, rows, dtype) -> torch.Tensor:
        """The roped entries [W, D] of the windows whose last tokens are at `ends` [W]."""
        window = torch.div(ends + 1, self.rate, rounding_mode="floor") - 1  # [W]
        span = (2 if self.overlap else 1) * self.rate
        first = (window - (1 if self.overlap else 0)) * self.rate  # [W]
        where = first[:, None] + torch.arange(span, device=ends.device)  # [W, span]
        source = slots_of(attn.block_tables, seq_ids[:, None], where, attn.block_size)
        kv_rows = rows[source.clamp(min=0), self.kv_cols].to(dtype)  # [W, span, c * D]
        gate_rows = rows[source.clamp(min=0), self.gate_cols].float()
        if self.overlap:  # window w-1's first half, then window w's second half
            d, r = self.dim, self.rate
            kv_rows = torch.cat([kv_rows[:, :r, :d], kv_rows[:, r:, d:]], dim=1)
            bias = torch.cat([self.ape[:, :d], self.ape[:, d:]], dim=0)  # [2 * rate, D]
            gate_rows = torch.cat([gate_rows[:, :r, :d], gate_rows[:, r:, d:]], dim=1) + bias
            gate_rows = gate_rows.masked_fill((source < 0)[..., None], float("-inf"))
        else:
            gate_rows = gate_rows + self.ape
        weights = gate_rows.softmax(dim=1).to(kv_rows.dtype)
        pooled = self.norm((kv_rows * weights).sum(dim=1))  # [W, D]
        cos_sin = self.rotary.cos_sin(window.clamp(min=0) * self.rate, pooled.dtype)
        return self.rotary.rotate(pooled, cos_sin)
