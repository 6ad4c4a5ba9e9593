"""Pack a request's KV out of the paged cache and unpack it into another cache.

The packed form is layout-free: per layer `[num_tokens, *ModelConfig.kv_shape_per_token(...)]`,
so a cache with a different block size (or, later, a different parallel plan) can take it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class KVPayload:
    """The KV of one request plus its sampler state, as one worker exports it.

    The layers travel as flat uint8 numpy arrays: Ray stores numpy buffers out of band and reads
    them back without a copy, where torch tensors are pickled (benchmarks/object_store_payload.py,
    256 MB on the 2-core CPU machine: put 3.4x and get 196x faster). `kv` gives torch views.
    """

    layer_bytes: list[np.ndarray]  # per layer, the [num_tokens, *shape] tensor's bytes (uint8)
    shape: tuple[int, ...]  # [num_tokens, *kv_shape_on_this_rank], the same for every layer
    dtype: torch.dtype
    generator_state: torch.Tensor | None  # uint8 state of the request's sampling generator
    kv_heads: tuple[int, int] | None = None  # (first, count) of the K/V heads held; None: all

    @classmethod
    def from_tensors(cls, kv: list[torch.Tensor], **fields) -> KVPayload:
        """kv: per layer [num_tokens, *shape] CPU tensors of one dtype."""
        layer_bytes = [t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in kv]
        return cls(layer_bytes, tuple(kv[0].shape), kv[0].dtype, **fields)

    @property
    def kv(self) -> list[torch.Tensor]:
        """Per layer [num_tokens, *shape] tensors viewing the payload's buffers (read-only)."""
        with warnings.catch_warnings():  # buffers read from the object store are not writable
            warnings.simplefilter("ignore", UserWarning)
            return [
                torch.from_numpy(raw).view(self.dtype).reshape(self.shape)
                for raw in self.layer_bytes
            ]

    @property
    def num_bytes(self) -> int:
        return sum(raw.nbytes for raw in self.layer_bytes)


@dataclass
class KVHandoff:
    """What prefill gives decode: the prompt, the first token and where the KV lives.

    `payload` is a KVPayload in-process, or an ObjectRef (per worker, a list) to one in the Ray
    object store; decode resolves it from its own workers.
    """

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    payload: Any  # None when the request already finished at its first token
    num_bytes: int = 0
    finish_reason: str | None = None  # set when there is nothing left to decode
    first_token_logprobs: Any = None  # outputs.TokenLogprobs when the request asked for them


def token_slots(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """[num_tokens] int64 cache slots of a sequence's first num_tokens tokens."""
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_table, dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


def pack_kv(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """Gather the tokens at `slots` from each layer cache into CPU tensors."""
    packed = []
    for cache in kv_caches:
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, *kv_shape]
        packed.append(flat[slots.to(cache.device)].cpu())
    return packed


def unpack_kv(kv_caches: list[torch.Tensor], slots: torch.Tensor, kv: list[torch.Tensor]) -> None:
    """Scatter packed tokens into each layer cache at `slots`."""
    if len(kv) != len(kv_caches):
        raise ValueError(f"KV hand-off has {len(kv)} layers, this cache has {len(kv_caches)}")
    for cache, layer_kv in zip(kv_caches, kv):
        flat = cache.view(-1, *cache.shape[2:])
        if tuple(layer_kv.shape[1:]) != tuple(flat.shape[1:]):
            raise ValueError(
                f"KV hand-off token shape {tuple(layer_kv.shape[1:])} does not match "
                f"this cache's {tuple(flat.shape[1:])}"
            )
        flat[slots.to(cache.device)] = layer_kv.to(device=cache.device, dtype=cache.dtype)


def select_kv_heads(payloads: list[KVPayload], heads: tuple[int, int] | None) -> list[torch.Tensor]:
    """Per layer [num_tokens, *shape] for the K/V heads (first, count) one rank needs, from the
    payloads of another plan's ranks (any head split; replicated payloads need no merging)."""
    if heads is None or payloads[0].kv_heads is None:
        return payloads[0].kv
    first, count = heads
    ordered = sorted({p.kv_heads: p for p in payloads}.values(), key=lambda p: p.kv_heads[0])
    covering = [p for p in ordered if p.kv_heads[0] < first + count and sum(p.kv_heads) > first]
    start = covering[0].kv_heads[0]
    layers_of = [p.kv for p in covering]  # per payload, per layer [N, 2, its heads, D]
    merged = []
    for layer_parts in zip(*layers_of):
        heads_dim = torch.cat(layer_parts, dim=2)  # [N, 2, covered heads, D]
        merged.append(heads_dim[:, :, first - start : first - start + count])
    return merged
