"""Multi-head latent attention (DeepSeek V2/V3) over a paged cache of compressed latents.

Per token the cache holds only the normed latent c_kv [L] and the roped shared key k_pe [R]
(L = kv_lora_rank, R = qk_rope_head_dim), never per-head K/V. Two ways to attend:
- expanded (prefill chunks): K_nope and V of the whole context are rebuilt with kv_b_proj, then
  ordinary causal attention runs with K = [K_nope, k_pe] per head;
- absorbed (decode, one query per sequence): q_nope is folded through W_UK into latent space, the
  attention runs directly on the cached latents, and the latent output is mapped through W_UV.
  Both give the same result; `use_absorbed_decode = False` forces the expanded form everywhere.
Heads are split over tensor-parallel ranks (q/kv_b/o projections); the latent path is replicated.

With `fp8=True` (fp8_weights) q_a/q_b (or q), kv_a_proj_with_mqa and o_proj keep their FP8
block-scaled weights; kv_b_proj stays in the model dtype (the loader dequantizes it), because the
absorbed decode reads it as W_UK / W_UV in einsums, not through a GEMM with quantized activations.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from rayinfer.config import ModelConfig
from rayinfer.kernels import ops
from rayinfer.layers.forward_context import AttentionMetadata, ForwardContext
from rayinfer.layers.graph_pieces import attend_outside_graphs
from rayinfer.layers.layer_options import UsesKernelBackends
from rayinfer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from rayinfer.layers.mla_context import (
    CONTEXT_BLOCK_ELEMENTS,
    context_block_tokens,
    merge_attention,
)
from rayinfer.layers.norm import RMSNorm
from rayinfer.layers.parallel import SINGLE, ParallelContext, divide
from rayinfer.layers.rotary_yarn import DeepseekRotaryEmbedding, softmax_scale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps


class MLAAttention(UsesKernelBackends, nn.Module):
    use_absorbed_decode = True
    attends_outside_graphs = True  # a mixed step's forward may be captured in pieces
    # A chunk over a cached prefix whose expanded K_nope and V would pass this many elements
    # attends to the context in blocks of at most this many (layers/mla_context.py).
    context_block_elements: int = CONTEXT_BLOCK_ELEMENTS

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        parallel: ParallelContext = SINGLE,
        fp8: bool = False,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        self.num_local_heads = divide(num_heads, parallel.tp_size, "num_attention_heads")
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.qk_head_dim = self.nope_dim + self.rope_dim
        bias = config.attention_bias
        q_out = [num_heads * self.qk_head_dim]
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, fp8=fp8)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, q_out, parallel=parallel, fp8=fp8
            )
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_out, parallel=parallel, fp8=fp8)
        latent = self.kv_lora_rank + self.rope_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, latent, bias, fp8=fp8)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        kv_b_out = [num_heads * (self.nope_dim + self.v_head_dim)]
        # kv_b_proj stays in the model dtype even with fp8 (see the module docstring)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, kv_b_out, parallel=parallel)
        self.o_proj = RowParallelLinear(num_heads * self.v_head_dim, hidden, bias, parallel, fp8)
        # V2 always rotates interleaved pairs; V3 reads `rope_interleave` (default true)
        is_v2 = config.architecture == "DeepseekV2ForCausalLM"
        is_interleaved = is_v2 or bool(config.hf.get("rope_interleave", True))
        self.rotary_emb = DeepseekRotaryEmbedding(
            self.rope_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
            is_interleaved,
        )
        self.scale = softmax_scale(self.qk_head_dim, config.rope_scaling)

    def _query(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [T, H] -> (query [T, N, Dqk], the query LoRA's normed activations
        [T, q_lora_rank], which DSA's indexer reads; None without a query LoRA)."""
        q_resid = None
        if self.q_lora_rank:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        else:
            q = self.q_proj(hidden)
        return q.view(hidden.shape[0], self.num_local_heads, self.qk_head_dim), q_resid

    def _latent(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (normed latent kv_c [T, L], unroped shared key k_pe [T, R])."""
        latent = self.kv_a_proj_with_mqa(hidden)  # [T, L + R]
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(kv_c), k_pe  # the norm reads strided rows

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext):
        """positions [T], hidden [T, H] -> [T, H]; writes the tokens' latents into the cache."""
        query, _ = self._query(hidden)  # [T, N, Dqk]
        q_nope, q_pe = query.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self._latent(hidden)  # [T, L], [T, R]
        kv_cache = ctx.kv_caches[self.layer_idx]  # [num_blocks, block_size, L + R]
        q_pe, k_pe = self.rotary_emb.forward_and_cache(
            positions, q_pe, k_pe, kv_c, kv_cache, ctx.attn.slot_mapping
        )  # [T, N, R], [T, R]; (kv_c, k_pe) stored at the slots
        shape = (hidden.shape[0], self.num_local_heads, self.v_head_dim)
        # within pieces the padding rows' output stays zero (attention writes the real rows)
        out = q_nope.new_empty(shape) if ctx.pieces is None else q_nope.new_zeros(shape)
        operands = attend_outside_graphs(
            ctx, self._attend, q_nope, q_pe, kv_c, k_pe, out, layer=self.layer_idx
        )
        return self.o_proj(operands[-1].flatten(1))  # [T, H]

    def _attend(self, ctx: ForwardContext, q_nope, q_pe, kv_c, k_pe, out) -> None:
        """The step's attention from its rotated queries q_nope [T, N, Dn], q_pe [T, N, R] and
        its tokens' latents kv_c [T, L], roped k_pe [T, R] (already cached) -> out [T, N, Dv]:
        decodes in absorbed form, prompt chunks expanded."""
        kv_cache = ctx.kv_caches[self.layer_idx]  # [num_blocks, block_size, L + R]
        attn = ctx.attn
        decode_seqs, prefill_seqs = self._split_batch(attn)
        if decode_seqs:
            self._attend_absorbed(q_nope, q_pe, kv_cache, attn, decode_seqs, out)
        fresh = {s for s in prefill_seqs if attn.seq_lens_cpu[s] == attn.query_lens_cpu[s]}
        if prefill_seqs and len(fresh) == attn.num_seqs:  # new prompts only: one varlen call
            bounds = (attn.query_start_loc, max(attn.query_lens_cpu))
            self._attend_expanded(q_nope, q_pe, kv_c, k_pe, out, bounds)
        elif prefill_seqs:
            queries = (q_nope, q_pe)
            self._attend_chunks(queries, kv_c, k_pe, kv_cache, attn, prefill_seqs, fresh, out)

    def _attend_chunks(self, queries, kv_c, k_pe, kv_cache, attn, seqs, fresh, out) -> None:
        """The expanded form one sequence at a time: a new prompt's context is its own rows; a
        chunk over a cached prefix reads its whole context back from the cache, or, where that
        would expand past context_block_elements, attends to it in blocks."""
        starts = list(accumulate(attn.query_lens_cpu, initial=0))  # [B + 1]
        q_nope, q_pe = queries
        block_tokens = self._context_block_tokens(kv_cache.shape[1])
        for seq in seqs:
            rows = slice(starts[seq], starts[seq + 1])
            own = (q_nope[rows], q_pe[rows], kv_c[rows], k_pe[rows])
            if seq in fresh:
                self._attend_expanded(*own, out[rows])
                continue
            table, seq_len = attn.block_tables[seq], attn.seq_lens_cpu[seq]
            if seq_len > block_tokens:
                self._attend_long_context(own, kv_cache, table, seq_len, block_tokens, out[rows])
                continue
            latents = self._cached_latents(kv_cache, table, 0, seq_len, q_nope.dtype)
            self._attend_expanded(q_nope[rows], q_pe[rows], *latents, out[rows])

    def _context_block_tokens(self, block_size: int) -> int:
        """Context tokens expanded at once: whole cache blocks within context_block_elements."""
        width = self.nope_dim + self.v_head_dim
        return context_block_tokens(self.context_block_elements, self.num_local_heads, width,
                                    block_size)  # fmt: skip

    def _cached_latents(self, kv_cache, table, start: int, length: int, dtype):
        """Cached c_kv [length, L] and k_pe [length, R] of context positions start.. (start a
        multiple of the cache block size)."""
        first_block = start // kv_cache.shape[1]
        context = ops.mla_gather_context(kv_cache, table[first_block:], length).to(dtype)
        return context.split([self.kv_lora_rank, self.rope_dim], -1)

    def _attend_long_context(self, own, kv_cache, table, seq_len, block_tokens, out) -> None:
        """own: a chunk's (q_nope [q, N, Dn], q_pe [q, N, R], kv_c [q, L], k_pe [q, R]), the last
        q of seq_len tokens -> out [q, N, Dv]. Causal over its own rows, then over the cached
        prefix block_tokens at a time (every key visible), merged in float32 by log-sum-exp:
        one block's expansion at a time, whatever seq_len."""
        q_nope, q_pe = own[:2]
        acc = out.new_empty(out.shape, dtype=torch.float32)  # [q, N, Dv]
        lse = acc.new_empty(out.shape[:2])  # [q, N]
        self._attend_expanded(*own, acc, lse=lse)
        part, part_lse = torch.empty_like(acc), torch.empty_like(lse)
        prefix_len = seq_len - q_nope.shape[0]
        for start in range(0, prefix_len, block_tokens):
            length = min(block_tokens, prefix_len - start)
            latents = self._cached_latents(kv_cache, table, start, length, q_nope.dtype)
            self._attend_expanded(q_nope, q_pe, *latents, part, is_causal=False, lse=part_lse)
            merge_attention(acc, lse, part, part_lse)
        out.copy_(acc)

    def _split_batch(self, attn: AttentionMetadata) -> tuple[list[int], list[int]]:
        """Sequences attended in absorbed form (one new token) and in expanded form (the rest)."""
        if not self.use_absorbed_decode:
            return [], list(range(attn.num_seqs))
        decode = [i for i, n in enumerate(attn.query_lens_cpu) if n == 1]
        prefill = [i for i, n in enumerate(attn.query_lens_cpu) if n > 1]
        return decode, prefill

    def _kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [N, Dnope, L] and W_UV [N, Dv, L]."""
        per_head = self.kv_b_proj.weight.view(self.num_local_heads, -1, self.kv_lora_rank)
        return per_head.split([self.nope_dim, self.v_head_dim], dim=1)

    def _attend_expanded(self, q_nope, q_pe, kv_c, k_pe, out: torch.Tensor, bounds=None,
                         is_causal: bool = True, lse: torch.Tensor | None = None):  # fmt: skip
        """Query rows q_nope [q, N, Dn] and rotated q_pe [q, N, R] over their context's latents
        kv_c [s, L] and roped k_pe [s, R] -> out [q, N, Dv] (written): the last q of one
        sequence's s tokens, or, with bounds (cu_seqlens [B + 1] int32 on the device, longest),
        several new prompts whose context is their own rows (q = s), in one varlen call that
        reads no host list. Keys are never assembled: K_nope and V stay views of kv_b's output,
        the rope columns stay apart (the H200's kernel reads each where it lies). is_causal
        False (a block of earlier context: every key visible) and lse [q, N] float32 (written)
        serve _attend_long_context."""
        kv = self.kv_b_proj(kv_c).view(-1, self.num_local_heads, self.nope_dim + self.v_head_dim)
        k_nope, value = kv.split([self.nope_dim, self.v_head_dim], dim=-1)  # [s, N, *]
        rope_key = k_pe[:, None, :]  # [s, 1, R]: one per token, shared by the heads
        ops.mla_prefill_attention(q_nope, q_pe, k_nope, rope_key, value, self.scale, out, bounds,
                                  is_causal, lse, backends=self.kernels)  # fmt: skip

    def _attend_absorbed(self, q_nope, q_pe, kv_cache, attn, seqs: list[int], out: torch.Tensor):
        """A pure-decode batch takes every row as it is, with the device context lengths: no
        host-to-device copy and no shape from data, so a CUDA graph can capture it."""
        if len(seqs) == attn.num_seqs:
            rows, tables, seq_lens = slice(None), attn.block_tables, attn.seq_lens
        else:
            rows, tables, seq_lens = decode_subset(attn, seqs)
        w_uk, w_uv = self._kv_b_weights()
        # [B, N, L] with each sequence's heads one row apart, what the Gluon decode kernel's
        # TMA view needs: bmm writes its [N, B, L] result through the transposed view (an
        # einsum returns [N, B, L] storage, which the kernel's launcher would copy).
        q_nope_rows = q_nope[rows]
        q_latent = q_nope_rows.new_empty(q_nope_rows.shape[0], w_uk.shape[0], w_uk.shape[2])
        torch.bmm(q_nope_rows.transpose(0, 1), w_uk, out=q_latent.transpose(0, 1))
        latent_out = ops.mla_decode_attention(
            q_latent, q_pe[rows], kv_cache, tables, seq_lens, self.scale, backends=self.kernels
        )  # [B, N, L]
        out[rows] = torch.einsum("bnl,nvl->bnv", latent_out, w_uv)  # [B, N, Dv]


def decode_subset(attn: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, ...]:
    """The decodes of a mixed batch: their rows [B] int64 (each sequence's single query), block
    tables [B, W] and device context lengths [B], made once per step (one host-to-device copy)
    for every layer."""
    subset = attn.derived.get("mla_decode_subset")
    if subset is None:
        index = torch.tensor(seqs, dtype=torch.int64).to(attn.seq_lens.device)
        rows = attn.query_start_loc[index].long()
        subset = attn.derived["mla_decode_subset"] = (
            rows,
            attn.block_tables[index],
            attn.seq_lens[index],
        )
    return subset
