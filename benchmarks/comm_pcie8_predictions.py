"""Cost-model predictions for an 8-GPU PCIe Gen4 box built from published figures (two sockets,
two switches per socket, two GPUs per switch): rayinfer.comm.published_topologies.pcie_gen4_8gpu,
which tests/comm/test_cost_model.py checks. Prints a markdown table for benchmarks/RESULTS.md.

    python benchmarks/comm_pcie8_predictions.py
"""

from rayinfer.comm.cost_model import predict
from rayinfer.comm.published_topologies import pcie_gen4_8gpu

HIDDEN_BYTES = 7168 * 2
CANDIDATES = [f"{s}/{t}" for s in ("nccl", "pairwise", "hierarchical") for t in ("dist", "host")]


def main() -> None:
    topo = pcie_gen4_8gpu()
    print("| tokens/rank | " + " | ".join(CANDIDATES) + " | best |")
    print("|---" * (len(CANDIDATES) + 2) + "|")
    for tokens in (128, 1024, 4096, 16384):
        matrix = [[tokens // 8] * 8 for _ in range(8)]
        times = predict(topo, matrix, HIDDEN_BYTES)
        cells = [f"{times[c] * 1e3:.2f} ms" for c in CANDIDATES]
        print(f"| {tokens} | " + " | ".join(cells) + f" | {min(times, key=times.get)} |")


if __name__ == "__main__":
    main()
