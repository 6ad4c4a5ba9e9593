"""How many KV blocks fit on a GPU: vLLM's `gpu_memory_utilization`, for one worker.

After the weights are loaded, the runner runs one profiling step of the largest batch the
scheduler can form and measures its activation peak (`activation_peak_bytes`); then the device's
total memory and what is in use besides the KV cache (`device_memory`: weights, the CUDA context,
NCCL buffers, other processes on the same GPU) give the budget:

    blocks = floor((total x utilization - in use - activation peak - reserve) / bytes per block)

`num_kv_blocks_for_memory` is that arithmetic, pure and testable on the CPU; the probes are the
only CUDA calls. `reserve_bytes` covers what the profile cannot see: allocator fragmentation,
workspaces created lazily (cuBLAS, NCCL) and, with decode graphs, the graphs' memory pool, which is
captured after the cache is allocated (`CUDA_GRAPH_RESERVE_BYTES`, a fixed estimate).

A worker with a share of a GPU (Serve's `gpus_per_worker` < 1, e.g. prefill and decode 0.5 each
on one GPU) gets `share x total x utilization` and subtracts only what its own process uses
(`non_kv_bytes`): replicas that start together on one GPU would otherwise each count the same
free memory. Its own usage is NVML's per-process figure (`nvidia-smi --query-compute-apps`,
matched on this pid and GPU), which covers the CUDA context, the allocator and NCCL; where NVML
cannot see this process (a container's own pid namespace), the allocator's reserved bytes plus
`CUDA_CONTEXT_ESTIMATE_BYTES`.
"""

from __future__ import annotations

import gc
import math
import os
import subprocess
from collections.abc import Callable

import torch

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.engine_config import check_gpu_memory_utilization

GIB = 2**30
SAFETY_MARGIN_BYTES = GIB // 2  # fragmentation, lazily created cuBLAS / NCCL workspaces
CUDA_GRAPH_RESERVE_BYTES = GIB  # the decode graphs' shared pool (estimate; captured later)
# A CUDA 12 context with lazy module loading plus torch's kernels takes a few hundred MiB on
# Hopper (more with eager loading); 0.75 GiB errs on the safe side when NVML cannot tell.
CUDA_CONTEXT_ESTIMATE_BYTES = 3 * GIB // 4
MIB = 2**20


def kv_bytes_per_block(
    model_config: ModelConfig, tp_size: int, dtype_bytes: int, block_size: int
) -> int:
    """One block of every layer's cache on one tensor-parallel rank (K/V heads split, MLA's
    latent replicated): what `ModelRunner` allocates per block."""
    shapes = model_config.kv_shapes_on_rank(tp_size, dtype_bytes)
    return sum(math.prod(shape) for shape in shapes) * dtype_bytes * block_size


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
    gpu_share: float = 1.0,
) -> int:
    """Blocks that fit in `total_bytes x gpu_share x utilization` besides what is in use
    (`non_kv_bytes`, see that function), the largest step's activations and a reserve; a
    ConfigError naming `key` and max_model_len when they would not hold one sequence of
    max_model_len tokens."""
    check_gpu_memory_utilization(utilization, key)
    if not 0 < gpu_share <= 1:
        raise ValueError(f"gpu_share={gpu_share} must be in (0, 1]")
    if bytes_per_block <= 0 or block_size <= 0 or max_model_len <= 0:
        raise ValueError(
            f"bytes_per_block={bytes_per_block}, block_size={block_size} and "
            f"max_model_len={max_model_len} must be positive"
        )
    if min(total_bytes, non_kv_bytes, activation_peak_bytes, reserve_bytes) < 0:
        raise ValueError("memory sizes must not be negative")
    budget = math.floor(total_bytes * gpu_share * utilization)
    available = budget - non_kv_bytes - activation_peak_bytes - reserve_bytes
    num_blocks = max(available, 0) // bytes_per_block
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks < needed_blocks:
        needed_bytes = needed_blocks * bytes_per_block
        raise ConfigError(
            f"{key}={utilization} leaves {_gib(max(available, 0))} for the KV cache "
            f"({num_blocks} blocks of {block_size} tokens), but max_model_len={max_model_len} "
            f"needs {needed_blocks} blocks ({_gib(needed_bytes)}, {bytes_per_block} bytes per "
            f"block): {_gib(total_bytes)}{_share(gpu_share)} x {utilization} = {_gib(budget)}, "
            f"minus {_gib(non_kv_bytes)} in use ({_in_use(gpu_share)}), "
            f"{_gib(activation_peak_bytes)} activation peak and {_gib(reserve_bytes)} reserve; "
            f"raise {key}, lower max_model_len or max_num_batched_tokens, or use more GPUs"
        )
    return num_blocks


def non_kv_bytes(*, gpu_share: float, device_in_use_bytes: int, own_bytes: int) -> int:
    """What a worker's budget subtracts besides activations: on a whole GPU everything in use on
    it (other processes included); on a share only this process's own usage, as the others'
    usage lies in their own shares."""
    return device_in_use_bytes if gpu_share >= 1 else own_bytes


def own_process_bytes(*, nvml_bytes: int | None, allocator_reserved_bytes: int) -> int:
    """This process's memory on its GPU: NVML's figure (context, allocator, NCCL buffers), or
    without one the allocator's reserved bytes plus an estimated CUDA context."""
    if nvml_bytes is not None:
        return max(nvml_bytes, allocator_reserved_bytes)
    return allocator_reserved_bytes + CUDA_CONTEXT_ESTIMATE_BYTES


def process_bytes_from_smi(csv_text: str, pid: int, gpu_uuid: str | None = None) -> int | None:
    """Bytes `pid` uses on the GPU `gpu_uuid` (any GPU when None) in the output of
    `nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits`
    (MiB); None when the process is not listed."""
    found = None
    for line in csv_text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit() or not fields[2].isdigit():
            continue
        if int(fields[0]) != pid or (gpu_uuid and not _same_gpu(fields[1], gpu_uuid)):
            continue
        found = (found or 0) + int(fields[2]) * MIB
    return found


def _same_gpu(listed: str, gpu_uuid: str) -> bool:
    """nvidia-smi writes `GPU-<uuid>`; torch's device properties the bare uuid."""
    return listed.removeprefix("GPU-").lower() == gpu_uuid.removeprefix("GPU-").lower()


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def _share(gpu_share: float) -> str:
    return "" if gpu_share >= 1 else f" x {gpu_share:g} GPU share"


def _in_use(gpu_share: float) -> str:
    if gpu_share >= 1:
        return "weights, CUDA context, other processes"
    return "this worker's weights and CUDA context"


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


def worker_memory(device: torch.device, gpu_share: float) -> tuple[int, int]:
    """(total bytes of the device, bytes the worker's budget subtracts: `non_kv_bytes`)."""
    total, in_use = device_memory(device)
    own = 0
    if gpu_share < 1:
        nvml = process_gpu_bytes(os.getpid(), str(torch.cuda.get_device_properties(device).uuid))
        reserved = torch.cuda.memory_reserved(device)
        own = own_process_bytes(nvml_bytes=nvml, allocator_reserved_bytes=reserved)
    return total, non_kv_bytes(gpu_share=gpu_share, device_in_use_bytes=in_use, own_bytes=own)


def process_gpu_bytes(pid: int, gpu_uuid: str | None) -> int | None:
    """NVML's per-process usage through nvidia-smi; None where it is missing or silent."""
    query = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory"]
    try:
        listed = subprocess.run(
            [*query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return process_bytes_from_smi(listed.stdout, pid, gpu_uuid) if listed.returncode == 0 else None


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes of the device after freeing the allocator's cached blocks: in use
    counts every process on the GPU, the CUDA context and this process's live tensors."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total, total - free
