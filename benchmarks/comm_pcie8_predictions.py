"""Cost-model predictions for an 8-GPU PCIe Gen4 box built from published figures (two sockets,
two switches per socket, two GPUs per switch); the topology is the one tests/comm/
test_cost_model.py checks. Prints a markdown table for benchmarks/RESULTS.md.

    python benchmarks/comm_pcie8_predictions.py
"""

from rayinfer.comm.cost_model import predict
from rayinfer.comm.topology import Topology

HIDDEN_BYTES = 7168 * 2
CANDIDATES = [f"{s}/{t}" for s in ("nccl", "pairwise", "hierarchical") for t in ("dist", "host")]


def pcie8_published() -> Topology:
    def gbps(i, j):
        return 25.0 if i // 2 == j // 2 else 18.0 if i // 4 == j // 4 else 9.0

    def us(i, j):
        return 8.0 if i // 2 == j // 2 else 12.0 if i // 4 == j // 4 else 20.0

    return Topology.from_matrix(
        [[gbps(i, j) for j in range(8)] for i in range(8)],
        latency_us=[[us(i, j) for j in range(8)] for i in range(8)],
        host_gbps=20.0,
        host_latency_us=25.0,
        cross_gbps={"0,1": 20.0},
        one_shot_efficiency=0.3,
    )


def main() -> None:
    topo = pcie8_published()
    print("| tokens/rank | " + " | ".join(CANDIDATES) + " | best |")
    print("|---" * (len(CANDIDATES) + 2) + "|")
    for tokens in (128, 1024, 4096, 16384):
        matrix = [[tokens // 8] * 8 for _ in range(8)]
        times = predict(topo, matrix, HIDDEN_BYTES)
        cells = [f"{times[c] * 1e3:.2f} ms" for c in CANDIDATES]
        print(f"| {tokens} | " + " | ".join(cells) + f" | {min(times, key=times.get)} |")


if __name__ == "__main__":
    main()
