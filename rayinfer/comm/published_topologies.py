"""Topologies built from published figures, for the cost model's predictions where no such box
is at hand (tests and benchmarks/comm_pcie8_predictions.py use the same one)."""

from rayinfer.comm.topology import Topology


def pcie_gen4_8gpu() -> Topology:
    """8 PCIe Gen4 GPUs: two sockets, two switches per socket, two GPUs per switch. Same-switch
    P2P ~25 GB/s, same socket across switches 18 GB/s, cross-socket 9 GB/s per pair and 20 GB/s
    for the whole socket link, host-staged ~20 GB/s per GPU. Dense all-pairs P2P writes through
    the CPU collapse (NCCL issue 1603: 2 GB/s vs 18 GB/s bounced through the host); 0.3 is an
    assumed one-shot efficiency, which the probe fits on a real box."""

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
