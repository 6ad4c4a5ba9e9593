"""What landed on 2026-11-30 without a check on a GPU, checked in one run (2 GPUs, Ray bundle):

1. Two-batch overlap on two CUDA streams: greedy tokens of dp=2 ep=2 plans (NCCL and host-staged,
   overlap off and on) against one GPU, float32, tiny DeepSeek-V3 and Qwen3-MoE checkpoints.
2. `fp8_weights=True` on CUDA: a tiny FP8 block-scaled DeepSeek-V3 (the test suite's shapes),
   prompt logits against the dequantized model (relative error per position) and greedy tokens,
   with CUDA graphs on (the default), in bfloat16.
3. `gpu_memory_utilization=0.9`: the blocks it chose, that generation works, and the device's
   peak reserved memory against the budget.
4. (`--decode-graphs-only`, 2026-11-30) decode steps of dp=2 ep=2 and tp=2 ep=2 plans replayed
   from CUDA graphs with NCCL inside: greedy tokens against one GPU, float32.
6. (`--prefill-graphs-only`, 2026-11-30) new prompts prefilled from CUDA graphs: greedy tokens
   against eager prefill, float32, one GPU and dp=2 ep=2 (NCCL and host-staged exchanges);
   `--local-first-graphs-only`: the same with local_first forced on inside the graphs.
5. (`--decode-kernels-only`, not yet run) the opt-in decode kernels: the one-launch MoE routing
   against the torch routing (V2-Lite, V3, Qwen3-MoE routers) and the two-launch small-batch
   fused MoE against a float32 reference, each timed against what it replaces; then
   `RAYINFER_FUSED_ROUTING=1 RAYINFER_SMALL_BATCH_MOE=1 python benchmarks/gpu_engine_parity.py`.

Usage (carry [".device"]):
    source .device/ray/use-ray-bundle.sh; export PYTHONPATH=$PWD:$PYTHONPATH
    python benchmarks/gpu_verify_pending.py --out $OUT/pending.json
`--smoke` runs it on the CPU (gloo workers; no graphs; gpu_memory_utilization is ignored there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rayinfer  # noqa: E402
from rayinfer.config import ParallelPlan  # noqa: E402
from tests.models.harness import TINY_MLA, make_hf_checkpoint, make_prompts  # noqa: E402

GREEDY = rayinfer.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
QWEN3_MOE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)


def checkpoints(folder: Path) -> dict[str, Path]:
    from tests.models.test_deepseek import make_deepseek_checkpoint
    from tests.models.test_fp8_weights import ROUTED, quantize_like_deepseek_v3
    from tests.models.test_loader import rewrite_checkpoint

    deepseek = make_deepseek_checkpoint(folder / "deepseek_v3", "deepseek_v3", **TINY_MLA)
    fp8_source = make_deepseek_checkpoint(folder / "fp8-source", "deepseek_v3", **ROUTED)
    return {
        "deepseek_v3": deepseek,
        "qwen3_moe": make_hf_checkpoint(folder / "qwen3_moe", "qwen3_moe", **QWEN3_MOE),
        "fp8": rewrite_checkpoint(fp8_source, folder / "fp8", quantize_like_deepseek_v3),
    }


def vocab_of(path) -> int:
    from rayinfer.config import ModelConfig

    return ModelConfig.from_pretrained(path).vocab_size


def tokens_of(llm, prompts) -> list[list[int]]:
    try:
        return [out.token_ids for out in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


EVERY_EXCHANGE = [
    (exchange, overlap)
    for exchange in ({"transport": "dist"}, {"transport": "host"})
    for overlap in (False, True)
]
# every token to every rank, no device sync in the layers (the tiny models' 8 experts top-2
# would pick the deduplicated exchange on their own)
ALL_TOKENS = [
    ({"transport": "host", "dedup": False, "local_first": local}, overlap)
    for local in (False, True)  # local_first: a rank's experts on its own tokens, beside
    for overlap in (False, True)
]


def check_overlap(paths: dict[str, Path], device: str, variants, families) -> list[dict]:
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    for family in families:
        path = str(paths[family])
        prompts = make_prompts(vocab_of(path), lengths=(5, 37, 130, 300))
        common = dict(device=device, dtype="float32", max_model_len=512)
        expected = tokens_of(rayinfer.LLM(path, **common), prompts)
        for exchange, overlap in variants:
            llm = rayinfer.LLM(
                path,
                parallel=ParallelPlan(dp=2, ep=2),
                two_batch_overlap=overlap,
                all_to_all=exchange,
                **common,
            )
            got = tokens_of(llm, prompts)
            row = dict(
                check="overlap", family=family, exchange=exchange, overlap=overlap,
                exact=got == expected,
            )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    ray.shutdown()
    return rows


# Decode steps from CUDA graphs across workers: NCCL kernels captured (the all-tokens exchange,
# all-reduces); every replica replays the bucket its driver agreed on, an idle one on padding.
GRAPH_PLANS = [
    ("deepseek_v3", ParallelPlan(dp=2, ep=2), slice(None)),
    ("deepseek_v3", ParallelPlan(dp=2, ep=2), slice(1, 2)),  # one prompt: a replica idles
    ("qwen3_moe", ParallelPlan(dp=2, ep=2), slice(None)),
    ("qwen3_moe", ParallelPlan(tp=2, ep=2), slice(None)),
]


def check_decode_graphs(paths: dict[str, Path], device: str, transport: str = "auto") -> list[dict]:
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    rows, expected = [], {}
    for family, plan, chosen in GRAPH_PLANS:
        path = str(paths[family])
        prompts = make_prompts(vocab_of(path), lengths=(5, 37, 130, 300))[chosen]
        common = dict(device=device, dtype="float32", max_model_len=512, max_num_seqs=8)
        if family not in expected:
            expected[family] = tokens_of(rayinfer.LLM(path, **common), prompts)
        exchange = {"transport": transport}
        llm = rayinfer.LLM(path, parallel=plan, cuda_graphs=True, all_to_all=exchange, **common)
        steps = llm.engine.executor.step_counts
        capture_s = llm.graph_capture_seconds
        got = tokens_of(llm, prompts)
        row = dict(
            check="decode_graphs", family=family, plan=str(plan), prompts=len(prompts),
            transport=transport,
            exact=got == expected[family][chosen], graph_steps=steps["graph"],
            eager_steps=steps["eager"], capture_s=capture_s,
        )  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    ray.shutdown()
    return rows


def count_prefill_replays(llm) -> list[int]:
    """A one-GPU LLM's prefill-graph runs, counted from now on (one entry per run)."""
    graphs, runs = llm.engine.executor.runner.prefill_graphs, []
    run = graphs.run
    graphs.run = lambda requests, bucket: runs.append(bucket) or run(requests, bucket)
    return runs


def check_local_first_in_graphs(paths: dict[str, Path], device: str) -> list[dict]:
    """local_first forced on inside prefill graphs (dp=2 ep=2, host-staged, one prompt per
    replica): greedy tokens against one GPU's eager prefill, float32."""
    import ray

    path = str(paths["deepseek_v3"])
    common = dict(device=device, dtype="float32", max_model_len=512, max_num_seqs=2)
    prompts = make_prompts(vocab_of(path), lengths=(37, 300))
    expected = tokens_of(rayinfer.LLM(path, cuda_graphs=False, **common), prompts)
    ray.init(include_dashboard=False, log_to_driver=False)
    exchange = {"transport": "host", "dedup": False, "local_first": True}
    llm = rayinfer.LLM(path, parallel=ParallelPlan(dp=2, ep=2), cuda_graphs=True,
                       all_to_all=exchange, **common)  # fmt: skip
    got = tokens_of(llm, prompts)
    row = dict(check="local_first_in_prefill_graphs", exact=got == expected,
               steps=dict(llm.engine.executor.step_counts))  # fmt: skip
    print(row, flush=True)
    ray.shutdown()
    return [row]


def check_prefill_graphs(paths: dict[str, Path], device: str) -> list[dict]:
    """New prompts prefilled from CUDA graphs (padded to a token bucket) against eager prefill,
    float32: one GPU (one prompt per step), then dp=2 ep=2 (one prompt per replica, and one
    prompt with a replica idle) over NCCL and host-staged exchanges."""
    import ray

    rows = []
    common = dict(device=device, dtype="float32", max_model_len=512, max_num_seqs=1)
    expected = {}
    for family in ("deepseek_v3", "qwen3_moe"):
        path = str(paths[family])
        prompts = make_prompts(vocab_of(path), lengths=(5, 37, 130, 300))
        expected[family] = tokens_of(rayinfer.LLM(path, cuda_graphs=False, **common), prompts)
        llm = rayinfer.LLM(path, cuda_graphs=True, **common)
        runs = count_prefill_replays(llm)
        got = tokens_of(llm, prompts)
        row = dict(check="prefill_graphs", family=family, plan="one GPU",
                   exact=got == expected[family], prefill_graph_runs=runs)  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    ray.init(include_dashboard=False, log_to_driver=False)
    common["max_num_seqs"] = 2  # one prompt per replica
    for transport in ("dist", "host"):
        for chosen in (slice(0, 2), slice(2, 3), slice(None)):
            path = str(paths["deepseek_v3"])
            prompts = make_prompts(vocab_of(path), lengths=(5, 37, 130, 300))[chosen]
            llm = rayinfer.LLM(path, parallel=ParallelPlan(dp=2, ep=2), cuda_graphs=True,
                               all_to_all={"transport": transport}, **common)  # fmt: skip
            steps = llm.engine.executor.step_counts
            got = tokens_of(llm, prompts)
            row = dict(
                check="prefill_graphs", family="deepseek_v3", plan="dp=2 ep=2",
                transport=transport, prompts=len(prompts),
                exact=got == expected["deepseek_v3"][chosen], steps=dict(steps),
            )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    ray.shutdown()
    return rows


# (name, experts, top_k, scoring, renormalize, groups, topk_groups, bias, scaling)
ROUTERS = [
    ("deepseek-v2-lite", 64, 6, "softmax", False, 1, 1, False, 1.0),
    ("deepseek-v3", 256, 8, "sigmoid", True, 8, 4, True, 2.5),
    ("qwen3-moe", 128, 8, "softmax", True, 1, 1, False, 1.0),
]


def check_routing(device: str) -> list[dict]:
    """The one-launch routing kernel (opt-in: RAYINFER_FUSED_ROUTING=1) against the torch
    reference on the GPU, then both timed: same experts best first, weights within 1e-5."""
    import triton.testing

    from rayinfer.kernels.moe.moe_routing import moe_routing_reference
    from rayinfer.kernels.moe.moe_routing_kernel import moe_routing

    rows = []
    for name, experts, top_k, scoring, renorm, groups, topk_groups, has_bias, scaling in ROUTERS:
        for num_tokens in (1, 64, 4096):
            gen = torch.Generator().manual_seed(num_tokens)
            logits = (torch.randn(num_tokens, experts, generator=gen) * 2).to(device)
            bias = (torch.randn(experts, generator=gen) * 0.3).to(device) if has_bias else None
            args = (logits, top_k, scoring, renorm, groups, topk_groups, bias, scaling)
            ours, expected = moe_routing(*args), moe_routing_reference(*args)
            same_ids = torch.equal(ours.topk_ids, expected.topk_ids)
            error = (ours.topk_weights - expected.topk_weights).abs().max().item()
            kernel_us = triton.testing.do_bench(lambda a=args: moe_routing(*a)) * 1e3
            torch_us = triton.testing.do_bench(lambda a=args: moe_routing_reference(*a)) * 1e3
            row = dict(
                check="moe_routing_kernel", router=name, tokens=num_tokens, same_ids=same_ids,
                max_weight_error=error, kernel_us=kernel_us, torch_us=torch_us,
            )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    return rows


def check_small_batch_moe(device: str) -> list[dict]:
    """The two-launch fused MoE (opt-in: RAYINFER_SMALL_BATCH_MOE=1) on DeepSeek-V2-Lite's experts
    in bf16 against a float32 reference, then timed against the general fused MoE."""
    import triton.testing

    from rayinfer.kernels.moe.fused_moe import fused_moe, fused_moe_reference
    from rayinfer.kernels.moe.fused_moe_small import fused_moe_small_batch

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, top_k = 64, 2048, 1408, 6
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(device)
    rows = []
    for num_tokens in (1, 2):
        x = torch.randn(num_tokens, hidden, generator=gen).to(device)
        ids = torch.stack(
            [torch.randperm(experts, generator=gen)[:top_k] for _ in range(num_tokens)]
        )
        ids, weights = ids.to(device), torch.rand(num_tokens, top_k, generator=gen).to(device)
        expected = fused_moe_reference(x, w13, w2, weights, ids)  # float32
        bf16 = (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
        ours = fused_moe_small_batch(*bf16).float()
        general = fused_moe(*bf16).float()
        scale = expected.norm()
        row = dict(
            check="fused_moe_small_batch", tokens=num_tokens,
            relative_error=((ours - expected).norm() / scale).item(),
            general_relative_error=((general - expected).norm() / scale).item(),
            small_us=triton.testing.do_bench(lambda a=bf16: fused_moe_small_batch(*a)) * 1e3,
            general_us=triton.testing.do_bench(lambda a=bf16: fused_moe(*a)) * 1e3,
        )  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    return rows


def check_moe_pack(device: str) -> dict:
    """The all-tokens row kernels in bfloat16 (the CPU interpreter runs float32/float16 only):
    bytes equal to the torch reference at DeepSeek-V2-Lite's hidden size and top-6."""
    from rayinfer.kernels.moe import moe_pack

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 2048, generator=gen).to(device, torch.bfloat16)
    ids = torch.rand(1000, 64, generator=gen).argsort(1)[:, :6].to(device)
    weights = torch.rand(1000, 6, generator=gen).to(device)
    ids_at, row_bytes = 4096, 4160  # comm.moe.RowLayout(2048, 6, bfloat16, False)
    got = moe_pack.pack_for_every_rank(x, ids, weights, 2, ids_at, row_bytes)
    expected = moe_pack.pack_for_every_rank_reference(x, ids, weights, 2, ids_at, row_bytes)
    local = moe_pack.localize_expert_ids(got, ids_at, 6, 32, 32)
    local_ref = moe_pack.localize_expert_ids_reference(expected, ids_at, 6, 32, 32)
    # FP8 dispatch rows (2026-11-30, third session): scale_at 2048, ids_at 2052, 2112-byte rows
    fp8_args = (x, ids, weights, 2, 2048, 2052, 2112)
    fp8_rows = moe_pack.pack_fp8_for_every_rank(*fp8_args)
    fp8_ref = moe_pack.pack_fp8_for_every_rank_reference(*fp8_args)
    values, want = (r[:, :2048].view(torch.float8_e4m3fn).float() for r in (fp8_rows, fp8_ref))
    unpacked = moe_pack.unpack_fp8_rows(fp8_rows, 2048, 2048, torch.bfloat16)
    row = dict(
        check="moe_pack_bf16",
        pack_equal=bool(torch.equal(got, expected)),
        localize_equal=all(torch.equal(a, b) for a, b in zip(local, local_ref)),
        fp8_tail_equal=bool(torch.equal(fp8_rows[:, 2048:], fp8_ref[:, 2048:])),
        fp8_values_off=int((values != want).sum()),
        fp8_values_max_step=float(((values - want).abs() / want.abs().clamp_min(2**-9)).max()),
        fp8_unpack_equal=bool(torch.equal(
            unpacked, moe_pack.unpack_fp8_rows_reference(fp8_rows, 2048, 2048, torch.bfloat16)
        )),
    )  # fmt: skip
    print(row, flush=True)
    return row


def check_fp8(path: Path, device: str) -> dict:
    from rayinfer.config import ModelConfig
    from rayinfer.models.loader import load_model
    from tests.models.harness import run_greedy

    config = ModelConfig.from_pretrained(path)
    prompts = make_prompts(config.vocab_size)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    runs = {
        fp8: run_greedy(
            load_model(config, dtype, device, fp8_weights=fp8), config, prompts, 8, dtype=dtype
        )
        for fp8 in (True, False)
    }
    mine = torch.cat(runs[True].prompt_logits).float()
    theirs = torch.cat(runs[False].prompt_logits).float()
    relative = (mine - theirs).norm(dim=-1) / theirs.norm(dim=-1)
    llm = rayinfer.LLM(str(path), device=device, fp8_weights=True, max_model_len=128)
    generated = tokens_of(llm, prompts)
    row = dict(
        check="fp8_weights",
        dtype=str(dtype),
        median_relative_error=relative.median().item(),
        max_relative_error=relative.max().item(),
        top1_agreement=(mine.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        llm_generated=[len(t) for t in generated],
        finite=bool(torch.isfinite(mine).all()),
    )
    print(row, flush=True)
    return row


def check_memory_sizing(path: Path, device: str) -> dict:
    llm = rayinfer.LLM(str(path), device=device, gpu_memory_utilization=0.9, max_model_len=4096)
    blocks = len(llm.engine.block_managers[0].blocks)
    generated = tokens_of(llm, make_prompts(vocab_of(path), lengths=(5, 300)))
    row = dict(check="gpu_memory_utilization", num_blocks=blocks, generated=len(generated))
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        row["peak_reserved_fraction"] = torch.cuda.max_memory_reserved() / total
    print(row, flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="on the CPU")
    parser.add_argument("--skip-parallel", action="store_true")
    parser.add_argument(
        "--all-tokens-only",
        action="store_true",
        help="only the all-tokens exchange (DeepSeek-V3, host-staged, overlap off and on, "
        "local_first off and on)",
    )
    parser.add_argument(
        "--decode-graphs-only",
        action="store_true",
        help="only decode CUDA graphs across workers (dp=2 ep=2, tp=2 ep=2, an idle replica)",
    )
    parser.add_argument(
        "--graph-transport",
        default="auto",
        help="all_to_all.transport of the decode-graph checks (auto, dist, host)",
    )
    parser.add_argument(
        "--prefill-graphs-only",
        action="store_true",
        help="only prefill CUDA graphs: one GPU, and dp=2 ep=2 over NCCL and host-staged",
    )
    parser.add_argument(
        "--local-first-graphs-only",
        action="store_true",
        help="only local_first forced on inside prefill graphs (dp=2 ep=2 host-staged)",
    )
    parser.add_argument("--moe-pack-only", action="store_true", help="the row kernels in bf16")
    parser.add_argument(
        "--decode-kernels-only",
        action="store_true",
        help="the opt-in decode kernels: one-launch MoE routing, two-launch small-batch MoE",
    )
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    start, rows = time.time(), []
    with tempfile.TemporaryDirectory() as tmp:
        paths = checkpoints(Path(tmp))
        if args.prefill_graphs_only:
            rows += check_prefill_graphs(paths, device)
        elif args.local_first_graphs_only:
            rows += check_local_first_in_graphs(paths, device)
        elif args.decode_graphs_only:
            rows += check_decode_graphs(paths, device, args.graph_transport)
        elif args.moe_pack_only:
            rows.append(check_moe_pack(device))
        elif args.decode_kernels_only:  # on CPU tests/kernels/test_{moe_routing_kernel,
            if device == "cuda":  # fused_moe_small}.py run them under the interpreter
                rows += check_routing(device) + check_small_batch_moe(device)
        elif args.all_tokens_only:
            if device == "cuda":  # on CPU tests/kernels/test_moe_pack.py runs the interpreter
                rows.append(check_moe_pack(device))
            rows += check_overlap(paths, device, ALL_TOKENS, ["deepseek_v3"])
        else:
            if not args.skip_parallel:
                families = ["deepseek_v3", "qwen3_moe"]
                rows += check_overlap(paths, device, EVERY_EXCHANGE + ALL_TOKENS, families)
            rows.append(check_fp8(paths["fp8"], device))
            rows.append(check_memory_sizing(paths["deepseek_v3"], device))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"\nwall {time.time() - start:.0f} s")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
