"""Every layer's cache rows at a request's slots, to or from one packed buffer, in one launch:
the KV hand-off's gather (export) and scatter (import) around its one host <-> device copy.

One kernel for all layers rather than an index op per layer: beside a busy GPU each launch
waits for room on the SMs, and a V2-Lite request's 27 per-layer scatters took 15.7 ms where its
host copy took 2.2 (`python benchmarks/handoff_copy_engines.py`, H100, matmuls on another stream).

The packed buffer holds the layers back to back, layer l as [num_tokens, its row] (the hand-off
chunk's layout, workers/runner/kv_transfer.layer_rows); layers may have rows of different widths.
"""

from __future__ import annotations

import math

import torch

from rayinfer.kernels.triton_compat import tl, triton

# Tokens per program (x the layers in the grid's second axis) and row units per load: a
# program moves 16 rows of at most 64 units per loop iteration.
BLOCK_TOKENS = 16
BLOCK_UNITS = 64


def cache_rows_reference(
    layers: list[torch.Tensor],  # per layer [num_slots, its row bytes] uint8
    packed: torch.Tensor,  # [num_tokens * sum(row bytes)] uint8, layer-major
    slots: torch.Tensor,  # [num_tokens] int64
    to_cache: bool,
) -> None:
    """packed -> each layer's rows at `slots` (to_cache), or those rows -> packed."""
    num_tokens, begin = slots.shape[0], 0
    for rows in layers:
        width = rows.shape[1]
        part = packed[begin : begin + num_tokens * width].view(num_tokens, width)
        if to_cache:
            rows.index_copy_(0, slots, part)
        else:
            torch.index_select(rows, 0, slots, out=part)
        begin += num_tokens * width


@triton.jit
def _cache_rows_kernel(
    base_ptr, layer_offsets_ptr, widths_ptr, packed_ptr, packed_starts_ptr, slots_ptr,
    num_tokens,
    TO_CACHE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr,
):  # fmt: skip
    """BLOCK_T tokens of one layer. base_ptr: layer 0's rows, each layer's at layer_offsets
    units from it; widths: units per row; packed_starts: units per token before the layer."""
    layer = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    is_token = tokens < num_tokens
    width = tl.load(widths_ptr + layer).to(tl.int64)
    layer_base = base_ptr + tl.load(layer_offsets_ptr + layer)
    packed_base = packed_ptr + tl.load(packed_starts_ptr + layer) * num_tokens
    slots = tl.load(slots_ptr + tokens, mask=is_token, other=0).to(tl.int64)
    cache_rows = layer_base + slots * width  # [BLOCK_T] pointers
    packed_rows = packed_base + tokens.to(tl.int64) * width
    for start in range(0, width, BLOCK_U):
        units = start + tl.arange(0, BLOCK_U)  # [BLOCK_U]
        mask = is_token[:, None] & (units[None, :] < width)
        if TO_CACHE:
            values = tl.load(packed_rows[:, None] + units[None, :], mask=mask)
            tl.store(cache_rows[:, None] + units[None, :], values, mask=mask)
        else:
            values = tl.load(cache_rows[:, None] + units[None, :], mask=mask)
            tl.store(packed_rows[:, None] + units[None, :], values, mask=mask)


class CacheRowsTable:
    """Per-layer rows as one kernel reads them: the widest unit (8, 4, 2 or 1 bytes) that every
    row width and every layer's address divide, and the layers' offsets in that unit."""

    def __init__(self, layers: list[torch.Tensor]):
        """layers: per layer [num_slots, row bytes] uint8 views of one device's cache."""
        widths = [rows.shape[1] for rows in layers]
        addresses = [rows.data_ptr() for rows in layers]
        common = math.gcd(*widths, *(address - addresses[0] for address in addresses), 8)
        self.unit = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(common, torch.uint8)
        self.unit_bytes = self.unit.itemsize
        self.layers = layers
        self.base = layers[0].view(self.unit)
        device = layers[0].device
        unit = self.unit_bytes
        offsets = [(address - addresses[0]) // unit for address in addresses]
        starts = [sum(widths[:layer]) // unit for layer in range(len(widths))]
        self.layer_offsets = torch.tensor(offsets, dtype=torch.int64, device=device)
        self.widths = torch.tensor([w // unit for w in widths], dtype=torch.int32, device=device)
        self.packed_starts = torch.tensor(starts, dtype=torch.int64, device=device)


def cache_rows(
    table: CacheRowsTable,
    packed: torch.Tensor,  # [num_tokens * sum(row bytes)] uint8 on the cache's device
    slots: torch.Tensor,  # [num_tokens] int64 on the cache's device
    to_cache: bool,
) -> None:
    """packed -> every layer's rows at `slots` (to_cache), or those rows -> packed; one launch."""
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    if packed.data_ptr() % table.unit_bytes:
        cache_rows_reference(table.layers, packed, slots, to_cache)
        return
    grid = (triton.cdiv(num_tokens, BLOCK_TOKENS), len(table.layers))
    _cache_rows_kernel[grid](
        table.base, table.layer_offsets, table.widths, packed.view(table.unit),
        table.packed_starts, slots, num_tokens,
        TO_CACHE=to_cache, BLOCK_T=BLOCK_TOKENS, BLOCK_U=BLOCK_UNITS,
    )  # fmt: skip
