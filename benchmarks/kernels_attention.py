"""Attention and small fused kernels on one GPU: correctness, tile sweeps and timings.

    python benchmarks/kernels_attention.py --sweep --out results.json
(the same as `python -m rayinfer.bench kernels attention ...`); numbers go to RESULTS.md.
"""

import sys

from rayinfer.bench.kernels_attention import main

if __name__ == "__main__":
    sys.exit(main())
