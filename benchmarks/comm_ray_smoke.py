"""The "rayinfer" backend under Ray on GPUs: two actors with one GPU each form a group through
ray.util.collective (NCCL + host-staged transport), check an all_to_all and an MoE round trip.

    python benchmarks/comm_ray_smoke.py        (on the GPU machine, after use-ray-bundle.sh)
"""

import ray
import torch
from ray.util import collective as col

import rayinfer.comm  # noqa: F401


@ray.remote(num_gpus=1)
class Member:
    def __init__(self, rank: int):
        import rayinfer.comm  # noqa: F401,F811

        self.rank = rank

    def join(self) -> str:
        col.init_collective_group(2, self.rank, backend="rayinfer", group_name="smoke")
        return torch.cuda.get_device_name()

    def check(self) -> dict:
        from rayinfer.comm.refs import all_to_all_ref, identity_experts, moe_identity_ref

        group = col.get_group_handle("smoke")
        gen = torch.Generator().manual_seed(0)
        matrix = [[3, 700], [0, 129]]
        inputs = [torch.randn(sum(r), 7168, generator=gen).cuda().bfloat16() for r in matrix]
        expected = all_to_all_ref(inputs, matrix)[self.rank]
        results = {}
        for transport in ("dist", "host"):
            out = torch.empty_like(expected)
            group.all_to_all(
                out,
                inputs[self.rank],
                [r[self.rank] for r in matrix],
                matrix[self.rank],
                "pairwise",
                transport,
            )
            results[f"all_to_all {transport}"] = torch.equal(out, expected)
        x = torch.randn(256, 7168, generator=gen).cuda().bfloat16()
        ids = torch.rand(256, 256, generator=gen).argsort(1)[:, :8].cuda()
        w = torch.rand(256, 8, generator=gen).cuda()
        res = group.dispatch(x, ids, w, num_experts=256, transport="host")
        y = group.combine(identity_experts(res.x, res.topk_weights), res.handle, transport="host")
        err = (y.float() - moe_identity_ref(x, w).float()).abs().max().item()
        results["moe max abs err"] = err
        t = torch.ones(4, device="cuda")
        col.allreduce(t, "smoke")
        results["allreduce"] = bool((t == 2).all())
        return results


def main() -> None:
    ray.init(include_dashboard=False, log_to_driver=False)
    members = [Member.remote(r) for r in range(2)]
    print("devices", ray.get([m.join.remote() for m in members]))
    print("checks", ray.get([m.check.remote() for m in members]))
    ray.shutdown()


if __name__ == "__main__":
    main()
