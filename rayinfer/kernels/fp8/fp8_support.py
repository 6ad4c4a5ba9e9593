"""Where FP8 e4m3 runs on a GPU: Triton's fp8e4nv type and FP8 tensor cores need compute
capability 8.9 or later (Ada's mma, Hopper's wgmma). sm_80 and sm_86 (A100, A10, RTX 30xx) have
neither: Triton refuses to build an fp8e4nv kernel for them (`python
benchmarks/compile_moe_kernels.py` builds the FP8 fused MoE and FP8 GEMM for sm_89 and sm_90),
so a setting that keeps data in FP8 is refused there at start, naming what to use instead."""

from __future__ import annotations

import torch

from rayinfer.config_error import ConfigError

FP8_CAPABILITY = (8, 9)


def require_fp8_device(device: torch.device, setting: str, instead: str) -> None:
    """ConfigError naming `setting` and `instead` on a CUDA device below FP8_CAPABILITY; CPUs
    run the torch references and pass."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(
            f"{setting} needs a GPU of compute capability 8.9 or later (Ada, Hopper) for FP8 "
            f"e4m3; {device} is {capability[0]}.{capability[1]}; {instead}"
        )
