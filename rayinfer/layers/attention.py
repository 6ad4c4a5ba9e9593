"""GQA attention over the paged K/V cache, for batches that mix prefill chunks and decodes.

The layer's cache is `[num_blocks, block_size, 2, num_kv_heads, head_dim]` (index 0 holds K, 1
holds V). Each step first writes the new tokens' K/V at `slot_mapping`, then every query attends
causally to its sequence's whole context read back through the block table.
"""

from __future__ import annotations

import torch
from torch import nn

from rayinfer.kernels import ops
from rayinfer.layers.forward_context import ForwardContext
from rayinfer.layers.graph_pieces import attend_outside_graphs
from rayinfer.layers.layer_options import UsesKernelBackends
from rayinfer.layers.rotary import RotaryEmbedding


class PagedAttention(UsesKernelBackends, nn.Module):
    attends_outside_graphs = True  # a mixed step's forward may be captured in pieces

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, layer_idx: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        ctx: ForwardContext,
        positions: torch.Tensor | None = None,  # [T]: given with `rotary`, q and k are unrotated
        rotary: RotaryEmbedding | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """With `rotary`, RoPE and the cache write run as one op (one launch on CUDA; on CPU the
        same math as rotating first, then `forward` without it)."""
        kv_cache = ctx.kv_caches[self.layer_idx]  # [num_blocks, block_size, 2, Hkv, D]
        expected = (2, self.num_kv_heads, self.head_dim)
        if tuple(kv_cache.shape[2:]) != expected:
            raise ValueError(
                f"kv_caches[{self.layer_idx}] has per-token shape {tuple(kv_cache.shape[2:])}, "
                f"expected {expected}; allocate it with ModelConfig.kv_shape_per_token"
            )
        attn = ctx.attn
        if rotary is None:
            ops.reshape_and_cache(k, v, kv_cache, attn.slot_mapping)
        else:
            q, k = ops.rotary_embedding_and_cache(
                positions, q, k, rotary.inv_freq, kv_cache, attn.slot_mapping, v,
                False, rotary.attention_factor,
            )  # fmt: skip
        if ctx.pieces is None:
            out = self._attention(ctx, q, k, v)
            ctx.layer_cached(self.layer_idx)
            return out
        operands = attend_outside_graphs(
            ctx, self._attend, q, k, v, q.new_zeros(q.shape), layer=self.layer_idx
        )
        return operands[-1]

    def _attend(self, ctx: ForwardContext, q, k, v, out) -> None:
        """_attention into out [T, Hq, D] (a forward in pieces)."""
        out.copy_(self._attention(ctx, q, k, v))

    def _attention(self, ctx: ForwardContext, q, k, v) -> torch.Tensor:
        """Every query over its context: q [T, Hq, D] (rotated), k, v [T, Hkv, D] (cached) ->
        [T, Hq, D]."""
        attn = ctx.attn
        # The step's own (rotated) K/V go along: chunks without a cached prefix attend to them
        # directly rather than through the block tables.
        return ops.paged_attention(
            q,
            ctx.kv_caches[self.layer_idx],
            attn.block_tables,
            attn.seq_lens,
            attn.query_start_loc,
            self.scale,
            query_lens_cpu=attn.query_lens_cpu,
            seq_lens_cpu=attn.seq_lens_cpu,
            new_kv=(k, v),
            backends=self.kernels,
        )
