"""Prefill and decode throughput of one model across the GPUs of one host, per parallel plan,
against transformers' own forward of the same model on one GPU (measured in the same run).

    python -m rayinfer.bench parallel --config benchmarks/configs/deepseek-v2-lite \
        --plans tp=1 dp=2,ep=2 tp=2 --transports dist host --prompt-lens 4096 16384

Weights are random (load_format="dummy"), so only config.json is needed. Model-FLOPs
utilization counts 2 x active parameters per token against the GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from rayinfer.bench.step_breakdown import breakdown, summary_line
from rayinfer.config import ModelConfig, ParallelPlan

H200_BF16_PEAK_FLOPS = 800e12  # measured dense bf16 matmul ceiling (shared/device/README.md)


def active_params_per_token(config: ModelConfig) -> int:
    """Weights one token multiplies with (embedding lookup excluded, LM head included)."""
    h, heads = config.hidden_size, config.num_attention_heads
    if config.is_mla:
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        q = (
            h * heads * qk
            if not config.q_lora_rank
            else (h * config.q_lora_rank + config.q_lora_rank * heads * qk)
        )
        kv = h * (config.kv_lora_rank + config.qk_rope_head_dim)
        kv += config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        attention = q + kv + heads * config.v_head_dim * h
    else:
        attention = h * config.head_dim * (2 * heads + 2 * config.num_kv_heads)
    dense_mlp = 3 * h * config.intermediate_size
    num_dense = config.hf.get("first_k_dense_replace", 0) if config.is_moe else config.num_layers
    moe = (
        3
        * h
        * config.moe_intermediate_size
        * (config.num_experts_per_tok + config.num_shared_experts)
        + h * config.num_experts
    )
    num_moe = config.num_layers - num_dense
    return (
        config.num_layers * attention
        + num_dense * dense_mlp
        + num_moe * moe
        + h * config.vocab_size
    )


def parse_plan(text: str) -> ParallelPlan:
    """'dp=2,ep=2' -> ParallelPlan(dp=2, ep=2)."""
    sizes = dict(part.split("=") for part in text.split(",") if part)
    return ParallelPlan(**{key: int(value) for key, value in sizes.items()})


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench parallel")
    parser.add_argument("--config", required=True, help="folder with the model's config.json")
    parser.add_argument("--plans", nargs="+", default=["tp=1"])
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["dist"],
        help="MoE exchanges to run: a transport (dist, host) with optional ':'-joined flags: "
        "fp8 (FP8 dispatch), dedup (each token only to the ranks of its experts), all (every "
        "token to every rank), local / nolocal (a rank's experts on its own tokens beside the "
        "exchange, or not; default: from 16384 tokens per rank); e.g. host host:fp8 "
        "host:fp8:nolocal",
    )
    parser.add_argument("--overlap", nargs="+", default=["off"], help="off and/or on")
    parser.add_argument(
        "--graphs",
        nargs="+",
        default=["auto"],
        choices=["auto", "decode", "off"],
        help="CUDA graphs: auto (decode steps and single new prompts, where the forward can be "
        "captured), decode (decode steps only) and/or off (eager)",
    )
    parser.add_argument(
        "--max-graph-prefill-tokens",
        type=int,
        default=None,
        help="with --graphs auto: the largest prompt replayed from a prefill graph (the "
        "library's default when absent)",
    )
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[4096])
    parser.add_argument(
        "--prompts-per-replica",
        type=int,
        default=1,
        help="prompts each DP replica prefills in one step (a server under load batches them); "
        "the transformers baseline runs the same number per forward",
    )
    parser.add_argument("--decode-batches", nargs="*", type=int, default=[1, 64])
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", choices=["transformers", "none"], default="transformers")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--profile-dir",
        default=None,
        help="also profile one prefill of the longest prompt per run (torch.profiler tables)",
    )
    return parser.parse_args(argv)


EXCHANGE_FLAGS = {
    "fp8": ("use_fp8", True),
    "dedup": ("dedup", True),
    "all": ("dedup", False),
    "local": ("local_first", True),
    "nolocal": ("local_first", False),
}


def exchange_options(text: str) -> dict:
    """'host:fp8:dedup' -> {"transport": "host", "use_fp8": True, "dedup": True}."""
    transport, *flags = text.split(":")
    unknown = [flag for flag in flags if flag not in EXCHANGE_FLAGS]
    if unknown:
        valid = list(EXCHANGE_FLAGS)
        raise ValueError(f"unknown exchange flags {unknown} in {text!r}; valid: {valid}")
    return {"transport": transport, **dict(EXCHANGE_FLAGS[flag] for flag in flags)}


def median(values):
    return sorted(values)[len(values) // 2]


def transformers_prefill(config_dir: str, prompt_lens, repeats, batch: int = 1) -> dict[int, float]:
    """Input tokens/s of transformers' forward on one GPU, `batch` sequences per call."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    results = {}
    for length in prompt_lens:
        ids = torch.randint(0, hf_config.vocab_size, (batch, length), device="cuda")
        times = []
        with torch.inference_mode():
            model(ids, use_cache=False, logits_to_keep=1)  # warm-up at the measured shape
            for _ in range(repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        results[length] = batch * length / median(times)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return results


def graph_prefill_cap(graphs: str, cap: int | None) -> dict:
    """LLM's max_graph_prefill_tokens: 0 for decode graphs only, else the asked cap if any."""
    if graphs == "decode":
        return {"max_graph_prefill_tokens": 0}
    return {} if cap is None else {"max_graph_prefill_tokens": cap}


def rayinfer_run(config_dir, plan, transport, overlap, args, graphs="auto") -> dict:
    from rayinfer import LLM, SamplingParams

    longest = max(args.prompt_lens)
    # Room for the largest decode batch at once (64-token prompts), or the longest prompt: the
    # default cache (max(4 x max_model_len, 16384) tokens) would hold ~200 of 256 decodes and the
    # batch would run in part, or preempted.
    largest = max([1, *args.decode_batches])
    per_replica = args.prompts_per_replica
    cache_tokens = max(
        4 * per_replica * (longest + args.decode_tokens + 8), largest * (64 + args.decode_tokens)
    )
    llm = LLM(
        config_dir,
        device="cuda",
        load_format="dummy",
        parallel=plan,
        two_batch_overlap=overlap,
        all_to_all=exchange_options(transport),
        max_model_len=longest + args.decode_tokens + 8,
        max_num_batched_tokens=longest * per_replica,
        max_num_seqs=max(64, largest),
        num_kv_blocks=-(-cache_tokens // 16) + largest,  # block_size 16; one partial per sequence
        enable_prefix_caching=False,
        cuda_graphs=False if graphs == "off" else None,
        max_graph_batch_size=largest,
        **graph_prefill_cap(graphs, args.max_graph_prefill_tokens),
    )
    vocab = llm.model_config.vocab_size
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)

    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)

    def prompts(count, length):
        return [
            torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(count)
        ]

    try:
        llm.generate(prompts(plan.dp, 128), first)  # warm-up
        result = {"prefill": {}, "decode": {}, "graph_capture_s": llm.graph_capture_seconds}
        result["prefill_run_seconds"] = {}  # every repeat, so a run's spread shows
        result["prefill_steps_ms"] = {}  # each repeat's step, phase by phase (step_breakdown)
        executor = llm.engine.executor
        workers = getattr(executor, "descriptions", [])  # a multi-worker plan's
        result["workers_numa"] = [d.get("numa") for d in workers]
        for length in args.prompt_lens:
            count = plan.dp * per_replica  # per_replica sequences per DP replica, one step
            llm.generate(prompts(count, length), first)  # compiles kernels for this shape
            executor.drain_step_timelines()
            times, spans = [], []
            for _ in range(args.repeats):
                batch = prompts(count, length)
                start = time.monotonic()
                llm.generate(batch, first)
                spans.append((start, time.monotonic()))
                times.append(spans[-1][1] - start)
            result["prefill"][length] = count * length / median(times)
            result["prefill_run_seconds"][length] = times
            timelines = executor.drain_step_timelines()
            result["prefill_steps_ms"][length] = [breakdown(span, timelines) for span in spans]
        if args.profile_dir:
            exchange = transport.replace(":", "_")
            name = f"tp{plan.tp}_dp{plan.dp}_ep{plan.ep}-{exchange}-overlap_{int(overlap)}"
            llm.start_profile(f"{args.profile_dir}/{name}")
            llm.generate(prompts(plan.dp, longest), first)
            llm.stop_profile()
        for batch_size in args.decode_batches:
            llm.generate(prompts(batch_size, 64), decode)  # compiles kernels for this batch
            # decode time = a whole generation - a 1-token one of the same batch shape, each the
            # median of `repeats` runs: one pair alone swung by 2x at batch 256 on the GPU VM
            prefill_times, totals = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                llm.generate(prompts(batch_size, 64), first)
                prefill_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                llm.generate(prompts(batch_size, 64), decode)
                totals.append(time.perf_counter() - start)
            decode_s = max(median(totals) - median(prefill_times), 1e-9)
            result["decode"][batch_size] = batch_size * (args.decode_tokens - 1) / decode_s
        return result
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    config = ModelConfig.from_pretrained(args.config)
    flops_per_token = 2 * active_params_per_token(config)
    report = {"config": args.config, "active_params": flops_per_token // 2, "runs": [],
              "prompts_per_replica": args.prompts_per_replica}  # fmt: skip
    if args.baseline == "transformers":
        try:
            report["transformers"] = transformers_prefill(
                args.config, args.prompt_lens, args.repeats, args.prompts_per_replica
            )
        except Exception as error:
            print(f"transformers baseline FAILED {error!r}")
            report["transformers"] = {}
        for length, rate in report["transformers"].items():
            mfu = rate * flops_per_token / H200_BF16_PEAK_FLOPS
            print(
                f"transformers 1 GPU  prefill {length:6d} x{args.prompts_per_replica}: "
                f"{rate:10.0f} tok/s  MFU {mfu:.1%}"
            )
    for plan_text in args.plans:
        plan = parse_plan(plan_text)
        exchanges = plan.experts_exchange_tokens
        runs = [
            (transport, overlap, graphs)
            for transport in (args.transports if exchanges else ["dist"])
            for overlap in (args.overlap if exchanges else ["off"])
            for graphs in args.graphs
        ]
        for transport, overlap, graphs in runs:
            label = f"{plan_text} {transport} overlap={overlap} graphs={graphs}"
            try:
                run = rayinfer_run(args.config, plan, transport, overlap == "on", args, graphs)
            except Exception as error:  # report and go on: one failed plan ends no run
                print(f"{label}: FAILED {error!r}")
                continue
            run.update(plan=plan_text, transport=transport, overlap=overlap, graphs=graphs)
            report["runs"].append(run)
            print_run(run, plan, flops_per_token, report.get("transformers", {}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def print_run(run, plan, flops_per_token, baseline) -> None:
    label = f"{run['plan']} {run['transport']} ov={run['overlap']} graphs={run['graphs']}"
    for length, rate in run["prefill"].items():
        per_gpu = rate / plan.num_workers
        mfu = per_gpu * flops_per_token / H200_BF16_PEAK_FLOPS
        ratio = (
            f"  {per_gpu / baseline[length]:.2f}x transformers/GPU" if length in baseline else ""
        )
        runs_ms = [1e3 * t for t in run.get("prefill_run_seconds", {}).get(length, [])]
        spread = f"  runs {min(runs_ms):.0f}-{max(runs_ms):.0f} ms" if runs_ms else ""
        print(
            f"{label:32s} prefill {length:6d}: {rate:10.0f} tok/s "
            f"({per_gpu:8.0f}/GPU, MFU {mfu:.1%}){ratio}{spread}"
        )
        steps = run.get("prefill_steps_ms", {}).get(length)
        if steps:
            print(f"{label:32s} prefill {length:6d}: {summary_line(steps)}")
    for batch, rate in run["decode"].items():
        print(f"{label:32s} decode batch {batch:4d}: {rate:10.1f} tok/s")
    if any(run.get("workers_numa", [])):
        print(f"{label:32s} workers' NUMA binding: {run['workers_numa']}")
    if run["graph_capture_s"] is not None:
        print(f"{label:32s} graphs captured in {run['graph_capture_s']:.1f} s")
