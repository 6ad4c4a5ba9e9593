"""How much of a GPU each worker takes, and whether prefill and decode run apart at all.

One worker per GPU by default. Where the two phases' minimum replicas need more GPUs than the
cluster has (one GPU: prefill and decode one worker each), `disaggregate=auto` serves with one
colocated Engine deployment instead (`serves_disaggregated`); with `disaggregate=true` there,
single-worker replicas share GPUs, so `serve run rayinfer.app:build` starts on any GPU machine.
Colocated replicas never share a GPU unless `engine.gpus_per_worker` says so.
"""

from __future__ import annotations

import math

from rayinfer.config import ConfigError
from rayinfer.deployments.config import DISAGGREGATED_PHASES, AppConfig


def gpus_needed(config: AppConfig, phases: tuple[str, ...] = DISAGGREGATED_PHASES) -> dict:
    """Workers each phase starts at its minimum replicas (at least one replica)."""
    return {
        phase: getattr(config, phase).num_workers
        * max(1, getattr(config, phase).autoscaling.min_replicas)
        for phase in phases
    }


def serves_disaggregated(config: AppConfig, use_gpus: bool, num_gpus: int) -> bool:
    """`disaggregate` resolved: `auto` is colocated only on GPUs, where prefill's and decode's
    workers at their minimum replicas need more GPUs than the cluster's `num_gpus` (the two
    phases would share GPUs, and one engine runs both at the offline engine's speed), unless
    a phase's `gpus_per_worker` is set: a user sharing GPUs by hand asked for the two phases."""
    if config.disaggregate != "auto":
        return config.disaggregate
    if not use_gpus:
        return True
    if any(getattr(config, p).gpus_per_worker is not None for p in DISAGGREGATED_PHASES):
        return True
    return sum(gpus_needed(config).values()) <= num_gpus


def resolve_gpu_shares(
    config: AppConfig, num_gpus: int, phases: tuple[str, ...] = DISAGGREGATED_PHASES
) -> AppConfig:
    """`config` with the `gpus_per_worker` of every served phase decided for `num_gpus` GPUs;
    only disaggregated single-worker replicas share a GPU unasked."""
    needed = gpus_needed(config, phases)
    undecided = [p for p in phases if getattr(config, p).gpus_per_worker is None]
    if not undecided:
        return config
    share = 1.0
    if sum(needed.values()) > num_gpus:
        can_share = phases == DISAGGREGATED_PHASES and num_gpus >= 1
        if not can_share or any(getattr(config, p).num_workers > 1 for p in undecided):
            raise ConfigError(too_few_gpus(needed, num_gpus))
        share = 1.0 / math.ceil(sum(needed.values()) / num_gpus)
    updates = {
        p: getattr(config, p).model_copy(update={"gpus_per_worker": share}) for p in undecided
    }
    return config.model_copy(update=updates)


def too_few_gpus(needed: dict[str, int], num_gpus: int) -> str:
    wanted = ", ".join(f"{p} {n}" for p, n in needed.items())
    lower = ", ".join(f"{p}.tp, {p}.dp" for p in needed)
    shares = " / ".join(f"{p}.gpus_per_worker" for p in needed)
    return (
        f"the replicas need {wanted} GPUs at their minimum replicas and this machine has "
        f"{num_gpus}; lower {lower} or autoscaling.min_replicas, or set {shares} "
        "(single-worker replicas only)"
    )
