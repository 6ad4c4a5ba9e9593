"""Whether the nodes of the Ray cluster can hold what the app pins to them, checked at build.

A phase's `resources` (and the ingress's) pin its replicas to the nodes offering them. Each
Prefill, Decode or Engine replica reserves a STRICT_PACK placement group (the replica and all
its workers on one node), so one alive node must hold a whole group: a phase no node can hold
would leave its replicas pending forever. `build` checks instead and fails naming the key and
listing what each alive node offers. Then the pinned phases together: the replicas Serve starts
with (each phase's initial or minimum replicas, at least one; the ingress's `num_replicas`) must
all fit at once, where phases pinned to the same nodes compete for them (node_packing.py).
Phases without `resources` are not checked here (the GPU count is: gpu_sharing.py). The nodes
are read once, at build (`ray.nodes()`): their totals, whatever else already runs there.
"""

from __future__ import annotations

from collections.abc import Iterable

from rayinfer.config import ConfigError
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.node_packing import fit_together
from rayinfer.deployments.node_packing import fits as fits_offer
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
    check_fit_together(pinned_groups(config, phases, use_gpus), alive)


def fits(demand: dict[str, float], node: dict) -> bool:
    return fits_offer(demand, node.get("Resources", {}))


def start_replicas(phase: PhaseConfig) -> int:
    """The replicas Serve starts a phase with; at least one, as every request needs one."""
    autoscaling = phase.autoscaling
    initial = autoscaling.initial_replicas
    return max(1, autoscaling.min_replicas if initial is None else initial)


def pinned_groups(
    config: AppConfig, phases: tuple[str, ...], use_gpus: bool
) -> list[tuple[str, dict[str, float]]]:
    """(key, demand) of every group Serve places at start that asks for custom resources:
    each pinned phase's replicas (one placement group each) and the ingress's replicas."""
    groups = []
    for phase in phases:
        phase_config: PhaseConfig = getattr(config, phase)
        if phase_config.resources:
            demand = group_demand(phase_bundles(phase_config, use_gpus))
            groups += [(f"{phase}.resources", demand)] * start_replicas(phase_config)
    if config.ingress.resources:
        demand = dict(config.ingress.resources)  # the ingress actor takes no CPU
        groups += [("ingress.resources", demand)] * config.ingress.num_replicas
    return groups


def check_fit_together(groups: list[tuple[str, dict]], alive: list[dict]) -> None:
    """Raise ConfigError when the groups, each of which fits some node alone, cannot all be
    placed at once. Keys whose groups can use a common node compete; each set of competing
    keys is searched on its own nodes, and the first set that does not fit is named."""
    for keys, nodes in competing_keys(groups, alive):
        demands = [demand for key, demand in groups if key in keys]
        offers = [node.get("Resources", {}) for node in nodes]
        if fit_together(demands, offers) is False:
            raise ConfigError(crowded(keys, groups, nodes))


def competing_keys(
    groups: list[tuple[str, dict]], alive: list[dict]
) -> list[tuple[set[str], list[dict]]]:
    """The keys split into sets that share no node a group of theirs fits, each with its
    nodes (connected components of keys linked by a node both can use)."""
    nodes_of = {}
    for key, demand in groups:
        nodes_of[key] = {i for i, node in enumerate(alive) if fits(demand, node)}
    components: list[tuple[set[str], set[int]]] = []
    for key, node_ids in nodes_of.items():
        linked = [c for c in components if c[1] & node_ids]
        for component in linked:
            components.remove(component)
        keys = {key}.union(*(c[0] for c in linked))
        components.append((keys, node_ids.union(*(c[1] for c in linked))))
    return [(keys, [alive[i] for i in sorted(ids)]) for keys, ids in components]


def crowded(keys: set[str], groups: list[tuple[str, dict]], nodes: list[dict]) -> str:
    """Which pinned keys compete, what each and all of them need, and what their nodes offer."""
    needs = []
    for key in (k for k in dict(groups) if k in keys):
        demands = [demand for k, demand in groups if k == key]
        needs.append(f"{key} ({len(demands)} x {_format(demands[0])})")
    total = group_demand(demand for key, demand in groups if key in keys)
    return (
        f"{' and '.join(needs)} each fit a node alone but not all at once: together they need "
        f"{_format(total)} of the nodes that can hold them, which offer: {describe_nodes(nodes)}. "
        "Offer more on those nodes (`ray start ... --resources=...`), pin a phase to another "
        "node, or start fewer replicas (<phase>.autoscaling.min_replicas, initial_replicas, "
        "ingress.num_replicas)"
    )


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
