"""Fused MoE and FP8 GEMM on one GPU: correctness, tile sweeps and timings vs torch baselines.

    python benchmarks/kernels_moe.py --sweep --out results.json
(the same as `python -m rayinfer.bench kernels moe ...`); numbers go to RESULTS.md.
"""

import sys

from rayinfer.bench.kernels_moe import main

if __name__ == "__main__":
    sys.exit(main())
