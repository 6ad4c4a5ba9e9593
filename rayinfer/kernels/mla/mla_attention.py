"""Multi-head latent attention (MLA) over the paged latent cache.

The cache of one layer is `[num_blocks, block_size, L + R]`: per token the normed compressed latent
c_kv (L = kv_lora_rank) followed by the roped shared key k_pe (R = qk_rope_head_dim).

- `mla_write_cache`: store the new tokens' (c_kv, k_pe) at their slots.
- `mla_gather_context`: one sequence's cached rows, for the expanded (prefill) form.
- `mla_prefill_attention`: plain multi-head attention of each sequence's last q tokens over its
  s context tokens, with the 64 rope columns (shared by the heads on the key side) kept apart.
- `mla_decode_attention`: the absorbed form, attention computed in latent space. With q_nope
  absorbed through W_UK (q_latent = q_nope @ W_UK, [N, L]) the score of a context token is
  q_latent . c_kv + q_pe . k_pe, and the output is softmax . c_kv ([N, L]), which the caller maps
  through W_UV. No per-token K or V is ever materialised.

Here: the torch references and the expanded prefill (`mla_prefill_attention`, on the prefill
kernel). The absorbed decode lives in mla_decode (kernels in mla_decode_kernels), the cache write
in mla_cache; their names are importable from here too.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.attention.prefill_attention import (
    join_rope,
    prefill_attention,
    prefill_attention_reference,
)
from rayinfer.kernels.mla.mla_cache import (  # noqa: F401 (re-exported)
    mla_write_cache,
    mla_write_cache_reference,
)
from rayinfer.kernels.mla.mla_decode import (  # noqa: F401 (re-exported)
    mla_decode_attention,
    mla_decode_launches,
    mla_tma_fits,
)


def mla_gather_context_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_table: torch.Tensor,  # [max_blocks] int32, -1 padded
    seq_len: int,
) -> torch.Tensor:  # [seq_len, L + R]
    block_size = kv_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[block_table[:num_blocks].long()]  # [n, block_size, L + R]
    return blocks.flatten(0, 1)[:seq_len]


def mla_decode_attention_reference(
    q_latent: torch.Tensor,  # [B, N, L]: q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [B, N, R]: roped query rope part
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: list[int],  # [B] context length of each sequence, its new token included
    scale: float,
) -> torch.Tensor:  # [B, N, L]: attention output in latent space (before W_UV)
    latent_rank = q_latent.shape[-1]
    block_size = kv_cache.shape[1]
    lengths = torch.as_tensor(seq_lens, device=q_latent.device)  # [B]
    max_len = int(lengths.max()) if lengths.numel() else 0
    tables = block_tables[:, : -(-max_len // block_size)].long().clamp(min=0)  # [B, nb]
    context = kv_cache[tables].flatten(1, 2)[:, :max_len].to(q_latent.dtype)  # [B, S, L + R]
    kv_c, k_pe = context[..., :latent_rank], context[..., latent_rank:]  # [B, S, L], [B, S, R]
    scores = q_latent @ kv_c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)  # [B, N, S]
    is_context = torch.arange(max_len, device=q_latent.device) < lengths[:, None]  # [B, S]
    scores = (scores.float() * scale).masked_fill(~is_context[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv_c.dtype)  # [B, N, S]
    return probs @ kv_c  # [B, N, L]


def _bounds(length: int, device: torch.device) -> torch.Tensor:
    """[0, length] int32 on the device, made there by one kernel: no host copy, so neither a
    host sync nor a host buffer that a CUDA graph would replay."""
    return torch.arange(0, length + 1, max(length, 1), dtype=torch.int32, device=device)


def _sequence_bounds(q_nope, k_nope, bounds):
    """(cu_seqlens_q, cu_seqlens_k, longest query): the given varlen bounds (cu_seqlens, longest)
    for new prompts, or one sequence's last q of s tokens."""
    if bounds is not None:
        return bounds[0], bounds[0], bounds[1]
    cu_q, cu_k = (_bounds(t.shape[0], t.device) for t in (q_nope, k_nope))
    return cu_q, cu_k, q_nope.shape[0]


def mla_prefill_attention(
    q_nope: torch.Tensor,  # [q, N, Dn]
    q_pe: torch.Tensor,  # [q, N, R]: rotated
    k_nope: torch.Tensor,  # [s, N, Dn]: from kv_b_proj
    k_pe: torch.Tensor,  # [s, 1, R]: rotated, one per token, shared by the heads
    value: torch.Tensor,  # [s, N, Dv]
    scale: float,
    out: torch.Tensor,  # [q, N, Dv]: written in place (float32 for parts to be merged)
    bounds: tuple[torch.Tensor, int] | None = None,  # new prompts: (cu_seqlens [B + 1], longest)
    is_causal: bool = True,  # False: every query sees every key (a block of an earlier context)
    lse: torch.Tensor | None = None,  # [q, N] float32: each row's log-sum-exp, written if given
    backend: str = "auto",  # "triton" pins the Triton kernel (KernelBackends.prefill_attention)
) -> torch.Tensor:  # out
    """Expanded-form MLA prefill: each sequence's queries are the last of its context, causal.
    Without bounds one sequence (q <= s, or any q when not causal); with them several new
    prompts packed (q = s each), whose cu_seqlens are on the device (no host list, so a CUDA
    graph can capture it). The rope columns stay apart: the H200's kernel reads them where they
    lie. With lse, the parts of one context attended apart can be merged (the Triton kernel
    runs: the Gluon one writes no lse)."""
    cu_q, cu_k, longest = _sequence_bounds(q_nope, k_nope, bounds)
    dtype = q_nope.dtype
    return prefill_attention(q_nope, k_nope.to(dtype), value.to(dtype), cu_q, cu_k, longest,
                             scale, is_causal, query_rope=q_pe, key_rope=k_pe.to(dtype), out=out,
                             lse=lse, backend=backend)  # fmt: skip


def mla_prefill_attention_reference(q_nope, q_pe, k_nope, k_pe, value, scale, out, bounds=None,
                                    is_causal=True, lse=None):  # fmt: skip
    """The same contract in torch (joined query and key, SDPA per sequence)."""
    cu_q, cu_k, longest = _sequence_bounds(q_nope, k_nope, bounds)
    query, key = join_rope(q_nope, q_pe), join_rope(k_nope, k_pe)
    out.copy_(prefill_attention_reference(query, key, value, cu_q, cu_k, longest, scale,
                                          is_causal, lse))  # fmt: skip
    return out
