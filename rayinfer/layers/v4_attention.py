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
The attention itself is `ops.v4_attention` (kernels/dsa/v4_attention.py) and the indexer's choice
`ops.dsa_index_topk` over pooled keys; the compressors' pooling stays in torch (a step pools
only the windows its tokens close). The cache is hybrid (config_v4.py): keys and projections in
the window pool (`ctx.kv_caches[num_layers + layer]`), entries in the paged cache.
"""

from __future__ import annotations

import torch
from torch import nn

from rayinfer.config import ModelConfig
from rayinfer.config_v4 import CSA, SLIDING, V4Config
from rayinfer.kernels import ops
from rayinfer.layers.compressor import Compressor, context_bound, token_seq_ids
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
        window_row = v4.window_row
        self.num_heads, self.dim, self.topk = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        self.wq_b = ReplicatedLinear(v4.q_lora_rank, self.num_heads * self.dim)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads)
        self.compressor = Compressor(
            config.hidden_size, self.dim, rate, True, config.rms_norm_eps, rotary,
            window_row.index_kv, 2 * window_row.index_dim, v4.entry_row.index_entries,
        )  # fmt: skip
        self.rotary = rotary
        # relu(s * x) = s * relu(x) for s > 0: both of transformers' scales fold into weights
        self.weight_scale = (self.num_heads**-0.5) * (self.dim**-0.5)

    def forward(self, x, q_resid, positions, seq_ids, attn, window_cache, cache, cos_sin):
        """-> [T, index_topk] int32: each query's chosen entry numbers, -1 padded (fewer
        entries than index_topk visible: all of them)."""
        rows = cache.view(-1, cache.shape[-1])
        window_rows = window_cache.view(-1, window_cache.shape[-1])
        self.compressor(x, positions, seq_ids, attn, window_rows, rows)
        most = context_bound(attn) // self.compressor.rate  # a host bound
        if most == 0:
            return torch.full((x.shape[0], self.topk), -1, dtype=torch.int32, device=x.device)
        queries = self.wq_b(q_resid).view(-1, self.num_heads, self.dim)  # [T, Hi, Di]
        queries = self.rotary.rotate(queries, cos_sin).contiguous()
        weights = self.weights_proj(x).float() * self.weight_scale  # [T, Hi]
        spread = self.compressor.spread
        return ops.dsa_index_topk(
            queries, weights, cache, spread.column, attn.block_tables, seq_ids.int(), positions,
            self.topk, most, spread=(spread.rate, spread.share),
        )  # fmt: skip


class V4Attention(nn.Module):
    """See the module docstring; the caches are `[num_blocks, block_size, V4EntryRow.width]`
    and the window pool's `[num_window_blocks, block_size, V4WindowRow.width]`."""

    attends_outside_graphs = False  # the compressors and the selection run inside the layer

    def __init__(self, config: ModelConfig, v4: V4Config, layer_idx: int):
        super().__init__()
        hidden, heads, dim = config.hidden_size, config.num_attention_heads, v4.head_dim
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, heads, dim
        self.num_layers = config.num_layers
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
            window_row, rate = v4.window_row, v4.compress_rate(layer_idx)
            overlap = self.kind == CSA
            self.compressor = Compressor(
                hidden, dim, rate, overlap, config.rms_norm_eps, self.rotary,
                window_row.pool_kv, window_row.pool_width, v4.entry_row.entries(self.kind),
            )  # fmt: skip
            if overlap:
                self.indexer = LightningIndexer(config, v4, self.rotary, rate)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext):
        """positions [T], x [T, H] -> [T, H]; writes the tokens' rows into the caches."""
        attn, cache = ctx.attn, ctx.kv_caches[self.layer_idx]
        window_cache = ctx.kv_caches[self.num_layers + self.layer_idx]
        rows = cache.view(-1, cache.shape[-1])  # [slots, Wm]
        window_rows = window_cache.view(-1, window_cache.shape[-1])  # [window slots, Ww]
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        q_resid = self.q_norm(self.wq_a(x))
        queries = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        queries = self.rotary.rotate(unweighted_rms_norm(queries, self.eps), cos_sin)
        key = self.rotary.rotate(self.norm(self.wkv(x)), cos_sin)  # [T, D]
        ops.v4_write_rows(window_rows, attn.window_slot_mapping, key, 0)
        seq_ids = token_seq_ids(attn)
        spread, entry_list, most = None, None, 0
        if self.compressor is not None:
            self.compressor(x, positions, seq_ids, attn, window_rows, rows)
            spread = self.compressor.spread_args
            if self.indexer is not None:
                entry_list = self.indexer(x, q_resid, positions, seq_ids, attn, window_cache,
                                          cache, cos_sin)  # fmt: skip
            else:  # every entry it has reached
                most = context_bound(attn) // self.compressor.rate
        out = ops.v4_attention(
            queries.contiguous(),
            window_cache,
            attn.window_tables,
            cache,
            attn.block_tables,
            seq_ids,
            positions,
            self.window,
            spread,
            entry_list,
            most,
            self.attn_sink,
            self.scale,
            context_bound(attn),
        )  # fmt: skip  [T, N, D]
        out = self.rotary.rotate(out, cos_sin, inverse=True)
        grouped = out.reshape(out.shape[0], self.groups, -1)  # [T, G, N * D / G]
        weight = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [G, r, N * D / G]
        mixed = torch.einsum("tgi,gri->tgr", grouped, weight).flatten(1)  # [T, G * r]
        return self.wo_b(mixed)
