"""A request's KV as it travels between engines: the payload, its fetch, the slot arithmetic (the
hand-off that names it to the other engine: engine/kv_handoff.py).

The packed form is layout-free: per token, every layer's cache row
(ModelConfig.kv_shapes_per_layer: layers may differ, as DeepSeek-V4's layer types and DSA's
layers without an indexer key do), so a cache with a different block size (or a different
parallel plan) can take it. It travels in chunks of tokens, each one flat uint8 array holding
the layers back to back, layer l as [chunk_tokens, its row bytes] (`layer_rows`; with one width
for all, the bytes of a [num_layers, chunk_tokens, row_bytes] array), so a long prompt's KV
streams through small staging buffers (workers/runner/kv_copy.py) instead of being held whole in
pinned memory, and carries no padding: DeepSeek-V4-Flash's 6,584 bytes per token in bf16, not 43
rows as wide as the widest (13,760).
On one node the chunks may instead lie in the exporter's shared-memory arena
(workers/runner/kv_arena.py): the payload then names its span (`arena`) and carries no chunks
until the importer maps them (`arena_chunks`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass
class KVPayload:
    """The KV of one request plus its sampler state, as one worker exports it.

    `chunks` are numpy arrays in memory (Ray stores numpy buffers out of band and reads them back
    without a copy, where torch tensors are pickled: benchmarks/object_store_payload.py), or, in
    the object-store form a worker returns, ObjectRefs to them (each put by the worker, which
    owns it). In the arena form, `chunks` is empty and `arena` names the span holding them,
    back to back in chunks of `arena_chunk_tokens` tokens (the last one shorter); an importer
    on that node fills `chunks` with uint8 tensor views of its mapping. `kv` gives per-layer
    torch views.
    """

    chunks: list[Any]  # per chunk of tokens: [chunk_tokens x token_bytes] uint8 (layer_rows)
    num_layers: int
    shape: tuple[int, ...]  # [num_tokens, *kv_shape_on_this_rank] of the widest layer
    dtype: torch.dtype
    generator_state: torch.Tensor | None  # uint8 state of the request's sampling generator
    kv_heads: tuple[int, int] | None = None  # (first, count) of the K/V heads held; None: all
    timings: dict[str, Any] = field(default_factory=dict)  # seconds: how the export went
    arena: Any = None  # kv_arena.ArenaSpan holding the chunks (the same-node path); else None
    arena_chunk_tokens: int = 0  # tokens per chunk in the arena
    # A cache with a window pool (engine/block_manager.py): the window state of the last
    # tokens (num_tokens - window.num_tokens on), in memory, one chunk; None for others.
    window: KVPayload | None = None
    # Per layer its kv_shape where layers differ; None: every layer's is shape[1:].
    layer_shapes: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def from_tensors(cls, kv: list[torch.Tensor], **fields) -> KVPayload:
        """kv: per layer [num_tokens, *its shape] CPU tensors of one dtype (one chunk)."""
        chunk = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in kv]).numpy()
        shape = max((tuple(t.shape) for t in kv), key=math.prod)
        layer_shapes = layer_shapes_of([tuple(t.shape[1:]) for t in kv])
        return cls([chunk], len(kv), shape, kv[0].dtype, layer_shapes=layer_shapes, **fields)

    @property
    def num_tokens(self) -> int:
        return self.shape[0]

    @property
    def kv_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per layer the shape of one token's row."""
        return self.layer_shapes or (tuple(self.shape[1:]),) * self.num_layers

    @property
    def layer_row_bytes(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) * self.dtype.itemsize for shape in self.kv_shapes)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over every layer: what the hand-off carries per token."""
        return sum(self.layer_row_bytes)

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.token_bytes

    def with_chunks(self, chunks: list[Any]) -> KVPayload:
        return replace(self, chunks=chunks)

    @property
    def kv(self) -> list[torch.Tensor]:
        """Per layer [num_tokens, *its shape] tensors (views of a single chunk; read-only)."""
        chunks = [layer_rows(_as_tensor(chunk), self.layer_row_bytes) for chunk in self.chunks]
        layers = chunks[0] if len(chunks) == 1 else [torch.cat(parts) for parts in zip(*chunks)]
        return [rows.view(self.dtype).reshape(self.num_tokens, *shape)
                for rows, shape in zip(layers, self.kv_shapes)]  # fmt: skip


def layer_rows(chunk: torch.Tensor, row_bytes: tuple[int, ...]) -> list[torch.Tensor]:
    """A chunk's layers: [tokens x sum(row_bytes)] uint8 (any shape, contiguous) -> per layer a
    [tokens, row_bytes[layer]] view, the layers back to back."""
    flat = chunk.reshape(-1)
    num_tokens = flat.numel() // sum(row_bytes)
    views, begin = [], 0
    for width in row_bytes:
        views.append(flat[begin : begin + num_tokens * width].view(num_tokens, width))
        begin += num_tokens * width
    return views


def arena_chunks(memory: torch.Tensor, payload: KVPayload) -> list[torch.Tensor]:
    """The payload's chunks in its arena span: [span bytes] uint8 -> per chunk a contiguous
    [tokens x token_bytes] view, back to back (what the exporter writes and the importer
    reads)."""
    chunks, begin = [], 0
    step = payload.arena_chunk_tokens
    for start in range(0, payload.num_tokens, step):
        size = min(step, payload.num_tokens - start) * payload.token_bytes
        chunks.append(memory[begin : begin + size])
        begin += size
    return chunks


def _as_tensor(chunk) -> torch.Tensor:
    """A chunk (a tensor, or numpy, possibly a read-only object-store buffer) as a tensor."""
    if isinstance(chunk, torch.Tensor):
        return chunk
    with warnings.catch_warnings():  # buffers read from the object store are not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(chunk)


def token_slots(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """[num_tokens] int64 cache slots of a sequence's first num_tokens tokens."""
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_table, dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


def pack_kv(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """Gather the tokens at `slots` from each layer cache into CPU tensors (the reference the
    chunked copies of workers/runner/kv_copy.py are tested against)."""
    packed = []
    for cache in kv_caches:
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, *kv_shape]
        packed.append(flat[slots.to(cache.device)].cpu())
    return packed


def widest_row(kv_caches: list[torch.Tensor]) -> tuple[int, ...]:
    """The widest per-token shape of these caches' layers."""
    return max((tuple(cache.shape[2:]) for cache in kv_caches), key=math.prod)


def layer_shapes_of(shapes: list[tuple[int, ...]]) -> tuple[tuple[int, ...], ...] | None:
    """Per layer the shape of one token's row, where layers differ; None where they do not
    (KVPayload.layer_shapes)."""
    shapes = tuple(tuple(shape) for shape in shapes)
    return shapes if len(set(shapes)) > 1 else None


def check_layout(kv_caches: list[torch.Tensor], kv_shapes: tuple[tuple[int, ...], ...]) -> None:
    """ValueError unless a payload of these per-layer token shapes fits this cache."""
    if len(kv_shapes) != len(kv_caches):
        raise ValueError(
            f"KV hand-off has {len(kv_shapes)} layers, this cache has {len(kv_caches)}"
        )
    for layer, (shape, cache) in enumerate(zip(kv_shapes, kv_caches)):
        if tuple(shape) != tuple(cache.shape[2:]):
            raise ValueError(
                f"KV hand-off token shape {tuple(shape)} of layer {layer} does not match this "
                f"cache's {tuple(cache.shape[2:])}"
            )


def unpack_kv(kv_caches: list[torch.Tensor], slots: torch.Tensor, kv: list[torch.Tensor]) -> None:
    """Scatter packed tokens (per layer [num_tokens, *its shape]) into each layer cache at
    `slots`."""
    check_layout(kv_caches, tuple(tuple(layer_kv.shape[1:]) for layer_kv in kv))
    for cache, layer_kv in zip(kv_caches, kv):
        flat = cache.view(-1, *cache.shape[2:])
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


def payload_for_heads(payloads: list[KVPayload], heads: tuple[int, int] | None) -> KVPayload:
    """The one payload whose chunks a rank caching `heads` can copy as they are: a replicated
    payload, or one holding exactly those heads; else a payload merged from the others'
    heads (a different tensor-parallel split; one host copy)."""
    first = payloads[0]
    if heads is None or first.kv_heads is None:
        return first
    exact = next((p for p in payloads if p.kv_heads == heads), None)
    if exact is not None:
        return exact
    merged = select_kv_heads(payloads, heads)
    return KVPayload.from_tensors(merged, generator_state=first.generator_state, kv_heads=heads)


def fetch_payloads(
    shards: list[Any],
    wanted: Callable[[KVPayload], bool] = lambda payload: True,
    timeout_s: float | None = None,
) -> list[KVPayload]:
    """The `wanted` payloads with their chunks, from their object-store form (ObjectRefs to
    KVPayloads whose chunks are ObjectRefs; a local object is read without a copy). Raises
    what `ray.get` raises for an object that is gone."""
    import ray

    refs = [shard for shard in shards if isinstance(shard, ray.ObjectRef)]
    fetched = iter(ray.get(refs, timeout=timeout_s) if refs else [])
    headers = [next(fetched) if isinstance(s, ray.ObjectRef) else s for s in shards]
    payloads = []
    for header in filter(wanted, headers):
        if any(isinstance(chunk, ray.ObjectRef) for chunk in header.chunks):
            header = header.with_chunks(ray.get(header.chunks, timeout=timeout_s))
        payloads.append(header)
    return payloads
