"""Program id -> output tile, in the grouped order shared by the GEMM kernels."""

from __future__ import annotations

from rayinfer.kernels.triton_compat import tl, triton


@triton.jit
def grouped_tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`: GROUP_M row tiles sweep the columns together.

    Consecutive programs take the GROUP_M row tiles of one column tile before moving to the next
    column, so the column's B tile is read from HBM once and then hit in L2.
    """
    programs_per_group = GROUP_M * num_pid_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % programs_per_group) % group_rows
    pid_n = (pid % programs_per_group) // group_rows
    return pid_m, pid_n
