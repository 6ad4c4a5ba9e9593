"""`serve run rayinfer.app:build [key=value ...]`: the disaggregated prefill/decode server.

    serve run rayinfer.app:build
    serve run rayinfer.app:build model=/path/to/checkpoint decode.autoscaling.max_replicas=2

Three deployments: `Ingress` (OpenAI API over HTTP, Python-handle API), `Prefill` and `Decode`,
each replica of the last two holding its own WorkerGroup; they autoscale independently.
Arguments are validated by `AppConfig` (rayinfer/deployments/config.py).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from rayinfer.deployments.config import AppConfig, PhaseConfig
from rayinfer.deployments.gpu_sharing import resolve_gpu_shares
from rayinfer.deployments.runtime import ModelSource, available_gpus, uses_gpus
from rayinfer.workers.group import REPLICA_CPUS, placement_bundles


def build(args: dict[str, Any] | None = None) -> Application:
    from rayinfer.deployments.decode import Decode
    from rayinfer.deployments.ingress import Ingress
    from rayinfer.deployments.prefill import Prefill

    config = AppConfig.from_args(args)
    source = ModelSource.resolve(config)
    model_config = source.model_config.with_index_cache_dtype(config.index_cache_dtype)
    config.prefill.plan.check_fits(model_config, "prefill")
    config.decode.plan.check_fits(model_config, "decode")
    check_phase_fp8_weights(config, model_config, source.path)
    use_gpus = uses_gpus(config)
    if use_gpus:
        config = resolve_gpu_shares(config, available_gpus())
    config_dict = config.model_dump()
    prefill = Prefill.options(**phase_options(config, config.prefill, use_gpus)).bind(
        config_dict, source
    )
    decode = Decode.options(**phase_options(config, config.decode, use_gpus)).bind(
        config_dict, source
    )
    ingress_options = dict(
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        max_queued_requests=config.ingress.max_queued_requests,
        ray_actor_options={"num_cpus": 0},
    )
    return Ingress.options(**ingress_options).bind(config_dict, source, prefill, decode)


def check_phase_fp8_weights(config: AppConfig, model_config, path) -> None:
    """Each phase with fp8_weights on: a checkpoint with FP8 weights and a tp keeping blocks
    whole (ConfigError naming `<phase>.fp8_weights` and `<phase>.tp`), before any replica starts."""
    from rayinfer.models.fp8 import check_fp8_weights
    from rayinfer.models.loader import check_has_fp8_weights, checkpoint_files

    for phase in ("prefill", "decode"):
        phase_config: PhaseConfig = getattr(config, phase)
        if phase_config.uses_fp8_weights(config.fp8_weights):
            key = f"{phase}.fp8_weights" if phase_config.fp8_weights else "fp8_weights"
            check_fp8_weights(model_config, phase_config.tp, key, f"{phase}.tp")
            check_has_fp8_weights(checkpoint_files(path), path, key)


def phase_options(config: AppConfig, phase: PhaseConfig, use_gpus: bool) -> dict[str, Any]:
    """Serve options of a Prefill or Decode deployment: its worker bundles and autoscaling."""
    return dict(
        max_ongoing_requests=phase.max_ongoing_requests,
        max_queued_requests=phase.max_queued_requests,
        autoscaling_config=phase.autoscaling.to_serve(),
        placement_group_bundles=placement_bundles(
            phase.num_workers, use_gpus, phase.cpus_per_worker, phase.gpus_per_worker or 1.0
        ),
        placement_group_strategy="STRICT_PACK",
        ray_actor_options={"num_cpus": REPLICA_CPUS},
        health_check_period_s=config.health_check_period_s,
    )
