"""DeepSeek's decoupled rotary embedding: plain or YaRN-scaled, interleaved or neox layout.

DeepSeek rotates only the `qk_rope_head_dim` part of each query head and the one shared rope key.
- Layout: with `rope_interleave` (DeepSeek-V2 always, V3 by default) the rotated pairs are
  (x0, x1), (x2, x3), ...; the result is written de-interleaved (all pair firsts, then all pair
  seconds) as transformers' V3 does. Any fixed permutation of q and k alike leaves q.k unchanged,
  so this also matches V2's interleaved output. Without it, pairs are (x_i, x_{i+D/2}) (neox).
- YaRN (`rope_type: yarn`): frequencies blend interpolation (divided by `factor`) and extrapolation
  over a linear ramp between the `beta_fast`/`beta_slow` correction dimensions; cos and sin are
  multiplied by `attention_factor` (mscale / mscale_all_dim); and the softmax scale gains
  mscale(factor, mscale_all_dim)^2 (see `softmax_scale`). Formulas follow transformers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rayinfer.kernels import ops

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim."""
    scale = qk_head_dim**-0.5
    mscale_all_dim = (scaling or {}).get("mscale_all_dim")
    if scaling and scaling.get("rope_type", "default") != "default" and mscale_all_dim:
        scale *= yarn_mscale(scaling["factor"], mscale_all_dim) ** 2
    return scale


def _correction_dim(num_rotations: float, dim: int, base: float, original_max: int) -> float:
    return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(
    dim: int, base: float, scaling: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim / 2] float32, attention_factor for cos and sin)."""
    original_max = scaling.get("original_max_position_embeddings") or max_position
    factor = scaling.get("factor") or max_position / original_max
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    low = _correction_dim(beta_fast, dim, base, original_max)
    high = _correction_dim(beta_slow, dim, base, original_max)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [dim / 2]
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class DeepseekRotaryEmbedding(nn.Module):
    """Rotates q_pe [T, N, D] and k_pe [T, D] by each token's position."""

    def __init__(
        self,
        rotary_dim: int,
        base: float,
        scaling: dict | None,
        max_position: int,
        is_interleaved: bool,
    ):
        super().__init__()
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling rope_type={rope_type!r} is not supported for DeepSeek; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "yarn":
            inv_freq, self.attention_factor = yarn_inv_freq(rotary_dim, base, scaling, max_position)
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
            self.attention_factor = 1.0
        self.is_interleaved = is_interleaved
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D / 2] float32

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor):
        """positions [T]; q_pe [T, N, D]; k_pe [T, D] -> rotated (q_pe, k_pe), same shapes."""
        q_pe, k_pe = ops.rotary_embedding(
            positions, q_pe, k_pe[:, None, :], self.inv_freq, self.is_interleaved,
            self.attention_factor,
        )  # fmt: skip
        return q_pe, k_pe[:, 0]

    def forward_and_cache(self, positions, q_pe, k_pe, kv_c, kv_cache, slot_mapping):
        """Like forward, and stores (kv_c [T, L], rotated k_pe) at slot_mapping in one launch."""
        q_pe, k_pe = ops.rotary_embedding_and_cache(
            positions, q_pe, k_pe[:, None, :], self.inv_freq, kv_cache, slot_mapping, kv_c,
            self.is_interleaved, self.attention_factor,
        )  # fmt: skip
        return q_pe, k_pe[:, 0]
