"""Attention and small fused kernels on one GPU: correctness, tile sweeps and timings.

    python benchmarks/kernels_attention.py --sweep --out results.json
(the same as `python -m rayinfer.bench kernels attention ...`); numbers go to RESULTS.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.bench.kernels_attention import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
