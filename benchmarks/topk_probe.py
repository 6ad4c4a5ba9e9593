"""torch.topk sorted against unsorted at the lightning indexer's shapes (k = 2048 of 16k-1M
scores per query, 1-256 queries), on one GPU: the indexer keeps the unsorted one.

    python benchmarks/topk_probe.py
"""

import torch
import triton.testing

SHAPES = [(1, 131072), (16, 131072), (64, 131072), (256, 131072), (16, 1048576), (256, 16384)]


def main() -> None:
    for rows, length in SHAPES:
        scores = torch.randn(rows, length, device="cuda")
        by_value = [scores.topk(2048, dim=-1, sorted=s).values.sort().values for s in (True, False)]
        assert torch.equal(*by_value)  # the same values chosen
        times = [
            triton.testing.do_bench(lambda x=scores, s=s: x.topk(2048, dim=-1, sorted=s), rep=100)
            for s in (True, False)
        ]
        print(f"topk [{rows}, {length}] k=2048: sorted {times[0]:.3f} ms, unsorted "
              f"{times[1]:.3f} ms ({times[0] / times[1]:.2f}x)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
