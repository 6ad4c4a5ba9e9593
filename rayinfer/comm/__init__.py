"""rayinfer.comm: a ray.util.collective backend ("rayinfer") with a topology-aware all-to-all,
host-staged transport for GPUs without peer access, and MoE dispatch/combine.

Importing this package registers the backend, so `create_collective_group(..., backend="rayinfer")`
works in any process that imported it. Inside each worker (a Ray actor):

    import rayinfer.comm
    from ray.util import collective as col

    col.init_collective_group(world_size, rank, backend="rayinfer", group_name="ep")
    group = col.get_group_handle("ep")           # a RayinferGroup
    group.topology = probe(group)  # rayinfer.comm.probe.probe: measure links (cached on disk)
    group.all_to_all(out, inp, out_splits, in_splits)          # schedule/transport "auto"
    res = group.dispatch(x, topk_ids, topk_weights, num_experts=256, use_fp8=True)
    y = group.combine(expert_out, res.handle)
"""

from ray.util.collective.backend_registry import _global_registry, register_collective_backend

from rayinfer.comm.cost_model import Choice, choose, predict
from rayinfer.comm.group import BACKEND_NAME, RayinferGroup
from rayinfer.comm.moe import DispatchHandle, DispatchResult
from rayinfer.comm.pending import Pending
from rayinfer.comm.topology import Topology

if not _global_registry.is_registered(BACKEND_NAME):
    register_collective_backend(BACKEND_NAME, RayinferGroup)

__all__ = [
    "BACKEND_NAME",
    "Choice",
    "DispatchHandle",
    "DispatchResult",
    "Pending",
    "RayinferGroup",
    "Topology",
    "choose",
    "predict",
]
