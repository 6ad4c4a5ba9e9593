"""DeepSeek-V4's RoPE: interleaved pairs on the trailing `rope_dim` columns of each head.

Two frequency sets: "main" (plain, rope_theta) for sliding-window layers, "compress"
(compress_rope_theta, YaRN in V4-Flash, cos and sin unscaled) for compressed layers, their
compressors and indexers. The attention output's rope columns are rotated back at the query's
position (`inverse=True`), since the values are the roped keys.
"""

from __future__ import annotations

import torch
from torch import nn

from rayinfer.layers.rotary_yarn import yarn_inv_freq


def rope_inv_freq(params: dict, rope_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """A rope_parameters entry -> (inv_freq [rope_dim / 2] float32, cos/sin factor)."""
    base = float(params["rope_theta"])
    if params.get("rope_type", "default") == "yarn":
        return yarn_inv_freq(rope_dim, base, params, max_position)
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    return 1.0 / (base**exponents), 1.0


class V4Rotary(nn.Module):
    def __init__(self, params: dict, rope_dim: int, max_position: int):
        super().__init__()
        inv_freq, self.factor = rope_inv_freq(params, rope_dim, max_position)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_dim = rope_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] -> cos, sin [T, R / 2] in `dtype` (transformers rounds them so)."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)

    def rotate(self, x: torch.Tensor, cos_sin, inverse: bool = False) -> torch.Tensor:
        """x [T, ..., D] with cos, sin [T, R / 2] -> x with its last R columns rotated."""
        cos, sin = cos_sin
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.reshape(shape).float(), sin.reshape(shape).float()
        if inverse:
            sin = -sin
        rope = x[..., -self.rope_dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
        return torch.cat([x[..., : -self.rope_dim], rotated.flatten(-2).to(x.dtype)], dim=-1)
