"""How many KV blocks fit on a GPU: vLLM's `gpu_memory_utilization`, for one worker.

After the weights are loaded, the runner runs one profiling step of the largest batch the
scheduler can form and measures its activation peak (`activation_peak_bytes`); then the device's
total memory and what is in use besides the KV cache (`device_memory`: weights, the CUDA context,
NCCL buffers, other processes on the same GPU) give the budget:

    blocks = floor((total x utilization - in use - activation peak - reserve) / bytes per block)

`num_kv_blocks_for_memory` is that arithmetic, pure and testable on the CPU; the two probes are
the only CUDA calls. `reserve_bytes` covers what the profile cannot see: allocator fragmentation,
workspaces created lazily (cuBLAS, NCCL) and, with decode graphs, the graphs' memory pool, which is
captured after the cache is allocated (`CUDA_GRAPH_RESERVE_BYTES`, a fixed estimate).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable

import torch

from rayinfer.config import ConfigError, ModelConfig, check_gpu_memory_utilization

GIB = 2**30
SAFETY_MARGIN_BYTES = GIB // 2  # fragmentation, lazily created cuBLAS / NCCL workspaces
CUDA_GRAPH_RESERVE_BYTES = GIB  # the decode graphs' shared pool (estimate; captured later)


def kv_bytes_per_block(
    model_config: ModelConfig, tp_size: int, dtype_bytes: int, block_size: int
) -> int:
    """One block of every layer's cache on one tensor-parallel rank (K/V heads split, MLA's
    latent replicated): what `ModelRunner` allocates per block."""
    per_token = math.prod(model_config.kv_shape_per_token_on_rank(tp_size, dtype_bytes))
    return model_config.num_layers * per_token * dtype_bytes * block_size


def num_kv_blocks_for_memory(
    *,
    total_bytes: int,
    utilization: float,
    non_kv_bytes: int,
    activation_peak_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    reserve_bytes: int = SAFETY_MARGIN_BYTES,
    key: str = "gpu_memory_utilization",
) -> int:
    """Blocks that fit in `total_bytes x utilization` besides what is in use (`non_kv_bytes`), the
    largest step's activations and a reserve; a ConfigError naming `key` and max_model_len when
    they would not hold one sequence of max_model_len tokens."""
    check_gpu_memory_utilization(utilization, key)
    if bytes_per_block <= 0 or block_size <= 0 or max_model_len <= 0:
        raise ValueError(
            f"bytes_per_block={bytes_per_block}, block_size={block_size} and "
            f"max_model_len={max_model_len} must be positive"
        )
    if min(total_bytes, non_kv_bytes, activation_peak_bytes, reserve_bytes) < 0:
        raise ValueError("memory sizes must not be negative")
    budget = math.floor(total_bytes * utilization)
    available = budget - non_kv_bytes - activation_peak_bytes - reserve_bytes
    num_blocks = max(available, 0) // bytes_per_block
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks < needed_blocks:
        needed_bytes = needed_blocks * bytes_per_block
        raise ConfigError(
            f"{key}={utilization} leaves {_gib(max(available, 0))} for the KV cache "
            f"({num_blocks} blocks of {block_size} tokens), but max_model_len={max_model_len} "
            f"needs {needed_blocks} blocks ({_gib(needed_bytes)}, {bytes_per_block} bytes per "
            f"block): {_gib(total_bytes)} x {utilization} = {_gib(budget)}, minus "
            f"{_gib(non_kv_bytes)} in use (weights, CUDA context, other processes), "
            f"{_gib(activation_peak_bytes)} activation peak and {_gib(reserve_bytes)} reserve; "
            f"raise {key}, lower max_model_len or max_num_batched_tokens, or use more GPUs"
        )
    return num_blocks


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


# --- the CUDA probes -------------------------------------------------------------------------
def activation_peak_bytes(forward: Callable[[], object], device: torch.device) -> int:
    """Bytes the caching allocator handed out at the peak of `forward` beyond what was allocated
    before it (its temporaries; anything it keeps is counted too)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward()
    torch.cuda.synchronize(device)
    return max(torch.cuda.max_memory_allocated(device) - before, 0)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes of the device after freeing the allocator's cached blocks: in use
    counts every process on the GPU, the CUDA context and this process's live tensors."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total, total - free
