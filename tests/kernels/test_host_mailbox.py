"""The mailbox kernel's protocol (rayinfer.kernels.comm.host_mailbox) between real processes.

Two or three processes map one shared-memory file, each runs the kernel in Triton's interpreter
(the same kernel the GPU runs, minus its PTX fences), and they exchange random blocks many times:
sizes from 0 to a whole box, aligned and unaligned, so both buffers of every pair, the acks
that guard them and empty slices are all used. The exchange numbers start just below the int32
limit, so they wrap mid-run. The GPU run (benchmarks/RESULTS.md, host mailbox) checks the
same kernel on H200s with fences and host-mapped memory."""

import multiprocessing as mp
import os

import pytest
import torch

BOX_BYTES = 1024
SLICES = 4
ROUNDS = 7
START_EPOCH = 2**31 - 4  # wraps to negative after 3 exchanges


def _layout(world: int) -> tuple[int, int]:
    """(bytes per rank, bytes of its boxes): per rank [dst][2 * BOX] boxes, then int32
    [dst][flags, acks][SLICES]."""
    boxes = world * 2 * BOX_BYTES
    return boxes + world * 2 * SLICES * 4, boxes


def _side(segment, world, src, dst, block, epochs):
    from rayinfer.kernels.comm.host_mailbox import MailboxSide

    per_rank, boxes = _layout(world)
    base = src * per_rank
    box = segment[base + dst * 2 * BOX_BYTES : base + (dst + 1) * 2 * BOX_BYTES]
    words = segment[base + boxes : base + per_rank].view(torch.int32).view(world, 2, SLICES)
    return MailboxSide(block, box, words[dst, 0], words[dst, 1], epochs)


def _blocks(world: int, round_: int) -> dict[tuple[int, int], torch.Tensor]:
    """Every rank builds the same blocks: (src, dst) -> bytes, sizes 0..BOX, some odd."""
    gen = torch.Generator().manual_seed(round_)
    blocks = {}
    for src in range(world):
        for dst in range(world):
            size = int(torch.randint(0, BOX_BYTES + 1, (), generator=gen))
            kind = int(torch.randint(0, 4, (), generator=gen))
            size = (0, BOX_BYTES, size, size - size % 16)[kind]
            blocks[(src, dst)] = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
    return blocks


def _rank_main(rank: int, world: int, path: str, results) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from rayinfer.kernels.comm.host_mailbox import exchange_reference, host_mailbox_exchange

    segment = torch.from_file(path, shared=True, size=world * _layout(world)[0], dtype=torch.uint8)
    epochs = torch.full((2, world, SLICES), START_EPOCH, dtype=torch.int32)
    failures = []
    for round_ in range(ROUNDS):
        blocks = _blocks(world, round_)
        for k in range(1, world):  # shifted rounds, as HostMailboxes launches them
            dst, src = (rank + k) % world, (rank - k) % world
            send_block, arriving = blocks[(rank, dst)], blocks[(src, rank)]
            # an unaligned destination in odd rounds: the byte-wise path
            landing = torch.zeros(arriving.numel() + 1, dtype=torch.uint8)[round_ % 2 :]
            landing = landing[: arriving.numel()]
            send = _side(segment, world, rank, dst, send_block, epochs[0, dst])
            recv = _side(segment, world, src, rank, landing, epochs[1, src])
            host_mailbox_exchange(
                send if send_block.numel() else None,
                recv if arriving.numel() else None,
                BOX_BYTES,
                SLICES,
                block_words=16,
            )
            expected = torch.empty_like(arriving)
            exchange_reference(arriving, expected)
            if not torch.equal(landing, expected):
                failures.append((round_, src, rank, arriving.numel()))
    results.put((rank, failures, epochs.tolist()))


@pytest.mark.parametrize("world", [2, 3])
def test_random_blocks_arrive_exactly_across_processes(tmp_path, world):
    path = str(tmp_path / "mailboxes")
    per_rank, boxes = _layout(world)
    memory = torch.zeros(world, per_rank, dtype=torch.uint8)
    memory[:, boxes:].view(torch.int32).fill_(START_EPOCH)  # flags and acks as the epochs
    memory.numpy().tofile(path)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, path, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=240) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for rank, failures, epochs in outcomes:
        assert failures == [], f"rank {rank}: blocks that arrived wrong {failures}"
        for direction in range(2):
            for peer in range(world):
                if peer == rank:
                    continue
                pair = (rank, peer) if direction == 0 else (peer, rank)
                moved = sum(bool(_blocks(world, r)[pair].numel()) for r in range(ROUNDS))
                # every slice counted every non-empty exchange, wrapping past int32's limit
                wrapped = (START_EPOCH + moved + 2**31) % 2**32 - 2**31
                assert epochs[direction][peer] == [wrapped] * SLICES
