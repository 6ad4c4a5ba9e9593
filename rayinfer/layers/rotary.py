"""Rotary position embedding (neox style: the head's two halves rotate together).

Scalings of Llama/Qwen configs: `default`, `linear` (positions divided by `factor`), `llama3`
(low frequencies divided by `factor`, a smooth ramp between) and `yarn` (frequencies from
`rotary_yarn.yarn_inv_freq`, cos/sin times its attention factor). cos/sin are computed from the
positions of the step, so no table of `max_position_embeddings` rows is kept. `dynamic` NTK is not
supported: transformers rescales it by the longest sequence of the batch, which a paged batch of
unrelated requests cannot reproduce.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rayinfer.kernels import ops
from rayinfer.layers.rotary_yarn import yarn_inv_freq

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:  # [rotary_dim / 2] float32
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def scaled_inv_freq(
    rotary_dim: int, base: float, scaling: dict | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [rotary_dim / 2] float32, factor applied to cos and sin)."""
    inv_freq = default_inv_freq(rotary_dim, base)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return yarn_inv_freq(rotary_dim, base, scaling, max_position)
    raise ValueError(
        f"rope_scaling rope_type={rope_type!r} is not supported by RotaryEmbedding; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of every head of q and k by the token's position."""

    def __init__(
        self,
        head_dim: int,
        base: float,
        scaling: dict | None = None,
        rotary_dim: int | None = None,
        max_position: int = 4096,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, self.attention_factor = scaled_inv_freq(
            self.rotary_dim, base, scaling, max_position
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [rotary_dim / 2] float32

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k). Neox pairs (x_i,
        x_{i+R/2}); the op's CPU reference is this layer's former math bit for bit
        (tests/kernels/test_rotary.py); on CUDA it is one Triton launch."""
        return ops.rotary_embedding(positions, q, k, self.inv_freq, False, self.attention_factor)


def rotary_from_config(config) -> RotaryEmbedding:
    """The rotary embedding of a Llama-family `ModelConfig` (every head feature rotates)."""
    return RotaryEmbedding(
        config.head_dim,
        config.rope_theta,
        config.rope_scaling,
        max_position=config.max_position_embeddings,
    )
