"""Whether the nodes of the Ray cluster can hold what the app pins to them, checked at build.

A phase's `resources` (and the ingress's) pin its replicas to the nodes offering them. Each
Prefill, Decode or Engine replica reserves a STRICT_PACK placement group (the replica and all
its workers on one node), so one alive node must hold a whole group: a phase no node can hold
would leave its replicas pending forever. `build` checks instead and fails naming the key and
listing what each alive node offers. Phases without `resources` are not checked here (the GPU
count is: gpu_sharing.py). The nodes are read once, at build (`ray.nodes()`).
"""

from __future__ import annotations

from collections.abc import Iterable

from rayinfer.config import ConfigError
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.phase_config import PhaseConfig
from rayinfer.workers.group import placement_bundles

# What a node's listing leaves out: byte counts and Ray's per-node labels.
UNLISTED_RESOURCES = ("memory", "object_store_memory")


def phase_bundles(phase: PhaseConfig, use_gpus: bool) -> list[dict]:
    """The placement group bundles of one replica of `phase` (group.placement_bundles)."""
    return placement_bundles(
        phase.num_workers,
        use_gpus,
        phase.cpus_per_worker,
        phase.gpus_per_worker or 1.0,
        phase.resources,
    )


def group_demand(bundles: Iterable[dict]) -> dict[str, float]:
    """What a STRICT_PACK group of `bundles` needs of its one node: the bundles summed."""
    demand: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            demand[name] = demand.get(name, 0.0) + amount
    return demand


def pins_nodes(config: AppConfig, phases: tuple[str, ...]) -> bool:
    """Whether any served phase (or the ingress) asks for custom resources."""
    return bool(config.ingress.resources) or any(getattr(config, p).resources for p in phases)


def check_nodes_fit(
    config: AppConfig, phases: tuple[str, ...], use_gpus: bool, nodes: list[dict]
) -> None:
    """Raise ConfigError unless, for every served phase with `resources`, one alive node of
    `nodes` (`ray.nodes()` entries) holds a whole replica, and one offers the ingress's."""
    alive = [node for node in nodes if node.get("Alive")]
    for phase in phases:
        phase_config: PhaseConfig = getattr(config, phase)
        if phase_config.resources:
            demand = group_demand(phase_bundles(phase_config, use_gpus))
            if not any(fits(demand, node) for node in alive):
                raise ConfigError(misfit(f"{phase}.resources", phase_config, demand, alive))
    if config.ingress.resources and not any(fits(config.ingress.resources, n) for n in alive):
        raise ConfigError(misfit("ingress.resources", None, config.ingress.resources, alive))


def fits(demand: dict[str, float], node: dict) -> bool:
    offered = node.get("Resources", {})
    return all(offered.get(name, 0.0) >= amount for name, amount in demand.items())


def misfit(key: str, phase: PhaseConfig | None, demand: dict, alive: list[dict]) -> str:
    """Why nothing fits: the first resource no alive node offers at all (named by its key), or
    else the whole group that no single node holds; then what every alive node offers."""
    pinned = phase.resources if phase is not None else demand
    offered = {name for node in alive for name in node.get("Resources", {})}
    missing = [name for name in pinned if name not in offered]
    if missing:
        name = missing[0]
        head = (
            f"{key}.{name}={pinned[name]:g}: no alive Ray node offers the resource {name!r}; "
            f"start the node meant for it with `ray start ... --resources='{{\"{name}\": N}}'`, "
            "or fix the name"
        )
    else:
        workers = f"{phase.num_workers} workers, " if phase is not None else ""
        head = (
            f"{key}={_format(pinned)}: no alive Ray node holds a whole replica ({workers}"
            f"{_format(demand)} on one node); offer more on one node or ask for less"
        )
    return f"{head}. The cluster's alive nodes offer: {describe_nodes(alive) or 'none'}"


def describe_nodes(nodes: list[dict]) -> str:
    """One entry per node: its address, short id and resources (without byte counts and the
    node:<ip> labels)."""
    entries = []
    for node in nodes:
        offered = {
            name: amount
            for name, amount in node.get("Resources", {}).items()
            if name not in UNLISTED_RESOURCES and not name.startswith("node:")
        }
        where = f"{node.get('NodeManagerAddress', '?')} ({str(node.get('NodeID', ''))[:8]})"
        entries.append(f"{where}: {_format(offered) or 'nothing'}")
    return "; ".join(entries)


def _format(resources: dict[str, float]) -> str:
    return ", ".join(f"{name}={amount:g}" for name, amount in sorted(resources.items()))


def alive_nodes() -> list[dict]:
    """`ray.nodes()` of the cluster: the one this process is connected to, else the one
    RAY_ADDRESS (or the local running cluster) names, connected to briefly (`serve run`
    builds the app before it connects)."""
    import ray

    if ray.is_initialized():
        return ray.nodes()
    try:
        ray.init(address="auto", log_to_driver=False, configure_logging=False)
    except ConnectionError as error:
        raise ConfigError(
            "resources pin replicas to Ray nodes, so the app needs a running Ray cluster "
            f"(`ray start --head --resources=...`, then RAY_ADDRESS): {error}"
        ) from None
    try:
        return ray.nodes()
    finally:
        ray.shutdown()
