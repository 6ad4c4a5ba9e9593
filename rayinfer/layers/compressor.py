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

from rayinfer.kernels.v4_attention import slots_of
from rayinfer.layers.linear import ReplicatedLinear
from rayinfer.layers.mlp import copy_checked
from rayinfer.layers.norm import RMSNorm
from rayinfer.layers.v4_rotary import V4Rotary


def token_seq_ids(attn) -> torch.Tensor:
    """[T] int64: the sequence of every token of the step."""
    counts = torch.tensor(attn.query_lens_cpu, device=attn.seq_lens.device)
    return torch.repeat_interleave(torch.arange(attn.num_seqs, device=counts.device), counts)


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
        [slots, width]) and pool every window that one of the step's tokens closes."""
        written = slots >= 0
        kv, gate = self.wkv(x), self.wgate(x)  # [T, c * D] each
        rows[slots[written], self.kv_cols] = kv[written].to(rows.dtype)
        rows[slots[written], self.gate_cols] = gate[written].to(rows.dtype)
        closes = torch.nonzero(written & ((positions + 1) % self.rate == 0))[:, 0]
        if closes.numel() == 0:
            return
        window = torch.div(positions[closes] + 1, self.rate, rounding_mode="floor") - 1  # [W]
        span = (2 if self.overlap else 1) * self.rate
        first = (window - (1 if self.overlap else 0)) * self.rate  # [W]
        where = first[:, None] + torch.arange(span, device=x.device)  # [W, span]
        source = slots_of(attn.block_tables, seq_ids[closes, None], where, attn.block_size)
        kv_rows = rows[source.clamp(min=0), self.kv_cols].to(x.dtype)  # [W, span, c * D]
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
        cos_sin = self.rotary.cos_sin(window * self.rate, pooled.dtype)
        rows[slots[closes], self.entry_cols] = self.rotary.rotate(pooled, cos_sin).to(rows.dtype)
