"""All-to-all and MoE dispatch: NCCL against rayinfer's schedules and transports.

Two phases, each a fresh set of processes (NCCL reads its environment once per process):
  nvlink   default NCCL (NVLink / P2P where the GPUs have it)
  p2p-off  NCCL_P2P_DISABLE=1: NCCL goes through host memory, as on a PCIe box without P2P
Each phase checks correctness first, probes the topology, then times every variant. Bytes/s
counts the bytes leaving each rank for other ranks (the self block stays on the GPU).
Launched with torch.multiprocessing and a TCPStore; the group is the same RayinferGroup that
ray.util.collective creates.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayinfer import envs

TOKENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
A2A_VARIANTS = [
    "nccl-raw",
    "nccl/dist",
    "pairwise/dist",
    "nccl/host",
    "nccl/host-cpu",
    "nccl/host-mbox",
    "pairwise/host",
    "auto",
    "fp8 rows host",
]
DISPATCH_VARIANTS = [
    "bf16 nccl/dist",
    "bf16 auto",
    "fp8 nccl/dist",
    "fp8 pairwise/host",
    "fp8 auto",
]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rayinfer.bench comm")
    p.add_argument("--phase", choices=["all", "nvlink", "p2p-off"], default="all")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="comm-bench", help="folder for JSON, table and PNG")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase != "all":
        run_phase(args, out / f"{args.phase}.json")
        return 0
    for phase, env in (("nvlink", {}), ("p2p-off", {envs.NCCL_P2P_DISABLE.name: "1"})):
        cmd = [sys.executable, "-m", "rayinfer.bench", "comm", "--phase", phase, "--out", str(out)]
        cmd += _forward(args)
        subprocess.run(cmd, env=envs.subprocess_env(**env), check=True)
    rows = [r for p in ("nvlink", "p2p-off") for r in json.loads((out / f"{p}.json").read_text())]
    (out / "comm.json").write_text(json.dumps(rows, indent=1))
    table = format_table(rows)
    (out / "comm.md").write_text(table)
    plot(rows, out / "comm.png")
    print(table)
    return 0


def _forward(args) -> list[str]:
    return [
        "--world-size",
        str(args.world_size),
        "--hidden",
        str(args.hidden),
        "--iters",
        str(args.iters),
        "--experts",
        str(args.experts),
        "--topk",
        str(args.topk),
        "--tokens",
        *map(str, args.tokens),
    ]


def run_phase(args, path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, args.world_size + 1, True, wait_for_workers=False)
    mp.spawn(_worker, args=(args, store.port, str(path)), nprocs=args.world_size)


def _worker(rank: int, args, port: int, path: str) -> None:
    from rayinfer.comm import RayinferGroup
    from rayinfer.comm.probe import probe

    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, args.world_size + 1, False, timeout=timeout)
    group = RayinferGroup(args.world_size, rank, "bench", store=store)
    _add_baseline_host_transports(group)
    phase = Path(path).stem
    checks = check_correctness(group, args.hidden)
    group.topology = probe(group, use_cache=False)
    rows = [dict(phase=phase, kind="check", **checks)] if rank == 0 else []
    if rank == 0:
        print(f"[{phase}] checks {checks}\n[{phase}] topology {_topology_line(group.topology)}")
    for tokens in args.tokens:
        rows += time_all_to_all(group, tokens, args, phase)
        rows += time_dispatch(group, tokens, args, phase)
    if rank == 0:
        Path(path).write_text(json.dumps(rows, indent=1))
    group.destroy_group()


def _add_baseline_host_transports(group) -> None:
    """The host-staged transport as it runs by default ("host": the GPU-driven copy-engine
    pipeline), and in the same run two other forms of it: "host-cpu" (the CPU drives every
    chunk, the protocol before the GPU-driven one) and "host-mbox" (the mailbox kernel, which
    is opt-in, for every size timed, up to 128 MiB blocks)."""
    from rayinfer.comm.host_staged import HostStagedTransport

    forms = [("host-cpu", dict(protocol="cpu", direct_max_bytes=0))]
    if group.device.type == "cuda":  # on CPU the kernel would need Triton's interpreter
        forms.append(("host-mbox", dict(direct_max_bytes=128 << 20)))
    for name, options in forms:
        store = dist.PrefixStore(group.next_key(name), group.store)
        group._transports[name] = HostStagedTransport(
            store, group.rank, group.world_size, group.device, **options
        )
    protocol = group.transport("host").protocol  # made on every rank: making it is collective
    if group.rank == 0:
        print(f"host transport protocol: {protocol}", flush=True)


def check_correctness(group, hidden: int) -> dict:
    """Exact all-to-all on random uneven splits for every variant; dispatch -> identity ->
    combine; FP8 error against its documented bound."""
    from rayinfer.comm.fp8 import error_bound
    from rayinfer.comm.refs import (
        all_to_all_ref,
        identity_experts,
        moe_identity_ref,
        random_split_matrix,
    )

    n, me, dev = group.world_size, group.rank, group.device
    gen = torch.Generator().manual_seed(1)
    matrix = random_split_matrix(n, 300, gen)
    inputs = [
        torch.randn(sum(matrix[i]), hidden, generator=gen).to(dev, torch.bfloat16) for i in range(n)
    ]
    expected = all_to_all_ref(inputs, matrix)[me]
    exact = True
    for variant in _variants(group)[1:-2]:
        schedule, transport = variant.split("/")
        out = torch.empty_like(expected)
        group.all_to_all(out, inputs[me], [r[me] for r in matrix], matrix[me], schedule, transport)
        exact &= torch.equal(out, expected)
    x = torch.randn(512, hidden, generator=gen).to(dev, torch.bfloat16)
    ids, weights = deepseek_routing(512, 256, 8, gen, dev)
    res = group.dispatch(x, ids, weights, num_experts=256, schedule="pairwise", transport="host")
    y = group.combine(identity_experts(res.x, res.topk_weights), res.handle, transport="host")
    moe_err = (y.float() - moe_identity_ref(x, weights).float()).abs().max().item()
    fp8 = group.dispatch(x, ids, weights, num_experts=256, use_fp8=True, transport="host")
    ref = group.dispatch(x, ids, weights, num_experts=256, transport="host")
    fp8_ratio = ((fp8.x.float() - ref.x.float()).abs() / error_bound(ref.x)).max().item()
    rel = ((fp8.x.float() - ref.x.float()).norm() / ref.x.float().norm()).item()
    return dict(
        all_to_all_exact=bool(exact),
        moe_max_abs_err=moe_err,
        fp8_err_over_bound=fp8_ratio,
        fp8_rel_l2=rel,
    )


def deepseek_routing(tokens: int, experts: int, topk: int, gen, device):
    """Random top-k of `experts` per token (DeepSeek-V3: 256 experts, top-8), softmax weights."""
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(topk, dim=-1)
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def time_all_to_all(group, tokens: int, args, phase: str) -> list[dict]:
    from rayinfer.comm.cost_model import predict
    from rayinfer.comm.probe import median_time

    n = group.world_size
    share = [tokens // n] * n
    matrix = [share for _ in range(n)]
    inp = torch.randn(tokens, args.hidden, device=group.device, dtype=torch.bfloat16)
    out = torch.empty_like(inp)
    predicted = predict(group.topology, matrix, args.hidden * 2)
    rows = []
    for variant in _variants(group):
        schedule, transport = variant.split("/") if "/" in variant else ("auto", "auto")
        call = functools.partial(
            group.all_to_all, out, inp, share, share, schedule, transport, matrix
        )
        row_bytes = args.hidden * 2
        if variant == "nccl-raw":  # all_to_all_single itself: the process group's alltoall_base
            call = functools.partial(_raw_all_to_all, group.pg, out, inp, share)
        if variant == "fp8 rows host":  # what FP8 dispatch moves: e4m3 + scale, 64-byte rows
            row_bytes = -(-(args.hidden + 4) // 64) * 64
            rows8 = torch.empty(tokens, row_bytes, dtype=torch.uint8, device=group.device)
            call = functools.partial(
                group.all_to_all, rows8, torch.ones_like(rows8), share, share, "pairwise", "host"
            )
        seconds = median_time(group, call, args.iters, warmup=2)
        choice = group.plan(matrix, args.hidden * 2) if variant == "auto" else None
        name = f"{choice.schedule}/{choice.transport}" if choice else variant
        rows.append(
            dict(
                phase=phase,
                kind="all_to_all",
                tokens=tokens,
                variant=variant,
                picked=name,
                seconds=seconds,
                bytes=(tokens - share[group.rank]) * row_bytes,  # bytes leaving for peers
                predicted_s=predicted.get(name),
            )
        )
    return rows if group.rank == 0 else []


def _variants(group) -> list[str]:
    """A2A_VARIANTS this group runs: the mailbox ("host-mbox") only on GPUs."""
    return [v for v in A2A_VARIANTS if v != "nccl/host-mbox" or group.device.type == "cuda"]


def _raw_all_to_all(pg, out, inp, splits) -> None:
    pg.alltoall_base(out, inp, splits, splits, dist.AllToAllOptions()).wait()


def time_dispatch(group, tokens: int, args, phase: str) -> list[dict]:
    from rayinfer.comm.probe import median_time

    gen = torch.Generator().manual_seed(tokens + group.rank)
    x = torch.randn(tokens, args.hidden, generator=gen).to(group.device, torch.bfloat16)
    ids, weights = deepseek_routing(tokens, args.experts, args.topk, gen, group.device)
    rows = []
    for variant in DISPATCH_VARIANTS:
        payload, plan = variant.split()
        schedule, transport = plan.split("/") if "/" in plan else ("auto", "auto")
        call = functools.partial(
            group.dispatch,
            x,
            ids,
            weights,
            num_experts=args.experts,
            use_fp8=payload == "fp8",
            schedule=schedule,
            transport=transport,
        )
        rows.append(
            dict(
                phase=phase,
                kind="dispatch",
                tokens=tokens,
                variant=variant,
                seconds=median_time(group, call, args.iters, warmup=2),
            )
        )
    return rows if group.rank == 0 else []


def _topology_line(topo) -> str:
    gbps = [[round(b / 1e9, 1) for b in row] for row in topo.bandwidth]
    return (
        f"dist GB/s {gbps}, host GB/s {[round(b / 1e9, 1) for b in topo.host_bandwidth]}, "
        f"host latency {topo.host_latency * 1e6:.0f} us, one-shot efficiency "
        f"{topo.one_shot_efficiency:.2f}, islands {topo.islands}"
    )


def format_table(rows: list[dict]) -> str:
    """Markdown: per phase and size, GB/s and latency per variant, ratio against NCCL."""
    lines = []
    for phase in ("nvlink", "p2p-off"):
        a2a = [r for r in rows if r["phase"] == phase and r["kind"] == "all_to_all"]
        timed = {r["variant"] for r in a2a}
        variants = [v for v in A2A_VARIANTS if v in timed]
        lines += [
            f"\n### all_to_all, {phase} (GB/s leaving each rank for peers; us; x NCCL"
            " (time ratio = tokens/s ratio); model = predicted / measured time)",
            "| tokens/rank | " + " | ".join(variants) + " |",
            "|---" * (len(variants) + 1) + "|",
        ]
        for tokens in sorted({r["tokens"] for r in a2a}):
            by = {r["variant"]: r for r in a2a if r["tokens"] == tokens}
            base = by["nccl-raw"]["seconds"]
            cells = [_cell(by[v], base) for v in variants]
            lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
        disp = [r for r in rows if r["phase"] == phase and r["kind"] == "dispatch"]
        lines += [
            f"\n### MoE dispatch, {phase} (tokens/s per rank; us; x bf16 NCCL)",
            "| tokens/rank | " + " | ".join(DISPATCH_VARIANTS) + " |",
            "|---" * (len(DISPATCH_VARIANTS) + 1) + "|",
        ]
        for tokens in sorted({r["tokens"] for r in disp}):
            by = {r["variant"]: r for r in disp if r["tokens"] == tokens}
            base = by["bf16 nccl/dist"]["seconds"]
            cells = [
                f"{tokens / by[v]['seconds'] / 1e6:.2f} M ({by[v]['seconds'] * 1e6:.0f} us, "
                f"{base / by[v]['seconds']:.2f}x)"
                for v in DISPATCH_VARIANTS
            ]
            lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(r: dict, base: float) -> str:
    gbps = r["bytes"] / r["seconds"] / 1e9
    model = f", model {r['predicted_s'] / r['seconds']:.2f}" if r.get("predicted_s") else ""
    picked = f" [{r['picked']}]" if r["variant"] == "auto" else ""
    return f"{gbps:.1f} ({r['seconds'] * 1e6:.0f} us, {base / r['seconds']:.2f}x{model}){picked}"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, phase in zip(axes, ("nvlink", "p2p-off"), strict=True):
        for variant in A2A_VARIANTS:
            pts = sorted(
                (r["tokens"], r["bytes"] / r["seconds"] / 1e9)
                for r in rows
                if r.get("variant") == variant and r["phase"] == phase and r["kind"] == "all_to_all"
            )
            if pts:  # (the mailbox is timed on GPUs only)
                ax.plot(*zip(*pts, strict=True), marker="o", label=variant)
        ax.set(
            xscale="log",
            yscale="log",
            title=f"all_to_all bf16 H=7168, 2x H200, {phase}",
            xlabel="tokens per rank",
            ylabel="GB/s leaving each rank",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
