"""The GPU-driven host-staged protocol (flag_pipeline.py), run on a stream simulator.

CUDA streams cannot run here, so each rank's streams are simulated: queues of operations that
run in order, a flag wait only once the real 32-bit word in shared memory holds its value. A
scheduler steps the streams of all ranks in a random order, so every test sees many
interleavings; a pass in which nothing can run while work remains is a deadlock. The GPU run
(benchmarks/RESULTS.md, comm) checks the same protocol on real streams.
"""

import ctypes
import random
import threading

import pytest
import torch
import torch.distributed as dist

from rayinfer.comm.flag_pipeline import FlagPipeline, chunk_bytes_for
from rayinfer.comm.refs import all_to_all_ref, random_split_matrix
from rayinfer.comm.shm import SharedSegments
from rayinfer.comm.transport import Transfer


class SimStream:
    def __init__(self):
        self.ops: list[tuple] = []


class SimEvent:
    def __init__(self):
        self.recorded = 0  # records queued so far
        self.done = 0  # records that ran


class SimulatedGpu:
    """The CudaQueues interface, on simulated streams."""

    def __init__(self):
        self.streams: list[SimStream] = []
        self.caller = self.new_stream()
        self.waits_queued = 0

    def current_stream(self) -> SimStream:
        return self.caller

    def new_stream(self) -> SimStream:
        self.streams.append(SimStream())
        return self.streams[-1]

    def new_event(self) -> SimEvent:
        return SimEvent()

    def record_into(self, event: SimEvent, stream: SimStream) -> None:
        event.recorded += 1
        stream.ops.append(("record", event, event.recorded))

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        stream.ops.append(("wait_event", event, event.recorded))

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream) -> None:
        stream.ops.append(("copy", dst, src))

    def wait_equal(self, stream: SimStream, address: int, value: int) -> None:
        self.waits_queued += 1
        stream.ops.append(("wait", address, value & 0xFFFFFFFF))

    def write(self, stream: SimStream, address: int, value: int) -> None:
        stream.ops.append(("write", address, value & 0xFFFFFFFF))

    def device_address(self, host_address: int) -> int:
        return host_address

    def synchronize(self, stream: SimStream) -> None:
        while stream.ops:
            assert step(stream), "a stream waits on itself"


def step(stream: SimStream) -> bool:
    """Run the stream's first operation if it can run now."""
    op = stream.ops[0]
    if op[0] == "wait" and ctypes.c_uint32.from_address(op[1]).value != op[2]:
        return False
    if op[0] == "wait_event" and op[1].done < op[2]:
        return False
    if op[0] == "write":
        ctypes.c_uint32.from_address(op[1]).value = op[2]
    elif op[0] == "copy":
        op[1].copy_(op[2])
    elif op[0] == "record":
        op[1].done = max(op[1].done, op[2])
    stream.ops.pop(0)
    return True


def run_all(gpus: list[SimulatedGpu], rng: random.Random) -> None:
    streams = [s for g in gpus for s in g.streams]
    while any(s.ops for s in streams):
        rng.shuffle(streams)
        progress = False
        for s in streams:
            for _ in range(rng.randint(1, 3)):
                if s.ops and step(s):
                    progress = True
        assert progress, "deadlock: every stream with work waits"


def make_pipelines(world_size: int, slot_bytes: int, num_slots: int, replayable: bool = False):
    store = dist.HashStore()
    segments: list[SharedSegments | None] = [None] * world_size

    def build(rank: int) -> None:
        segments[rank] = SharedSegments(store, rank, world_size, slot_bytes, num_slots, pin=False)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gpus = [SimulatedGpu() for _ in range(world_size)]
    pipes = [FlagPipeline(shm, gpu, replayable) for shm, gpu in zip(segments, gpus)]
    return pipes, gpus


def exchange_all(pipes, gpus, inputs, matrix, rng) -> list[torch.Tensor]:
    """Every rank queues its whole all-to-all, then the simulated GPUs run."""
    n = len(pipes)
    outs = []
    for me, pipe in enumerate(pipes):
        out = torch.full((sum(matrix[s][me] for s in range(n)), inputs[me].shape[1]), -1.0)
        sends, recvs, sent_at, got_at = [], [], 0, 0
        for peer in range(n):
            rows_out, rows_in = matrix[me][peer], matrix[peer][me]
            block_out = inputs[me][sent_at : sent_at + rows_out]
            block_in = out[got_at : got_at + rows_in]
            if peer == me:
                block_in.copy_(block_out)
            else:
                sends.append(Transfer(peer, block_out.reshape(-1).view(torch.uint8)))
                recvs.append(Transfer(peer, block_in.reshape(-1).view(torch.uint8)))
            sent_at, got_at = sent_at + rows_out, got_at + rows_in
        order = list(range(len(sends)))
        rng.shuffle(order)  # ranks may queue their transfers in any order
        pipe.exchange([sends[i] for i in order], [recvs[i] for i in order])
        outs.append(out)
    run_all(gpus, rng)
    return outs


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_uneven_all_to_all_arrives_exactly_over_many_calls(world_size):
    """Tiny slots (1 KiB, 2 per ring) force many chunks per block and constant slot reuse."""
    pipes, gpus = make_pipelines(world_size, slot_bytes=1024, num_slots=2)
    gen, rng = torch.Generator().manual_seed(world_size), random.Random(world_size)
    for call in range(4):
        matrix = random_split_matrix(world_size, 40, gen)
        inputs = [torch.randn(sum(matrix[r]), 24, generator=gen) for r in range(world_size)]
        outs = exchange_all(pipes, gpus, inputs, matrix, rng)
        expected = all_to_all_ref(inputs, matrix)
        for me in range(world_size):
            assert torch.equal(outs[me], expected[me]), f"call {call}, rank {me}"
    # Every received chunk and every sent chunk that reuses a slot needs its flag; flags the
    # CPU already saw set (slots freed by an earlier call) queue no GPU wait.
    needed = sum(sum(p.received) + sum(max(0, n - 2) for n in p.sent) for p in pipes)
    waits = sum(g.waits_queued for g in gpus)
    assert 0 < waits < needed


def test_sequence_numbers_wrap_past_32_bits():
    """Flags hold sequence + 1 mod 2**32 and waits compare for equality: crossing the wrap
    keeps working. Both ranks start just below it, with each slot's flags as the chunk that last
    used it left them."""
    pipes, gpus = make_pipelines(2, slot_bytes=1024, num_slots=2)
    start = 2**32 - 3
    for me, pipe in enumerate(pipes):
        peer = 1 - me
        pipe.sent[peer] = pipe.received[peer] = start
        for seq in range(start - 2, start):
            slot, value = seq % 2, (seq + 1) & 0xFFFFFFFF
            for address in (
                pipe.shm.published_flag(me, peer, slot),
                pipe.shm.consumed_flag(peer, me, slot),
            ):
                ctypes.c_uint32.from_address(address).value = value
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    matrix = [[5, 90], [70, 3]]  # 90 x 24 float32 rows: 9 chunks of 1 KiB cross the wrap
    inputs = [torch.randn(sum(matrix[r]), 24, generator=gen) for r in range(2)]
    outs = exchange_all(pipes, gpus, inputs, matrix, rng)
    expected = all_to_all_ref(inputs, matrix)
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))
    assert pipes[0].sent[1] > 2**32


def test_chunking_balances_chunks_and_grows_with_the_block():
    """Chunk ~ sqrt(bytes x 1 MiB): a 0.9 MB block (128 tokens of 7168 bf16) goes whole, 29 MB
    (4k tokens) in ~5.5 MB chunks, 117 MB (16k tokens) in 8 MiB slots; never above the slot;
    the chunks of one block have equal sizes."""
    assert chunk_bytes_for(917_504, 8 << 20) == 917_504
    assert chunk_bytes_for(29_360_128, 8 << 20) == -(-29_360_128 // 6)
    assert chunk_bytes_for(117_440_512, 8 << 20) == 8 << 20
    assert chunk_bytes_for(100, 8 << 20) == 100
    assert chunk_bytes_for(10 << 20, 1024) == 1024


@pytest.mark.parametrize("world_size", [2, 3])
def test_replayable_pipeline_repeats_the_same_slots_and_values(world_size):
    """The two-state protocol of CUDA graphs, as a replay runs it: every "replay" queues the same
    operations (the same slots, the same flag values: the counters are put back to where the
    capture found them) on new data. 1 KiB slots, 2 per ring: blocks reuse slots within one
    replay. Every replay arrives exactly, and leaves every flag at 0 (empty) for the next."""
    pipes, gpus = make_pipelines(world_size, slot_bytes=1024, num_slots=2, replayable=True)
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    for pipe in pipes:  # the capture happened after some earlier exchanges
        pipe.sent = [5] * world_size
        pipe.received = [5] * world_size
    captured = [(list(p.sent), list(p.received)) for p in pipes]
    matrix = random_split_matrix(world_size, 40, gen)
    for replay in range(5):
        for pipe, (sent, received) in zip(pipes, captured):
            pipe.sent, pipe.received = list(sent), list(received)
        inputs = [torch.randn(sum(matrix[r]), 24, generator=gen) for r in range(world_size)]
        outs = exchange_all(pipes, gpus, inputs, matrix, rng)
        expected = all_to_all_ref(inputs, matrix)
        for me in range(world_size):
            assert torch.equal(outs[me], expected[me]), f"replay {replay}, rank {me}"
        for pipe in pipes:
            for peer in range(world_size):
                for slot in range(2):
                    flag = pipe.shm.published_flag(pipe.shm.rank, peer, slot)
                    assert ctypes.c_uint32.from_address(flag).value == 0


def test_a_capture_without_a_replayable_path_fails_naming_the_fix():
    """A host transport that cannot replay (no GPU-driven protocol, no mailbox for the block)
    refuses to be captured, rather than baking flag values into a graph."""
    from rayinfer.comm.host_staged import HostStagedTransport

    transport = HostStagedTransport(dist.HashStore(), 0, 1, torch.device("cpu"))
    assert transport.replay_pipeline is None and transport.mailboxes is None
    block = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="all_to_all.transport=dist for graphs"):
        transport._exchange_in_graph([Transfer(0, block)], [])
    transport._exchange_in_graph([], [])  # nothing to move: nothing to refuse
    transport.close()


def test_host_staged_settings_are_checked():
    from rayinfer.config import ConfigError
    from rayinfer.exchange_config import CHUNK_OVERHEAD_BYTES, HostStagedConfig

    default = HostStagedConfig()
    assert default.direct_max_bytes == 0  # the mailbox is opt-in
    assert default.protocol == "auto" and default.chunk_overhead_bytes == CHUNK_OVERHEAD_BYTES
    assert HostStagedConfig(direct_max_bytes=4 << 20).direct_max_bytes == 4 << 20
    for bad in ("4MB", -1, True):
        with pytest.raises(ConfigError, match=r"all_to_all\.host\.direct_max_bytes=.* >= 0"):
            HostStagedConfig(direct_max_bytes=bad)
    with pytest.raises(ConfigError, match=r"all_to_all\.host\.chunk_overhead_bytes=0 .* >= 1"):
        HostStagedConfig(chunk_overhead_bytes=0)
    with pytest.raises(ConfigError, match=r"all_to_all\.host\.protocol='nvlink'; use one of auto"):
        HostStagedConfig(protocol="nvlink")
