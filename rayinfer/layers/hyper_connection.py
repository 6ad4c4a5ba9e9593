"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): `hc_mult` residual streams.

A V4 layer's residual is N = hc_mult streams per token, [T, N, H]. Before attention (and again
before the MoE) one HyperConnection reads all streams and makes three mixes: `pre` [T, N]
collapses the streams into the block's input, `post` [T, N] spreads the block's output back over
them, and `comb` [T, N, N], made doubly stochastic by Sinkhorn-Knopp iterations, mixes the
input streams into the output ones:

    streams' = post[..., None] * block(collapse(streams)) + comb^T @ streams

The mixes are computed in float32 from the RMS-normed streams (weights kept in float32, as in
transformers' `_keep_in_fp32_modules_strict`). HyperHead collapses the streams once more
before the final norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayinfer.layers.mlp import copy_checked


def _param(*shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    param.weight_loader = copy_checked
    return param


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x / rms(x), the scale computed in float32 and applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """`fn` [(2 + N) * N, N * H], `base` [(2 + N) * N], `scale` [3] (pre, post, comb)."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, eps: float,
                 norm_eps: float):  # fmt: skip
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.eps, self.norm_eps = (
            hc_mult, sinkhorn_iters, eps, norm_eps,
        )  # fmt: skip
        mixes = (2 + hc_mult) * hc_mult
        self.fn = _param(mixes, hc_mult * hidden_size)
        self.base = _param(mixes)
        self.scale = _param(3)

    def forward(self, streams: torch.Tensor):
        """streams [T, N, H] -> (post [T, N] f32, comb [T, N, N] f32, collapsed [T, H])."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)  # [T, (2 + N) * N]
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre * pre_scale + pre_base) + self.eps
        post = 2 * torch.sigmoid(post * post_scale + post_base)
        comb = comb.view(-1, n, n) * comb_scale + comb_base.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def merge_streams(streams, block_out, post, comb) -> torch.Tensor:
    """streams [T, N, H], block_out [T, H], post [T, N], comb [T, N, N] -> streams' [T, N, H]."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The final collapse: `fn` [N, N * H], `base` [N], `scale` [1]."""

    def __init__(self, hidden_size: int, hc_mult: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = _param(hc_mult, hc_mult * hidden_size)
        self.base = _param(hc_mult)
        self.scale = _param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:  # [T, N, H] -> [T, H]
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn) * self.scale + self.base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
