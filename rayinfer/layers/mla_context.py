"""Expanded MLA over a context too long to expand at once: bounded blocks, merged exactly.

MLA's expanded form rebuilds K_nope and V of every context token with kv_b_proj, [s, N, Dn + Dv]
per layer call: at DeepSeek-V2-Lite's 16 heads and a 1M-token context that is 4.3e9 elements
(8.6 GB in bf16) per 16k-token chunk, past the 2**31 elements that int32 offsets can index. A
chunk whose context would expand to more than `MLAAttention.context_block_elements` instead
attends to its own rows (causal), then to the cached prefix in blocks of `context_block_tokens`
tokens (every key visible to every query); each part gives outputs and their log-sum-exps,
folded together by `merge_attention` into the softmax over the whole context.
"""

from __future__ import annotations

import torch

# Elements of one block's K_nope and V [tokens, N, Dn + Dv]: 2 GiB in bf16, below 2**31 so that
# no kernel's int32 offsets reach the end of an operand. What a long-context chunk's attention
# holds at once is this block (plus its joined keys, 3/4 of it at MLA's 192/256 widths, on the
# Triton kernel) and two [q, N, Dv] float32 partial outputs, whatever the context length.
CONTEXT_BLOCK_ELEMENTS = 2**30


def context_block_tokens(block_elements: int, num_heads: int, head_width: int,
                         block_size: int) -> int:  # fmt: skip
    """Context tokens per block: whole cache blocks (at least one) whose expansion [tokens,
    num_heads, head_width] stays within block_elements."""
    tokens = block_elements // (num_heads * head_width)
    return max(block_size, tokens // block_size * block_size)


def merge_attention(
    out: torch.Tensor,  # [q, N, Dv] float32: attention over some keys; updated in place
    lse: torch.Tensor,  # [q, N] float32: its log-sum-exps; updated in place
    part: torch.Tensor,  # [q, N, Dv]: attention of the same queries over other keys
    part_lse: torch.Tensor,  # [q, N] float32
) -> None:
    """out, lse <- attention over both sets of keys: each side weighted by its share of the
    softmax sum, exp(lse_side - lse_both)."""
    merged = torch.logaddexp(lse, part_lse)  # [q, N]
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(part * torch.exp(part_lse - merged).unsqueeze(-1))
    lse.copy_(merged)
