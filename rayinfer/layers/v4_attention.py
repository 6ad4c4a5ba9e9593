"""DeepSeek-V4 attention: one shared key/value head over a sliding window and pooled entries.

Per token: queries [N, D] from the query LoRA (`wq_a`, `q_norm`, `wq_b`, then an unweighted RMS
norm per head); one key [D] (`wkv`, `norm`), which is also the value; RoPE on the trailing R
columns of both. A query at position p attends to
- the raw keys of positions p - sliding_window + 1 .. p (the window, itself included);
- a compressed layer's pooled entries of the windows that end at or before p (layers/compressor.py):
  all of them ("heavily_compressed_attention"), or the `index_topk` that the lightning indexer
  scores best ("compressed_sparse_attention");
- a learned per-head sink logit, which takes probability mass and returns nothing.
The output's rope columns are rotated back at p, then the grouped projection `wo_a` (o_groups
blocks of heads, each to o_lora_rank) and `wo_b` mix it into the hidden size.

Parameter names follow the shipped checkpoints (transformers' `save_pretrained` writes the same).
The forward is torch on any device; see issue 29 for the kernels that will replace it.
"""

from __future__ import annotations

import torch
from torch import nn

from rayinfer.config import ModelConfig
from rayinfer.config_v4 import CSA, SLIDING, V4Config
from rayinfer.layers.compressor import Compressor, slots_of, token_seq_ids
from rayinfer.layers.forward_context import ForwardContext
from rayinfer.layers.hyper_connection import unweighted_rms_norm
from rayinfer.layers.linear import ReplicatedLinear
from rayinfer.layers.mlp import copy_checked
from rayinfer.layers.norm import RMSNorm
from rayinfer.layers.v4_rotary import V4Rotary


class LightningIndexer(nn.Module):
    """Scores pooled index keys for each query: sum_h w_h * relu(q_h . k) (w from
    `weights_proj`, queries from `wq_b` on the query LoRA), and keeps the best `index_topk`."""

    def __init__(self, config: ModelConfig, v4: V4Config, rotary: V4Rotary, rate: int):
        super().__init__()
        row = v4.row
        self.num_heads, self.dim, self.topk = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        self.wq_b = ReplicatedLinear(v4.q_lora_rank, self.num_heads * self.dim)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads)
        self.compressor = Compressor(
            config.hidden_size, self.dim, rate, True, config.rms_norm_eps, rotary,
            row.index_kv, 2 * row.index_dim, row.index_entry,
        )  # fmt: skip
        self.rotary = rotary
        # relu(s * x) = s * relu(x) for s > 0: both of transformers' scales fold into weights
        self.weight_scale = (self.num_heads**-0.5) * (self.dim**-0.5)

    def forward(self, x, q_resid, positions, seq_ids, attn, rows, cos_sin):
        """-> (chosen [T, k] entry numbers, chosen_valid [T, k] bool), k <= index_topk."""
        self.compressor(x, positions, attn.slot_mapping, seq_ids, attn, rows)
        keys, valid = self.compressor.visible_entries(positions, seq_ids, attn, rows)
        if keys.shape[1] == 0:
            empty = torch.zeros(x.shape[0], 0, dtype=torch.int64, device=x.device)
            return empty, empty.bool()
        queries = self.wq_b(q_resid).view(-1, self.num_heads, self.dim)  # [T, Hi, Di]
        queries = self.rotary.rotate(queries, cos_sin).float()
        weights = self.weights_proj(x).float() * self.weight_scale  # [T, Hi]
        scores = torch.relu(torch.einsum("thd,ted->the", queries, keys.float()))
        scores = torch.einsum("the,th->te", scores, weights)  # [T, E]
        scores = scores.masked_fill(~valid, float("-inf"))
        chosen = scores.topk(min(self.topk, scores.shape[1]), dim=-1).indices  # [T, k]
        return chosen, valid.gather(1, chosen)


class V4Attention(nn.Module):
    """See the module docstring; the cache is `[num_blocks, block_size, V4CacheRow.width]`."""

    def __init__(self, config: ModelConfig, v4: V4Config, layer_idx: int):
        super().__init__()
        hidden, heads, dim = config.hidden_size, config.num_attention_heads, v4.head_dim
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, heads, dim
        self.window, self.groups, self.eps = v4.sliding_window, v4.o_groups, config.rms_norm_eps
        self.kind = v4.layer_types[layer_idx]
        self.wq_a = ReplicatedLinear(hidden, v4.q_lora_rank)
        self.q_norm = RMSNorm(v4.q_lora_rank, config.rms_norm_eps)
        self.wq_b = ReplicatedLinear(v4.q_lora_rank, heads * dim)
        self.wkv = ReplicatedLinear(hidden, dim)
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.wo_a = ReplicatedLinear(heads * dim // v4.o_groups, v4.o_groups * v4.o_lora_rank)
        self.wo_b = ReplicatedLinear(v4.o_groups * v4.o_lora_rank, hidden)
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32), requires_grad=False)
        self.attn_sink.weight_loader = copy_checked
        rope = v4.rope_parameters["main" if self.kind == SLIDING else "compress"]
        self.rotary = V4Rotary(rope, v4.rope_dim, config.max_position_embeddings)
        self.scale = dim**-0.5
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            row, rate = v4.row, v4.compress_rate(layer_idx)
            overlap = self.kind == CSA
            self.compressor = Compressor(
                hidden, dim, rate, overlap, config.rms_norm_eps, self.rotary,
                row.pool_kv, row.pool_width, row.entry,
            )  # fmt: skip
            if overlap:
                self.indexer = LightningIndexer(config, v4, self.rotary, rate)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        """positions [T], x [T, H] -> [T, H]; writes the tokens' rows into the cache."""
        attn, cache = ctx.attn, ctx.kv_caches[self.layer_idx]
        rows = cache.view(-1, cache.shape[-1])  # [slots, width]
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        q_resid = self.q_norm(self.wq_a(x))
        queries = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        queries = self.rotary.rotate(unweighted_rms_norm(queries, self.eps), cos_sin)
        key = self.rotary.rotate(self.norm(self.wkv(x)), cos_sin)  # [T, D]
        written = attn.slot_mapping >= 0
        rows[attn.slot_mapping[written], : self.head_dim] = key[written].to(rows.dtype)
        seq_ids = token_seq_ids(attn)
        keys, valid = self._window(positions, seq_ids, attn, rows)  # [T, W, D], [T, W]
        if self.compressor is not None:
            self.compressor(x, positions, attn.slot_mapping, seq_ids, attn, rows)
            entries, entry_valid = self.compressor.visible_entries(positions, seq_ids, attn, rows)
            if self.indexer is not None:
                chosen, entry_valid = self.indexer(
                    x, q_resid, positions, seq_ids, attn, rows, cos_sin
                )
                entries = entries.gather(1, chosen[..., None].expand(-1, -1, self.head_dim))
            keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
            valid = torch.cat([valid, entry_valid], dim=1)
        out = self._attend(queries, keys, valid)  # [T, N, D]
        out = self.rotary.rotate(out, cos_sin, inverse=True)
        grouped = out.reshape(out.shape[0], self.groups, -1)  # [T, G, N * D / G]
        weight = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [G, r, N * D / G]
        mixed = torch.einsum("tgi,gri->tgr", grouped, weight).flatten(1)  # [T, G * r]
        return self.wo_b(mixed)

    def _window(self, positions, seq_ids, attn, rows):
        """The raw keys of each query's window: ([T, W, D], valid [T, W])."""
        width = min(self.window, max(attn.seq_lens_cpu, default=1))
        where = positions[:, None] - torch.arange(width, device=positions.device)  # [T, W]
        slots = slots_of(attn.block_tables, seq_ids[:, None], where, attn.block_size)
        return rows[slots.clamp(min=0), : self.head_dim], slots >= 0

    def _attend(self, queries, keys, valid):
        """queries [T, N, D], keys (= values) [T, K, D], valid [T, K] -> [T, N, D], with the
        sinks in the softmax."""
        logits = torch.einsum("tnd,tkd->tnk", queries.float(), keys.float()) * self.scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sinks = self.attn_sink.view(1, -1, 1).expand(logits.shape[0], -1, 1)
        probs = torch.cat([logits, sinks.float()], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("tnk,tkd->tnd", probs.to(keys.dtype), keys).to(queries.dtype)
