"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA whose queries attend to chosen tokens.

A lightning indexer scores every earlier token for each query (kernels/dsa/dsa_indexer.py) and
the query attends, in absorbed form, to the `index_topk` best (kernels/dsa/sparse_mla.py):
attention cost grows with context x index_topk rather than context squared. The indexer key of
every token is cached after its latent, `[c_kv | k_pe | index key]`, written in the same step.

Where a query sees no more than `index_topk` tokens it attends to all of them, so a new prompt
that short runs MLA's dense expanded prefill (same result, faster). A pure-decode step takes the
sparse path whatever its lengths, with its rows and context bound made without host lists, so
decode graphs capture it. GLM-5's "shared" layers run no indexer: they reuse the selection of
the last "full" layer before them, handed on through `ForwardContext.dsa_selection` (one
forward's rows, so the two-batch overlap's halves keep theirs).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from rayinfer.config import ModelConfig
from rayinfer.kernels import ops
from rayinfer.kernels.host_lists import device_ints
from rayinfer.layers.forward_context import AttentionMetadata, ForwardContext
from rayinfer.layers.linear import ReplicatedLinear
from rayinfer.layers.mla import MLAAttention
from rayinfer.layers.mlp import copy_checked
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.layers.rotary_yarn import DeepseekRotaryEmbedding

INDEXER_NORM_EPS = 1e-6  # the key's LayerNorm


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, computed in float32 (the indexer key's norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.weight.shape
        return nn.functional.layer_norm(x, shape, self.weight, self.bias, self.eps)


class LightningIndexer(nn.Module):
    """Per token: roped indexer queries [Hi, D] from the query LoRA, one roped key [D] from the
    hidden state, and per-head weights [Hi] in float32. Replicated on tensor-parallel ranks (it
    is small), so every rank picks the same tokens."""

    def __init__(self, config: ModelConfig, rotary: DeepseekRotaryEmbedding, interleaved: bool):
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, INDEXER_NORM_EPS)
        # float32 as in the checkpoints' reference (transformers keeps weights_proj in fp32)
        weight = torch.empty(self.num_heads, config.hidden_size, dtype=torch.float32)
        self.weights_proj = nn.Module()
        self.weights_proj.weight = nn.Parameter(weight, requires_grad=False)
        self.weights_proj.weight.weight_loader = copy_checked
        self.rotary = rotary  # MLA's: the same frequencies and attention factor
        self.interleaved = interleaved  # GLM-5 rotates pairs; DeepSeek-V3.2 halves
        # relu(s * x) = s * relu(x) for s > 0: both of the reference's scales fold into weights
        self.weight_scale = (self.num_heads**-0.5) * (self.head_dim**-0.5)

    def forward(self, positions, hidden, q_resid):
        """positions [T], hidden [T, H], q_resid [T, q_lora_rank] -> (queries [T, Hi, D],
        weights [T, Hi] float32, keys [T, D]); the first R columns of both roped."""
        queries = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        keys = self.k_norm(self.wk(hidden))  # [T, D]
        queries, keys = ops.rotary_embedding(
            positions, queries, keys[:, None, :], self.rotary.inv_freq, self.interleaved,
            self.rotary.attention_factor,
        )  # fmt: skip
        weights = hidden.float() @ self.weights_proj.weight.t()  # [T, Hi]
        return queries, weights * self.weight_scale, keys[:, 0]


class DSAAttention(MLAAttention):
    """MLA with DSA: see the module docstring."""

    attends_outside_graphs = False  # the indexer's selection runs inside the layer

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        parallel: ParallelContext = SINGLE,
        fp8: bool = False,
    ):
        super().__init__(config, layer_idx, parallel, fp8)
        self.index_topk = config.index_topk
        self.latent_width = self.kv_lora_rank + self.rope_dim  # the index key's column offset
        self.index_fp8 = config.index_keys_fp8  # keys cached as FP8 + scale (dsa_index_fp8)
        self.indexer = None
        if config.indexer_types[layer_idx] == "full":
            interleaved = config.architecture == "GlmMoeDsaForCausalLM"
            self.indexer = LightningIndexer(config, self.rotary_emb, interleaved)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext):
        """positions [T], hidden [T, H] -> [T, H]; writes the tokens' rows into the cache."""
        query, q_resid = self._query(hidden)  # [T, N, Dqk], [T, q_lora_rank]
        q_nope, q_pe = query.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self._latent(hidden)  # [T, L], [T, R]
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)  # [T, N, R], [T, R]
        kv_cache, attn = ctx.kv_caches[self.layer_idx], ctx.attn
        index = self.indexer(positions, hidden, q_resid) if self.indexer else None
        key = index[2] if index else None
        ops.dsa_write_cache(kv_cache, attn.slot_mapping, kv_c, k_pe, key, self.index_fp8)
        ctx.layer_cached(self.layer_idx)
        out = q_nope.new_empty(hidden.shape[0], self.num_local_heads, self.v_head_dim)
        dense = self._dense_seqs(attn)
        if len(dense) == attn.num_seqs:  # new prompts no longer than index_topk: dense
            bounds = (attn.query_start_loc, max(attn.query_lens_cpu))
            self._attend_expanded(q_nope, q_pe, kv_c, k_pe, out, bounds)
            return self.o_proj(out.flatten(1))
        starts = np.cumsum([0, *attn.query_lens_cpu])  # [B + 1]
        for seq in dense:
            rows = slice(starts[seq], starts[seq + 1])
            self._attend_expanded(q_nope[rows], q_pe[rows], kv_c[rows], k_pe[rows], out[rows])
        rows, query_seq = self._sparse_rows(attn, dense, hidden.device)
        slots = self._selection(index, rows, query_seq, positions, kv_cache, attn, ctx)
        self._attend_sparse(q_nope[rows], q_pe[rows], kv_cache, slots, out, rows)
        return self.o_proj(out.flatten(1))  # [T, H]

    def _dense_seqs(self, attn: AttentionMetadata) -> list[int]:
        """New prompts (no cached prefix) of at most index_topk tokens: every query of theirs
        attends to its whole context, which dense attention over the step's rows computes.
        Empty for a pure decode (what CUDA graphs replay: its path must not depend on lengths)."""
        if attn.is_pure_decode:
            return []
        return [
            i
            for i, (q, s) in enumerate(zip(attn.query_lens_cpu, attn.seq_lens_cpu))
            if q == s and s <= self.index_topk
        ]

    @staticmethod
    def _sparse_rows(attn: AttentionMetadata, dense: list[int], device):
        """The rows of every other sequence ([S] int64, or all rows as a slice) and the
        sequence each belongs to ([S] int32). A pure decode's are made on the device, with no
        host list, so a CUDA graph can capture them."""
        if attn.is_pure_decode:
            return slice(None), torch.arange(attn.num_seqs, dtype=torch.int32, device=device)
        lengths = np.asarray(attn.query_lens_cpu)
        seq_ids = np.repeat(np.arange(attn.num_seqs, dtype=np.int32), lengths)  # [T]
        if not dense:
            return slice(None), device_ints(torch.from_numpy(seq_ids), torch.int32, device)
        keep = ~np.isin(seq_ids, dense)
        rows = np.nonzero(keep)[0]
        return (
            device_ints(torch.from_numpy(rows), torch.int64, device),
            device_ints(torch.from_numpy(seq_ids[keep]), torch.int32, device),
        )

    def _selection(self, index, rows, query_seq, positions, kv_cache, attn, ctx):
        """[S, index_topk] int32 cache slots per sparse row: this layer's indexer, or (a
        "shared" layer) the last full layer's."""
        if index is None:
            return ctx.dsa_selection
        queries, weights, _ = index
        if attn.is_pure_decode:  # the tables' width: static in a CUDA graph (max_model_len)
            max_context = attn.block_tables.shape[1] * attn.block_size
        else:
            max_context = max(s for s, q in zip(attn.seq_lens_cpu, attn.query_lens_cpu) if q)
        ctx.dsa_selection = ops.dsa_index_topk(
            queries[rows], weights[rows], kv_cache, self.latent_width, attn.block_tables,
            query_seq, positions[rows], self.index_topk, max_context, self.index_fp8,
        )  # fmt: skip
        return ctx.dsa_selection

    def _attend_sparse(self, q_nope, q_pe, kv_cache, slots, out, rows) -> None:
        """q_nope [S, N, Dn], q_pe [S, N, R] over their slots -> out[rows] [S, N, Dv]."""
        w_uk, w_uv = self._kv_b_weights()  # [N, Dn, L], [N, Dv, L]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [S, N, L]
        latent_out = ops.sparse_mla_attention(q_latent, q_pe, kv_cache, slots, self.scale)
        out[rows] = torch.einsum("snl,nvl->snv", latent_out, w_uv)  # [S, N, Dv]
