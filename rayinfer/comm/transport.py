"""Transports move byte blocks between ranks; schedules decide which blocks move together.

Every rank calls `exchange` the same number of times per schedule (a transport may run a
group-wide collective underneath, as the torch.distributed one does).
"""

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.distributed as dist

from rayinfer.comm.layout import offsets


class Transfer(NamedTuple):
    """One block to send to, or receive from, `peer`.

    buf: [num_bytes] uint8: contiguous bytes (a slice of the caller's rows, or a staging buffer).
    (A tuple: made several times per exchange, and a frozen dataclass costs twice as much.)
    """

    peer: int
    buf: torch.Tensor


class Transport(ABC):
    name: str

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        """Send every `sends` block and fill every `recvs` block; returns when `recvs` are usable
        on the caller's stream and `sends` may be reused."""

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        """All pairs at once. out, inp: [rows, row_bytes] uint8. Empty blocks are left out of
        the exchange (every transport skips them anyway)."""
        out_flat, in_flat = out.view(-1), inp.view(-1)  # one view each; a byte slice per block
        out_row, in_row, me = out.shape[1], inp.shape[1], self.rank
        sends, recvs, out_at, in_at = [], [], 0, 0
        for p in range(self.world_size):
            out_end, in_end = out_at + out_splits[p] * out_row, in_at + in_splits[p] * in_row
            if p == me:
                if out_end > out_at:
                    out_flat[out_at:out_end].copy_(in_flat[in_at:in_end])
            else:
                if in_end > in_at:
                    sends.append(Transfer(p, in_flat[in_at:in_end]))
                if out_end > out_at:
                    recvs.append(Transfer(p, out_flat[out_at:out_end]))
            out_at, in_at = out_end, in_end
        self.exchange(sends, recvs)

    def close(self) -> None:
        """Release shared resources (buffers, files)."""


class DistTransport(Transport):
    """torch.distributed: each exchange is one alltoall_base (NCCL grouped send/recv on GPU,
    gloo on CPU) in which ranks outside the exchange carry zero bytes."""

    name = "dist"

    def __init__(self, pg: dist.ProcessGroup, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self.pg = pg

    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        send_buf, in_splits = self._pack(sends)
        recv_buf, out_splits = self._pack(recvs, allocate_only=True)
        self.pg.alltoall_base(
            recv_buf, send_buf, out_splits, in_splits, dist.AllToAllOptions()
        ).wait()
        if len(recvs) > 1:
            at = offsets(out_splits)
            for t in recvs:
                t.buf.copy_(recv_buf[at[t.peer] : at[t.peer + 1]])

    def all_to_all(self, out, inp, out_splits, in_splits) -> None:
        self.pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()).wait()

    def _pack(self, transfers: list[Transfer], allocate_only: bool = False):
        """Lay the blocks out in peer order: [total_bytes] uint8 plus bytes per peer."""
        splits = [0] * self.world_size
        for t in transfers:
            splits[t.peer] = t.buf.numel()
        if len(transfers) == 1:
            return transfers[0].buf, splits
        if not transfers:
            return torch.empty(0, dtype=torch.uint8, device=self._device()), splits
        ordered = sorted(transfers, key=lambda t: t.peer)
        if allocate_only:
            return torch.empty(sum(splits), dtype=torch.uint8, device=ordered[0].buf.device), splits
        return torch.cat([t.buf for t in ordered]), splits

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if _uses_cuda(self.pg) else "cpu"


def _uses_cuda(pg: dist.ProcessGroup) -> bool:
    return "nccl" in pg.name().lower()
