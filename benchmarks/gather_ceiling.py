"""How fast can one GPU read the rows sparse MLA decode reads? 64 decodes x 2,048 distinct
cache rows of 576 bf16 (1,152 bytes) picked at random from a 128k-token cache (the indexer's
top-k over random scores, as `bench kernels dsa` draws them), against reading the same bytes in
order. Read-only (a Triton kernel sums each program's rows) and read+write (torch.index_select),
random and with each decode's slots sorted, all timed from CUDA graphs
(`triton.testing.do_bench_cudagraph`, medians). Where the random gather itself reads far below
the ordered stream, that is the ceiling of any kernel over this cache layout.

    python benchmarks/gather_ceiling.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONTEXT, ROW, TOPK, DECODES = 131072, 576, 2048, 64


@triton.jit
def _sum_rows_kernel(rows_ptr, slots_ptr, out_ptr, ROWS_PER_PROGRAM: tl.constexpr,
                     ROW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """out[program, :ROW] = sum of the listed rows (fp32): a gather that only reads."""
    program = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, ROWS_PER_PROGRAM, BLOCK_N):
        offs_n = program * ROWS_PER_PROGRAM + start + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + offs_n).to(tl.int64)
        tile = tl.load(rows_ptr + slot[:, None] * ROW + offs_d[None, :], mask=offs_d[None, :] < ROW)
        acc += tile.to(tl.float32)
    tl.store(out_ptr + program * BLOCK_D + offs_d, tl.sum(acc, 0))


def read_only_ms(rows, slots, rows_per_program: int = 256) -> float:
    programs = slots.numel() // rows_per_program
    out = torch.empty(programs, 1024, dtype=torch.float32, device=rows.device)

    def run():
        _sum_rows_kernel[(programs,)](rows, slots, out, rows_per_program, ROW, 32, 1024,
                                      num_warps=8, num_stages=3)  # fmt: skip

    return triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")


def main() -> None:
    torch.manual_seed(0)
    rows = torch.randn(CONTEXT, ROW, device="cuda", dtype=torch.bfloat16)
    scores = torch.rand(DECODES, CONTEXT, device="cuda")
    random_slots = scores.topk(TOPK, dim=-1).indices.to(torch.int32).flatten()
    sorted_slots = random_slots.view(DECODES, TOPK).sort(dim=-1).values.flatten().contiguous()
    ordered = torch.arange(DECODES * TOPK, device="cuda", dtype=torch.int32) % CONTEXT
    gathered_bytes = DECODES * TOPK * ROW * 2
    out = torch.empty(DECODES * TOPK, ROW, device="cuda", dtype=torch.bfloat16)
    print(
        f"{DECODES} x {TOPK} rows of {ROW * 2} B: {gathered_bytes / 1e6:.1f} MB; "
        f"cache {rows.numel() * 2 / 1e6:.0f} MB"
    )
    for name, slots in (("random", random_slots), ("sorted per decode", sorted_slots),
                        ("in order", ordered)):  # fmt: skip
        read_ms = read_only_ms(rows, slots)
        copy_ms = triton.testing.do_bench_cudagraph(
            lambda s=slots: torch.index_select(rows, 0, s, out=out), rep=50, return_mode="median"
        )
        read_rate, copy_rate = gathered_bytes / read_ms / 1e9, 2 * gathered_bytes / copy_ms / 1e9
        print(f"{name:>18}: read-only {read_ms * 1e3:7.1f} us ({read_rate:5.2f} TB/s); "
              f"index_select {copy_ms * 1e3:7.1f} us ({copy_rate:5.2f} TB/s read+write)",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
