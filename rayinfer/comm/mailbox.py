"""The host-staged transport's low-latency path: small blocks cross host memory in one kernel
launch per round, with no copy engine and no CPU in the loop (rayinfer.kernels.comm.host_mailbox).

A copy-engine pipeline pays for each block a device-to-host copy, a flag, a wait and a
host-to-device copy, each queued by a driver call (~20 us apiece on a VM). Here the sending
GPU's programs store the block into the peer's mailbox in page-locked host memory and raise
per-slice flags; the receiving GPU's programs poll those flags and load each slice as soon as it
lands: one launch, no driver calls, and it replays in CUDA graphs.

Measured on 2x H200 (VM, RESULTS.md "host mailbox"): the programs move ~23 GB/s each way through
host memory where the copy engines move ~52, and Triton's launcher costs ~35 us of host time, so
eagerly it loses to the copy pipeline at every size. Replayed in a graph it is at par with the
pipeline (3.7 MB blocks: 165 us against 172) and with NCCL (0.9 MB: 58 us against 63). Hence
opt-in (all_to_all.host.direct_max_bytes, HostStagedConfig).

Every rank maps every rank's mailboxes (SharedSegments). A round pairs one send with one
receive, shifted as in the pairwise schedule (send to me + k, receive from me - k): a launch's
receiving programs wait only for the peer's launch of the same round, whose sending programs
never wait on the current round, so no order of launches across ranks can deadlock.

Both ends decide from a block's byte count alone whether it goes through the mailbox, so
they always agree (the counts are part of the exchange's contract).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rayinfer.comm.shm import SharedSegments
from rayinfer.comm.transport import Transfer
from rayinfer.kernels.comm.host_mailbox import MailboxSide, host_mailbox_exchange

# Programs per direction (each carries 1/32 of a block) and int32 words per program step: the
# fastest of 16-128 programs and 1,024 or 4,096 words on an H200 (benchmarks/host_mapped_probe.py,
# loopback); more programs only add flag traffic on the host link.
DEFAULT_SLICES = 32
BLOCK_WORDS = 4096


class HostMailboxes:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        box_bytes: int,
        num_slices: int = DEFAULT_SLICES,
    ):
        if box_bytes % 16:
            raise ValueError(f"box_bytes={box_bytes} must be a multiple of 16")
        self.rank, self.world_size = rank, world_size
        self.box_bytes, self.num_slices = box_bytes, num_slices
        pin = device.type == "cuda"
        self.boxes = SharedSegments(
            dist.PrefixStore("boxes", store), rank, world_size, box_bytes, 2, pin
        )
        flag_bytes = -(-2 * num_slices * 4 // 16) * 16  # flags then acks, int32 per slice
        self.flags = SharedSegments(
            dist.PrefixStore("flags", store), rank, world_size, flag_bytes, 1, pin
        )
        # [direction (0 send, 1 receive), peer, slice]: exchanges done so far, per program
        self.epochs = torch.zeros(2, world_size, num_slices, dtype=torch.int32, device=device)
        self.launches = 0  # kernel launches so far (tests check that the path ran)
        self._pairs: dict[tuple[int, int], tuple] = {}  # (src, dst) -> box, flags, acks, epochs

    def fits(self, t: Transfer) -> bool:
        return t.buf.numel() <= self.box_bytes

    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        """Move every block (each must fit a box) on the current stream, one launch per round."""
        to_peer = {t.peer: t for t in sends if t.buf.numel()}
        from_peer = {t.peer: t for t in recvs if t.buf.numel()}
        me, n = self.rank, self.world_size
        for k in range(1, n):
            send, recv = to_peer.get((me + k) % n), from_peer.get((me - k) % n)
            if send is None and recv is None:
                continue
            host_mailbox_exchange(
                self._side(me, send.peer, send.buf, 0) if send else None,
                self._side(recv.peer, me, recv.buf, 1) if recv else None,
                self.box_bytes,
                self.num_slices,
                BLOCK_WORDS,
            )
            self.launches += 1

    def _side(self, src: int, dst: int, block: torch.Tensor, direction: int) -> MailboxSide:
        pair = self._pairs.get((src, dst))
        if pair is None:
            peer = dst if direction == 0 else src
            flags = self.flags.ring(src, dst)[: 8 * self.num_slices].view(torch.int32)
            pair = self._pairs[(src, dst)] = (
                self.boxes.ring(src, dst),
                flags[: self.num_slices],
                flags[self.num_slices :],
                self.epochs[direction, peer],
            )
        return MailboxSide(block, *pair)

    def close(self) -> None:
        self.boxes.close()
        self.flags.close()
