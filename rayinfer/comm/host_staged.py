"""Host-staged transport: GPU -> shared pinned host memory -> GPU, for GPUs without peer access.

On GPUs the chunks are handed over by the GPUs themselves (flag_pipeline.py): the call queues
the whole exchange and returns. Where the driver lacks stream memory operations, and on CPU,
the CPU drives the same ring of slots as follows. Each block is cut into chunks. The sender
copies chunk i into a ring slot of its own shared segment (device-to-host on its own CUDA
stream) and publishes a counter once the copy is done; the receiver sees the counter, copies the
slot into its output (host-to-device on another stream) and, once done, tells the sender the
slot is free. Both directions of every GPU's host link run at once, and chunk i+1 leaves while
chunk i arrives. On CPU the copies are memcpy and the same protocol runs, so CI exercises it.

Exchanges captured in a CUDA graph go through a second GPU-driven pipeline with its own ring,
whose flags replay (two-state handshakes, flag_pipeline.py). Opt-in, blocks up to
`direct_max_bytes` (HostStagedConfig) go through the mailbox kernel instead (mailbox.py), eager
or captured.
"""

import os
import time
import warnings
from collections import deque

import torch
import torch.distributed as dist

from rayinfer.comm.cudart import CudaRuntime
from rayinfer.comm.flag_pipeline import CudaQueues, FlagPipeline
from rayinfer.comm.mailbox import HostMailboxes
from rayinfer.comm.shm import SharedSegments
from rayinfer.comm.transport import Transfer, Transport
from rayinfer.exchange_config import CHUNK_OVERHEAD_BYTES

_MIN_CHUNK_BYTES = 256 << 10


class _Job:
    """One block in flight: [num_bytes] uint8 `buf`, cut into chunks of `chunk_bytes`."""

    __slots__ = ("peer", "buf", "chunk_bytes", "num_chunks", "next_chunk")

    def __init__(self, peer: int, buf: torch.Tensor, chunk_bytes: int):
        self.peer, self.buf, self.chunk_bytes = peer, buf, chunk_bytes
        self.num_chunks = -(-buf.numel() // chunk_bytes)
        self.next_chunk = 0

    def chunk(self, i: int) -> torch.Tensor:
        if self.num_chunks == 1:  # small blocks go whole: no view
            return self.buf
        return self.buf[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]


class _Copier:
    """Copies on two CUDA streams (device-to-host, host-to-device), or plain memcpy on CPU.
    On CUDA, tickets are events; copies go through ctypes (cudart.py) when it loads."""

    def __init__(self, device: torch.device):
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.runtime = _runtime_or_none()
            if self.runtime is not None:
                self.marks = [self.runtime.new_event() for _ in range(2)]

    def begin(self) -> None:
        if not self.is_cuda:
            return
        caller = torch.cuda.current_stream()
        if self.runtime is not None:
            self.runtime.order(caller, self.d2h, self.marks[0])
            self.runtime.order(caller, self.h2d, self.marks[0])
        else:
            self.d2h.wait_stream(caller)
            self.h2d.wait_stream(caller)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, to_host: bool):
        """Start dst <- src; returns a ticket for `is_done` (None: already done)."""
        if not self.is_cuda:
            dst.copy_(src)
            return None
        stream = self.d2h if to_host else self.h2d
        if self.runtime is not None:
            self.runtime.copy_async(dst, src, stream)
            return self.runtime.record(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            return stream.record_event()

    def is_done(self, ticket) -> bool:
        if ticket is None:
            return True
        return self.runtime.is_done(ticket) if self.runtime is not None else ticket.query()

    def end(self) -> None:
        if not self.is_cuda:
            return
        if self.runtime is not None:
            self.runtime.order(self.h2d, torch.cuda.current_stream(), self.marks[1])
        else:
            torch.cuda.current_stream().wait_stream(self.h2d)


def _gpu_pipeline_or_none(
    shm: SharedSegments, device: torch.device, protocol: str, overhead_bytes: int
) -> FlagPipeline | None:
    """The GPU-driven protocol where it can run, unless the CPU-driven one is asked for."""
    if protocol not in ("auto", "gpu", "cpu"):
        raise ValueError(f"host-staged protocol {protocol!r}: use 'auto', 'gpu' or 'cpu'")
    if device.type != "cuda" or protocol == "cpu":
        return None
    try:
        return FlagPipeline(shm, CudaQueues(device), overhead_bytes=overhead_bytes)
    except (OSError, AttributeError, RuntimeError) as e:
        warnings.warn(f"host-staged transport: CPU-driven copies ({e})", stacklevel=2)
        return None


def _replay_pipeline_or_none(
    store: dist.Store, pipeline: FlagPipeline | None, overhead_bytes: int | None
) -> FlagPipeline | None:
    """Where the GPU-driven protocol runs, a second one with its own ring for exchanges captured
    in CUDA graphs (its two-state flags replay; the live pipeline's sequence numbers would not).
    Its ring is small: graphs hold decode steps, whose blocks are a few MB at most."""
    if pipeline is None:
        return None
    shm = pipeline.shm
    ring = SharedSegments(
        dist.PrefixStore("replay", store), shm.rank, shm.world_size, 1 << 20, 8, pin=True
    )
    return FlagPipeline(ring, pipeline.gpu, replayable=True, overhead_bytes=overhead_bytes)


def _runtime_or_none():
    try:
        return CudaRuntime()
    except (OSError, AttributeError, RuntimeError) as e:
        warnings.warn(f"host-staged transport: slower torch copies ({e})", stacklevel=2)
        return None


class HostStagedTransport(Transport):
    name = "host"

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        chunk_bytes: int | None = None,
        num_slots: int | None = None,
        timeout_s: float = 120.0,
        protocol: str = "auto",
        direct_max_bytes: int = 0,
        chunk_overhead_bytes: int = CHUNK_OVERHEAD_BYTES,
        replay_overhead_bytes: int | None = None,
    ):
        """protocol: "auto" (GPU-driven on CUDA where the driver allows, else CPU-driven),
        "gpu" or "cpu". direct_max_bytes: blocks up to this size go through the one-launch
        mailbox kernel (0: never). chunk_overhead_bytes: the live pipeline's chunking (see
        flag_pipeline.chunk_bytes_for); the three as in HostStagedConfig.
        replay_overhead_bytes: the chunking of exchanges captured in graphs (see
        flag_pipeline.chunk_bytes_for); default flag_pipeline.REPLAY_OVERHEAD_BYTES."""
        super().__init__(rank, world_size)
        is_cuda = device.type == "cuda"
        # GPU: up to 8 MiB chunks for 2 ranks (a 117 MB exchange wants ~8 MiB, see
        # flag_pipeline.chunk_bytes_for), 4 MiB beyond, so 8 ranks share 1 GiB of host memory.
        # CPU runs (CI) use 256 KiB so that 8 ranks share 64 MiB of shared memory.
        default_chunk = ((8 << 20) if world_size <= 2 else (4 << 20)) if is_cuda else None
        chunk_bytes = chunk_bytes or default_chunk or _MIN_CHUNK_BYTES
        num_slots = num_slots or (8 if is_cuda and world_size <= 4 else 4)
        self.chunk_bytes, self.timeout_s = chunk_bytes, timeout_s
        self.shm = SharedSegments(store, rank, world_size, chunk_bytes, num_slots, pin=is_cuda)
        self.pipeline = _gpu_pipeline_or_none(self.shm, device, protocol, chunk_overhead_bytes)
        self.replay_pipeline = _replay_pipeline_or_none(store, self.pipeline, replay_overhead_bytes)
        self.copier = _Copier(device)
        self.mailboxes = None
        if direct_max_bytes > 0:
            box_bytes = -(-direct_max_bytes // 16) * 16
            self.mailboxes = HostMailboxes(
                dist.PrefixStore("mailbox", store), rank, world_size, device, box_bytes
            )
        self.sent = [0] * world_size  # chunks issued to each peer, over all calls
        self.received = [0] * world_size  # chunks issued from each peer, over all calls

    def chunk_bytes_for(self, num_bytes: int) -> int:
        """Both ends derive the same chunking from the block size alone; small blocks use
        smaller chunks so that even they pipeline."""
        return min(self.chunk_bytes, max(_MIN_CHUNK_BYTES, -(-num_bytes // 4)))

    @property
    def protocol(self) -> str:
        """ "gpu": the GPUs hand chunks over by themselves; "cpu": this process drives them."""
        return "gpu" if self.pipeline is not None else "cpu"

    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        if self.copier.is_cuda and torch.cuda.is_current_stream_capturing():
            self._exchange_in_graph(sends, recvs)
            return
        if self.mailboxes is not None:
            sends, recvs = self._small_blocks_through_mailboxes(sends, recvs)
            if not sends and not recvs:
                return
        if self.pipeline is not None:
            self.pipeline.exchange(sends, recvs)
            return
        send_jobs = [self._job(t) for t in sends if t.buf.numel()]
        recv_jobs = [self._job(t) for t in recvs if t.buf.numel()]
        self.copier.begin()
        in_flight_sends, in_flight_recvs = deque(), deque()
        deadline, idle = time.monotonic() + self.timeout_s, 0
        while send_jobs or recv_jobs or in_flight_sends or in_flight_recvs:
            progress = self._issue_sends(send_jobs, in_flight_sends)
            progress |= self._retire(in_flight_sends, self.shm.publish)
            progress |= self._issue_recvs(recv_jobs, in_flight_recvs)
            progress |= self._retire(in_flight_recvs, self.shm.consume)
            idle = 0 if progress else idle + 1
            if idle > 64:
                self._back_off(deadline, idle)
        self.copier.end()

    def _exchange_in_graph(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        """Being captured: only what replays (the mailbox kernel, the two-state pipeline)."""
        if self.mailboxes is not None:
            sends, recvs = self._small_blocks_through_mailboxes(sends, recvs)
        if not sends and not recvs:
            return
        if self.replay_pipeline is None:
            raise RuntimeError(
                "the host-staged transport cannot be captured in a CUDA graph here: the driver "
                "lacks stream memory operations (all_to_all.host.protocol=cpu?); use "
                "all_to_all.transport=dist for graphs"
            )
        self.replay_pipeline.exchange(sends, recvs)

    def _small_blocks_through_mailboxes(self, sends, recvs):
        """Queue the blocks that fit a mailbox; returns (sends, recvs) left for the copies.
        Both ends split alike: each block's size decides, and both ends know it."""
        fits = self.mailboxes.fits
        self.mailboxes.exchange([t for t in sends if fits(t)], [t for t in recvs if fits(t)])
        return [t for t in sends if not fits(t)], [t for t in recvs if not fits(t)]

    def _job(self, t: Transfer) -> _Job:
        return _Job(t.peer, t.buf, self.chunk_bytes_for(t.buf.numel()))

    def _issue_sends(self, jobs: list[_Job], in_flight: deque) -> bool:
        progress = False
        for job in list(jobs):
            while job.next_chunk < job.num_chunks and self._has_free_slot(job.peer):
                chunk = job.chunk(job.next_chunk)
                seq = self.sent[job.peer]
                slot = self.shm.slot(self.rank, job.peer, seq, chunk.numel())
                in_flight.append((self.copier.copy(slot, chunk, to_host=True), job.peer, seq + 1))
                self.sent[job.peer] += 1
                job.next_chunk += 1
                progress = True
            if job.next_chunk == job.num_chunks:
                jobs.remove(job)
        return progress

    def _issue_recvs(self, jobs: list[_Job], in_flight: deque) -> bool:
        progress = False
        for job in list(jobs):
            src = job.peer
            while (
                job.next_chunk < job.num_chunks
                and self.shm.published(src, self.rank) > (self.received[src])
            ):
                chunk = job.chunk(job.next_chunk)
                slot = self.shm.slot(src, self.rank, self.received[src], chunk.numel())
                self.received[src] += 1
                in_flight.append(
                    (self.copier.copy(chunk, slot, to_host=False), src, self.received[src])
                )
                job.next_chunk += 1
                progress = True
            if job.next_chunk == job.num_chunks:
                jobs.remove(job)
        return progress

    def _has_free_slot(self, dst: int) -> bool:
        return self.sent[dst] < self.shm.consumed(dst, self.rank) + self.shm.num_slots

    def _retire(self, in_flight: deque, announce) -> bool:
        """Announce finished copies in issue order (one stream, so they finish in order)."""
        progress = False
        while in_flight and self.copier.is_done(in_flight[0][0]):
            _, peer, count = in_flight.popleft()
            announce(peer, count)
            progress = True
        return progress

    def _back_off(self, deadline: float, idle: int) -> None:
        """On GPU keep spinning (each event query through ctypes drops the GIL, so other
        threads still run): time.sleep(0) lasts ~60 us of timer slack, and three such naps
        (copy done, flag seen, copy done) made a 64 KiB exchange take 190 us on 2x H200.
        On CPU (CI: 8 ranks on 2 cores) sleep, so that the ranks that can progress get a core."""
        if idle % 4096 == 0 and time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {self.rank}: host-staged exchange made no progress for "
                f"{self.timeout_s:.0f} s; every rank of the group must call the same collectives "
                "in the same order"
            )
        if self.copier.is_cuda:
            os.sched_yield()
        else:
            time.sleep(50e-6)

    def close(self) -> None:
        self.shm.close()
        if self.replay_pipeline is not None:
            self.replay_pipeline.shm.close()
        if self.mailboxes is not None:
            self.mailboxes.close()
