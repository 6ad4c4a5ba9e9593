"""Token embedding and the LM head, split over the vocabulary for tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayinfer.layers.parallel import SINGLE, ParallelContext


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.vocab_local = -(-vocab_size // parallel.tp_size)  # ceil: the last shard is padded
        self.vocab_start = parallel.tp_rank * self.vocab_local
        self.weight = nn.Parameter(torch.zeros(self.vocab_local, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.vocab_size:
            expected = (self.vocab_size, param.shape[1])
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, expected {expected}")
        local = loaded[self.vocab_start : self.vocab_start + self.vocab_local]
        param.data[: local.shape[0]].copy_(local)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.vocab_local)
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        self.parallel.tp_group.all_reduce(out)
        return out


class LMHead(VocabEmbedding):
    """Projects hidden states to logits over the full vocabulary (gathered across ranks)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        logits = F.linear(hidden, self.weight).float()
        if self.parallel.tp_size > 1:
            logits = self.parallel.tp_group.all_gather_concat(logits, dim=-1)
        return logits[:, : self.vocab_size]
