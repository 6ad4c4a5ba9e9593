"""How much of a GPU each worker takes. One worker per GPU by default; on a machine with fewer
GPUs than the two phases' minimum replicas need (one GPU: prefill and decode one worker each),
single-worker replicas share GPUs, so `serve run rayinfer.app:build` starts on any GPU machine."""

from __future__ import annotations

import math

from rayinfer.config import ConfigError
from rayinfer.deployments.config import AppConfig, gpu_sharing_conflict

PHASES = ("prefill", "decode")


def gpus_needed(config: AppConfig) -> dict[str, int]:
    """Workers each phase starts at its minimum replicas (at least one replica)."""
    return {
        phase: getattr(config, phase).num_workers
        * max(1, getattr(config, phase).autoscaling.min_replicas)
        for phase in PHASES
    }


def resolve_gpu_shares(config: AppConfig, num_gpus: int) -> AppConfig:
    """`config` with every phase's `gpus_per_worker` decided for a machine with `num_gpus`."""
    needed = gpus_needed(config)
    undecided = [p for p in PHASES if getattr(config, p).gpus_per_worker is None]
    if not undecided:
        return config
    share = 1.0
    if sum(needed.values()) > num_gpus:
        if num_gpus < 1 or any(getattr(config, p).num_workers > 1 for p in undecided):
            wanted = ", ".join(f"{p} {n}" for p, n in needed.items())
            raise ConfigError(
                f"the replicas need {wanted} GPUs at their minimum replicas and this machine has "
                f"{num_gpus}; lower prefill/decode tp, dp or autoscaling.min_replicas, or set "
                "prefill.gpus_per_worker / decode.gpus_per_worker (single-worker replicas only)"
            )
        share = 1.0 / math.ceil(sum(needed.values()) / num_gpus)
        for p in undecided:
            if getattr(config, p).gpu_memory_utilization is not None:
                raise ConfigError(gpu_sharing_conflict(p, share))
    updates = {
        p: getattr(config, p).model_copy(update={"gpus_per_worker": share}) for p in undecided
    }
    return config.model_copy(update=updates)
