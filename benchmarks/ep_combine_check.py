"""Old vs new EP dispatch packing and combine on one GPU, random data (< 30 s).

    python benchmarks/ep_combine_check.py [--tokens 16384] [--hidden 2048] [--world 2]

Simulates this rank's side of dispatch/combine at DeepSeek-V2-Lite's shape (64 experts, top-6):
the all-to-all is replaced by a copy, so the numbers are the packing/combine work alone. Checks
that the new combine equals the old index_add_ sum (up to float32 summation order) and that the
packed rows are byte-identical, then prints median times (ms) per call and x26 MoE layers.
"""

import argparse

import torch
import triton

from rayinfer.comm import moe
from rayinfer.kernels import ops


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def old_combine(back, send_token_ids, num_tokens):
    out = torch.zeros(num_tokens, back.shape[1], dtype=torch.float32, device=back.device)
    out.index_add_(0, send_token_ids, back.float())
    return out.to(back.dtype)


def old_pack(x, token_ids, local_ids, weights):
    layout = moe.RowLayout(x.shape[1], local_ids.shape[1], x.dtype, False)
    rows = torch.empty(token_ids.shape[0], layout.row_bytes, dtype=torch.uint8, device=x.device)
    rows[:, layout.ids_at + 8 * layout.topk :].zero_()
    payload, _, ids, w = layout.columns(rows)
    payload.copy_(x[token_ids])
    ids.copy_(local_ids)
    w.copy_(weights)
    return rows


class LoopbackComm:
    """Rank 0 of `world`: the split matrix is this rank's counts; all-to-all copies the input."""

    def __init__(self, world: int):
        self.rank, self.world_size = 0, world

    def gather_split_matrix(self, counts):
        return [counts.tolist()] + [[0] * self.world_size for _ in range(self.world_size - 1)]

    def all_to_all(self, out, inp, out_splits, in_splits, **kw):
        out.copy_(inp[: out.shape[0]])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--layers", type=int, default=26)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    t, h, n = args.tokens, args.hidden, args.world
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(t, args.experts, device=dev).argsort(1)[:, : args.topk]
    weights = torch.rand(t, args.topk, device=dev)
    comm = LoopbackComm(n)
    res = moe.dispatch(comm, x, ids, weights, args.experts)
    handle = res.handle
    s = handle.send_token_ids.shape[0]
    back = torch.randn(s, h, device=dev, dtype=torch.bfloat16)
    print(f"T={t} H={h} world={n}: {s} rows sent ({s / t:.2f} per token)")

    # correctness
    old = old_combine(back, handle.send_token_ids, t)
    new = ops.moe_combine(back, handle.row_index, back.dtype)
    diff = (old.float() - new.float()).abs().max().item()
    print(f"combine max |old - new| = {diff:.3g} (bf16 rounding of a float32 sum: ~1e-2 at most)")
    per_rank = args.experts // n
    dest_ids = torch.repeat_interleave(
        torch.arange(n, device=dev), torch.tensor(handle.in_splits, device=dev)
    )
    on_dest = ids[handle.send_token_ids] // per_rank == dest_ids[:, None]
    local = torch.where(on_dest, ids[handle.send_token_ids] - dest_ids[:, None] * per_rank, -1)
    w = torch.where(on_dest, weights[handle.send_token_ids], 0.0)
    rows_old = old_pack(x, handle.send_token_ids, local, w)
    rows_new = moe._pack(x, handle.send_token_ids, local, w, False)
    print("packed rows identical:", torch.equal(rows_old, rows_new))

    times = {
        "combine old (zeros + index_add_ + .float() + .to)": bench(
            lambda: old_combine(back, handle.send_token_ids, t)
        ),
        "combine new (moe_combine kernel)": bench(
            lambda: ops.moe_combine(back, handle.row_index, back.dtype)
        ),
        "pack old (x[ids] then strided copy)": bench(
            lambda: old_pack(x, handle.send_token_ids, local, w)
        ),
        "pack new (index_select into the layout)": bench(
            lambda: moe._pack(x, handle.send_token_ids, local, w, False)
        ),
        "dispatch new, loopback all-to-all (incl. 1 sync)": bench(
            lambda: moe.dispatch(comm, x, ids, weights, args.experts)
        ),
    }
    for name, ms in times.items():
        print(f"{name:52s} {ms * 1e3:8.1f} us  x{args.layers} = {ms * args.layers:6.2f} ms")


if __name__ == "__main__":
    main()
