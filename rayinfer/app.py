"""`serve run rayinfer.app:build [key=value ...]`: the MoE server on Ray Serve.

    serve run rayinfer.app:build
    serve run rayinfer.app:build model=/path/to/checkpoint decode.autoscaling.max_replicas=2
    serve run rayinfer.app:build disaggregate=false engine.max_num_batched_tokens=8192
    serve run rayinfer.app:build prefill.resources.prefill_box=1 decode.resources.decode_box=1
    serve deploy examples/serve_config_nodes.yaml --address=http://<head>:8265   # the same, as YAML

Disaggregated (`disaggregate=true`): three deployments, `Ingress` (OpenAI API over HTTP,
Python-handle API), `Prefill` and `Decode`, each replica of the last two holding its own
WorkerGroup; they autoscale independently and the KV moves between them through the object
store. Colocated (`disaggregate=false`): `Ingress` and `Engine`, whose replicas prefill and
decode in mixed batches. `auto` (the default) is colocated where the two phases would share GPUs
(gpu_sharing.serves_disaggregated). Arguments are validated by `AppConfig`
(rayinfer/deployments/config.py); the checks of a phase's section (plan, FP8 weights, GPU
shares) apply to the sections the chosen mode serves with. A phase's `resources` pin its
replicas to the Ray nodes offering them (docs/serving.md); build checks that an alive
node holds a whole replica, and that the pinned replicas Serve starts with fit the nodes all
at once (deployments/node_fit.py). Under `serve deploy` build runs in a Ray task on some node
of the cluster, and reads the nodes from there.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from rayinfer import envs
from rayinfer.deployments.config import COLOCATED_PHASES, DISAGGREGATED_PHASES, AppConfig
from rayinfer.deployments.gpu_sharing import resolve_gpu_shares, serves_disaggregated
from rayinfer.deployments.node_fit import alive_nodes, check_nodes_fit, phase_bundles, pins_nodes
from rayinfer.deployments.phase_config import PhaseConfig
from rayinfer.deployments.runtime import ModelSource, available_gpus, uses_gpus
from rayinfer.workers.group import REPLICA_CPUS


def build(args: dict[str, Any] | None = None) -> Application:
    from rayinfer.deployments.decode import Decode
    from rayinfer.deployments.engine import Engine
    from rayinfer.deployments.ingress import Ingress
    from rayinfer.deployments.prefill import Prefill

    config = AppConfig.from_args(args)
    source = ModelSource.resolve(config)
    model_config = source.model_config.with_index_cache_dtype(config.index_cache_dtype)
    use_gpus = uses_gpus(config)
    num_gpus = available_gpus() if use_gpus else 0
    disaggregate = serves_disaggregated(config, use_gpus, num_gpus)
    phases = DISAGGREGATED_PHASES if disaggregate else COLOCATED_PHASES
    config = AppConfig.model_validate({**config.model_dump(), "disaggregate": disaggregate})
    for phase in phases:
        getattr(config, phase).plan.check_fits(model_config, phase)
    check_phase_fp8_weights(config, model_config, source.path, phases)
    if use_gpus:
        config = resolve_gpu_shares(config, num_gpus, phases)
    if pins_nodes(config, phases):
        check_nodes_fit(config, phases, use_gpus, alive_nodes())
    config_dict = config.model_dump()
    deployments = {"prefill": Prefill, "decode": Decode, "engine": Engine}
    handles = {
        phase: deployments[phase]
        .options(**phase_options(config, getattr(config, phase), use_gpus))
        .bind(config_dict, source)
        for phase in phases
    }
    ingress_actor = {"num_cpus": 0, "resources": dict(config.ingress.resources)}
    ingress_options = dict(
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        max_queued_requests=config.ingress.max_queued_requests,
        ray_actor_options=ingress_actor | replica_runtime_env(config, is_ingress=True),
    )
    return Ingress.options(**ingress_options).bind(config_dict, source, **handles)


def check_phase_fp8_weights(
    config: AppConfig, model_config, path, phases: tuple[str, ...] = DISAGGREGATED_PHASES
) -> None:
    """Each served phase with fp8_weights on: a checkpoint with FP8 weights (unless its weights
    are drawn, load_format=dummy) and a tp keeping blocks whole (ConfigError naming
    `<phase>.fp8_weights` and `<phase>.tp`), before any replica starts."""
    from rayinfer.models.fp8 import check_fp8_weights
    from rayinfer.models.loader import check_has_fp8_weights, checkpoint_files

    for phase in phases:
        phase_config: PhaseConfig = getattr(config, phase)
        if phase_config.uses_fp8_weights(config.fp8_weights):
            key = f"{phase}.fp8_weights" if phase_config.fp8_weights else "fp8_weights"
            check_fp8_weights(model_config, phase_config.tp, key, f"{phase}.tp")
            if config.load_format != "dummy":
                check_has_fp8_weights(checkpoint_files(path), path, key)


def phase_options(config: AppConfig, phase: PhaseConfig, use_gpus: bool) -> dict[str, Any]:
    """Serve options of a Prefill, Decode or Engine deployment: its worker bundles and
    autoscaling."""
    return dict(
        max_ongoing_requests=phase.max_ongoing_requests,
        max_queued_requests=phase.max_queued_requests,
        autoscaling_config=phase.autoscaling.to_serve(),
        placement_group_bundles=phase_bundles(phase, use_gpus),
        placement_group_strategy="STRICT_PACK",
        ray_actor_options={"num_cpus": REPLICA_CPUS} | replica_runtime_env(config),
        health_check_period_s=config.health_check_period_s,
    )


# Serve's switches (read in each replica's process at start) that `handlers_on_replica_loop`
# turns off: the handlers' own thread and, in the caller of the other deployments, the router's.
# With `stream_interval_ms` at its default they serve 1.33x the input tok/s of interval 0 with
# the threads, at 64 colocated streams on an H200 (benchmarks/serve_v2lite.sh; RESULTS.md,
# serving); alone, on the 2-core CPU, their effect is within that machine's run-to-run noise.
HANDLER_THREAD_SWITCH = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
ROUTER_LOOP_SWITCH = "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"


def replica_runtime_env(config: AppConfig, is_ingress: bool = False) -> dict[str, Any]:
    """The `runtime_env` part of a deployment's actor options (empty: Serve's defaults): the
    declared environment variables set where the app is built (rayinfer.envs), and Serve's
    switches that `handlers_on_replica_loop` sets."""
    env_vars = envs.forwarded()
    if config.handlers_on_replica_loop:
        env_vars[HANDLER_THREAD_SWITCH] = "0"
        if is_ingress:
            env_vars[ROUTER_LOOP_SWITCH] = "0"
    return {"runtime_env": {"env_vars": env_vars}} if env_vars else {}
