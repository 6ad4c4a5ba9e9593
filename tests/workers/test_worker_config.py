"""The typed configs reach every worker of a multi-worker CPU engine as LLM(...) was given them,
and the workers use them: the host-staged transport sends small blocks through its mailbox
(all_to_all.host.direct_max_bytes), the layers hold the kernel backends and overlap settings."""

import ray

import rayinfer
from rayinfer import ParallelPlan, SamplingParams
from rayinfer.exchange_config import AllToAllConfig, HostStagedConfig
from rayinfer.kernels.backends import KernelBackends
from rayinfer.layers.moe import MoE
from rayinfer.overlap_config import OverlapConfig
from rayinfer.process_config import ProcessConfig
from tests.models.harness import TINY_MLA, make_hf_checkpoint, make_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_non_default_fields_reach_and_steer_every_worker(ray_cluster, tmp_path):
    path = make_hf_checkpoint(tmp_path, "deepseek_v3", **TINY_MLA)
    prompts = make_prompts(128, lengths=(5, 3))
    host = HostStagedConfig(direct_max_bytes=8192, chunk_overhead_bytes=4096)
    all_to_all = AllToAllConfig(transport="host", dedup=False, host=host)
    overlap = OverlapConfig(first_share=0.25, shared_experts="combine")
    kernels = KernelBackends(fp8_gemm="triton", small_batch_moe=True)
    process = ProcessConfig(gc_freeze=False, profile_cpu="none", gil_switch_interval_ms=2.0)
    llm = rayinfer.LLM(
        str(path), device="cpu", parallel=ParallelPlan(dp=2, ep=2), two_batch_overlap=True,
        all_to_all={"transport": "host", "dedup": False, "host": {"direct_max_bytes": 8192,
                    "chunk_overhead_bytes": 4096}},
        overlap=overlap, kernels={"fp8_gemm": "triton", "small_batch_moe": True}, process=process,
    )  # fmt: skip

    def what_the_worker_uses(worker) -> dict:
        """Run inside a Worker actor (defined here: pickled by value): the configs its
        runner, layers and comm group hold, and its interpreter's GIL switch interval."""
        import sys

        ep_group = worker.runner.parallel.ep_group
        moe = next(m for m in worker.runner.model.modules() if isinstance(m, MoE))
        return {
            "all_to_all": ep_group.all_to_all,
            "host_staged": ep_group.group.host_staged,
            "mailbox_launches": ep_group.group.transport("host").mailboxes.launches,
            "overlap": (worker.runner.overlap, moe.overlap),
            "kernels": (moe.kernels, moe.experts.kernels),
            "process": worker.spec.process,
            "switch_interval_s": sys.getswitchinterval(),
        }

    try:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        workers = llm.engine.executor.workers
        seen = ray.get([w.__ray_call__.remote(what_the_worker_uses) for w in workers])
    finally:
        llm.shutdown()
    for used in seen:
        assert used["all_to_all"] == all_to_all and used["host_staged"] == host
        assert used["mailbox_launches"] > 0  # direct_max_bytes > 0: small blocks took it
        assert used["overlap"] == (overlap, overlap)
        assert used["kernels"] == (kernels, kernels)
        assert used["process"] == process
        assert used["switch_interval_s"] == 0.002
    single = rayinfer.LLM(str(path), device="cpu").generate(prompts, GREEDY)
    assert tokens == [o.token_ids for o in single]  # the same math, whatever the settings
