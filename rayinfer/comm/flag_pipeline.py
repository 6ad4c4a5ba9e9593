"""GPU-driven chunk pipeline through shared host memory: no CPU in the loop.

For every chunk the sender's stream waits until the receiver has emptied the ring slot, copies
the chunk device-to-host into it and writes the slot's "published" flag; the receiver's stream
waits for that flag, copies the slot host-to-device and writes the slot's "consumed" flag. The
waits and writes are CUDA stream memory operations on page-locked host words, so the whole
exchange is queued at once and the call returns at once: the caller's stream waits for it with
events, which makes it overlap with any compute queued on other streams.

Each (peer, direction) has its own stream, so a slow pair never holds up another, and the chain
of waits for one pair depends only on that pair's two streams: no cycle, no deadlock, whatever
the order in which ranks queue their transfers.

Flags hold (chunk sequence number + 1) mod 2**32 per slot, and every wait is for equality with
the value the chunk before it in that slot left: a slot's flag can only be one step behind, so
the comparison stays right when the counter wraps.

A replayable pipeline (for CUDA graphs) cannot use sequence numbers: a graph replays the values
it was captured with. It uses one flag per slot as a two-state handshake instead: the sender
waits for 0 (empty), fills the slot and writes 1; the receiver waits for 1, empties the slot and
writes 0. Every replay leaves each slot it used empty, so any captured exchange may replay after
any other, as often as needed, as long as every rank replays the same graphs in the same order.
It queues every wait (the CPU cannot tell a slot's old 1 from its new one), which costs nothing
in a replay.

If a peer never arrives, the streams wait forever (as NCCL's kernels would); every rank of a
group must make the same calls in the same order.
"""

from __future__ import annotations

import ctypes
import math

import torch

from rayinfer.comm.cudart import CudaRuntime, StreamMemoryOps
from rayinfer.comm.shm import SharedSegments
from rayinfer.comm.transport import Transfer
from rayinfer.exchange_config import CHUNK_OVERHEAD_BYTES

# Chunk size for an n-byte block: sqrt(n * overhead), clamped. A pipeline of chunks of size c
# pays (n / c) fixed costs per chunk plus one chunk to fill, which is least near
# c = sqrt(n * fixed). The live pipeline's fixed cost is HostStagedConfig.chunk_overhead_bytes
# (default CHUNK_OVERHEAD_BYTES, whose comment has the measurement): blocks up to ~1 MiB (128
# tokens of 7168 bf16) go whole.
# In a graph replay the host queues nothing, and a chunk's fixed cost is the GPU's alone: the
# flag write, the peer's wait that polls for it and a copy's start, ~10 us on 2x H200, about
# 512 KiB of link time. Swept there (benchmarks/gpu_host_transport.py): 512 KiB beat 8, 32 and 128
# KiB at 0.9 and 3.7 MB blocks (2 chunks of a 0.9 MB block: 64.9 us, against 76.4 for 3 and
# 146.5 for 11) and tied at 15 MB.
REPLAY_OVERHEAD_BYTES = 512 << 10
_MIN_CHUNK_BYTES = 64 << 10


def chunk_bytes_for(
    num_bytes: int, max_chunk_bytes: int, overhead_bytes: int = CHUNK_OVERHEAD_BYTES
) -> int:
    """Both ends derive the same chunking from the block size alone; chunks of one block have
    (nearly) equal sizes."""
    target = min(max_chunk_bytes, max(_MIN_CHUNK_BYTES, math.isqrt(num_bytes * overhead_bytes)))
    pieces = max(1, -(-num_bytes // target))
    return max(1, -(-num_bytes // pieces))


class CudaQueues:
    """What the pipeline asks of the GPU: streams, events, async copies and flag operations.
    (Tests substitute a simulator with the same methods.)"""

    def __init__(self, device: torch.device):
        self.device = device
        self.runtime = CudaRuntime()
        self.ops = StreamMemoryOps()
        self.copy_async = self.runtime.copy_async
        self.new_event = self.runtime.new_event
        self.record_into = self.runtime.record_into
        self.wait_event = self.runtime.wait
        self.device_address = self.runtime.device_address
        self.wait_equal = self.ops.wait_equal
        self.write = self.ops.write

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def synchronize(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()


class FlagPipeline:
    def __init__(
        self,
        shm: SharedSegments,
        queues: CudaQueues,
        replayable: bool = False,
        overhead_bytes: int | None = None,
    ):
        """overhead_bytes: a chunk's fixed cost in bytes of link time, which sets the chunking
        (see chunk_bytes_for); default by mode."""
        self.shm = shm
        self.gpu = queues
        self.replayable = replayable
        default = REPLAY_OVERHEAD_BYTES if replayable else CHUNK_OVERHEAD_BYTES
        self._overhead_bytes = overhead_bytes or default
        n = shm.world_size
        self.sent = [0] * n  # chunks queued to each peer, over all calls
        self.received = [0] * n  # chunks queued from each peer, over all calls
        self._streams: dict[tuple[str, int], torch.cuda.Stream] = {}
        self._start_mark = self.gpu.new_event()
        self._end_marks: dict[tuple[str, int], object] = {}
        self._addresses: dict[int, int] = {}
        self._words: dict[int, ctypes.c_uint32] = {}  # host flag address -> its live word
        self._check_round_trip()

    def exchange(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        sends = [t for t in sends if t.buf.numel()]
        recvs = [t for t in recvs if t.buf.numel()]
        if not sends and not recvs:
            return
        caller = self.gpu.current_stream()
        used = [("d2h", t.peer) for t in sends] + [("h2d", t.peer) for t in recvs]
        streams = [self._stream(key) for key in used]
        self.gpu.record_into(self._start_mark, caller)  # the copies read what the caller made
        for stream in streams:
            self.gpu.wait_event(stream, self._start_mark)
        for t, stream in zip(sends, streams):
            self._queue_send(t, stream)
        for t, stream in zip(recvs, streams[len(sends) :]):
            self._queue_recv(t, stream)
        for key, stream in zip(used, streams):
            mark = self._end_mark(key)
            self.gpu.record_into(mark, stream)
            self.gpu.wait_event(caller, mark)

    def _queue_send(self, t: Transfer, stream) -> None:
        shm, me, peer = self.shm, self.shm.rank, t.peer
        for chunk in _chunks(t.buf, self._chunk_bytes(t.buf.numel())):
            seq = self.sent[peer]
            slot = seq % shm.num_slots
            if self.replayable:
                filled = self._device_address(shm.published_flag(me, peer, slot))
                self.gpu.wait_equal(stream, filled, 0)
                self.gpu.copy_async(shm.slot(me, peer, seq, chunk.numel()), chunk, stream)
                self.gpu.write(stream, filled, 1)
                self.sent[peer] = seq + 1
                continue
            if seq >= shm.num_slots:  # the slot's last chunk must have been taken out
                emptied = shm.consumed_flag(me, peer, slot)
                self._wait_unless_seen(stream, emptied, seq - shm.num_slots + 1)
            self.gpu.copy_async(shm.slot(me, peer, seq, chunk.numel()), chunk, stream)
            filled = self._device_address(shm.published_flag(me, peer, slot))
            self.gpu.write(stream, filled, seq + 1)
            self.sent[peer] = seq + 1

    def _queue_recv(self, t: Transfer, stream) -> None:
        shm, me, peer = self.shm, self.shm.rank, t.peer
        for chunk in _chunks(t.buf, self._chunk_bytes(t.buf.numel())):
            seq = self.received[peer]
            slot = seq % shm.num_slots
            if self.replayable:
                filled = self._device_address(shm.published_flag(peer, me, slot))
                self.gpu.wait_equal(stream, filled, 1)
                self.gpu.copy_async(chunk, shm.slot(peer, me, seq, chunk.numel()), stream)
                self.gpu.write(stream, filled, 0)
                self.received[peer] = seq + 1
                continue
            self._wait_unless_seen(stream, shm.published_flag(peer, me, slot), seq + 1)
            self.gpu.copy_async(chunk, shm.slot(peer, me, seq, chunk.numel()), stream)
            emptied = self._device_address(shm.consumed_flag(peer, me, slot))
            self.gpu.write(stream, emptied, seq + 1)
            self.received[peer] = seq + 1

    def _chunk_bytes(self, num_bytes: int) -> int:
        return chunk_bytes_for(num_bytes, self.shm.slot_bytes, self._overhead_bytes)

    def _wait_unless_seen(self, stream, host_address: int, value: int) -> None:
        """Queue a GPU wait for the flag, unless this CPU already reads the value: then the copy
        before the flag's write has finished (the write is fenced behind it), and one driver
        call less is queued. Ring slots freed long ago and chunks already sent skip it."""
        word = self._words.get(host_address)
        if word is None:  # one ctypes view per flag, read live each time
            word = self._words[host_address] = ctypes.c_uint32.from_address(host_address)
        if word.value != value & 0xFFFFFFFF:
            self.gpu.wait_equal(stream, self._device_address(host_address), value)

    def _stream(self, key: tuple[str, int]) -> torch.cuda.Stream:
        if key not in self._streams:
            self._streams[key] = self.gpu.new_stream()
        return self._streams[key]

    def _end_mark(self, key: tuple[str, int]):
        if key not in self._end_marks:
            self._end_marks[key] = self.gpu.new_event()
        return self._end_marks[key]

    def _device_address(self, host_address: int) -> int:
        if host_address not in self._addresses:
            self._addresses[host_address] = self.gpu.device_address(host_address)
        return self._addresses[host_address]

    def _check_round_trip(self) -> None:
        """A flag written by this GPU is seen by a wait on the same GPU, before any peer relies
        on it: the write comes first in stream order, so this cannot hang."""
        stream = self.gpu.new_stream()
        flag = self._device_address(self.shm.consumed_flag(self.shm.rank, self.shm.rank, 0))
        self.gpu.write(stream, flag, 0)
        self.gpu.wait_equal(stream, flag, 0)
        self.gpu.synchronize(stream)


def _chunks(buf: torch.Tensor, chunk_bytes: int):
    """[num_bytes] uint8 -> consecutive views of at most chunk_bytes (a block that fits in
    one chunk is itself: no view)."""
    num_bytes = buf.numel()
    if num_bytes <= chunk_bytes:
        return (buf,)
    return [buf[start : start + chunk_bytes] for start in range(0, num_bytes, chunk_bytes)]
