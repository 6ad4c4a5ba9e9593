"""One kernel moves a block to a peer GPU and another block from one, through page-locked host
memory that both GPUs map (no peer-to-peer, no copy engine, no CPU in the loop).

Each ordered pair of ranks (src -> dst) owns a mailbox in host memory: two buffers of
`box_bytes`, used alternately by successive exchanges, and per slice i of a block
  flags[i]  the last exchange number whose slice i src has written (written by src's GPU)
  acks[i]   the last exchange number whose slice i dst has read (written by dst's GPU).
A block is cut into `num_slices` byte ranges (multiples of 16 bytes), one per program, and both
ends cut it alike from its byte count. Exchange e of a pair uses buffer e % 2:
  sender program i   waits acks[i] >= e - 2 (the buffer is free), stores slice i into it,
                     then releases flags[i] = e;
  receiver program i waits flags[i] >= e (acquire), loads slice i, then releases acks[i] = e.
So the receiver of slice i starts as soon as that slice has landed, while other slices are
still on their way, and the whole exchange costs one launch. The exchange numbers live in device
memory ([num_slices] int32 per pair and direction, each program touching only its own), so a
CUDA graph that replays the launch stays in step with the peer. Comparisons are on the int32
difference, so counters may wrap.

One thread per program polls a flag (`ld.acquire.sys`) and, after a barrier, raises one
(`st.release.sys`): with every thread polling and fencing, a 0.9 MB exchange took 2.5-3x as long
(benchmarks/host_mapped_probe.py). Slice data from host memory is read with volatile loads,
never from a line cached by an earlier exchange. The polls and releases are inline PTX; Triton's
interpreter, which runs the same kernel in CPU processes over shared memory in CI, has no PTX and
needs none (its loads and stores are plain memory accesses, in program order).

`exchange_reference` is the plain copy the kernel must equal.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayinfer.kernels.triton_compat import tl, triton

SLICE_ALIGN_BYTES = 16  # slices start on 16-byte boundaries: 128-bit accesses when aligned


def is_wide(block: torch.Tensor) -> bool:
    """A block the kernel moves 16 bytes at a time: aligned, and a multiple of 16 bytes."""
    return block.data_ptr() % SLICE_ALIGN_BYTES == 0 and block.numel() % SLICE_ALIGN_BYTES == 0


@triton.jit
def _wait_until_reaches(flag_ptr, epoch):
    """Spin until the int32 at flag_ptr is >= epoch (as a wrapping difference)."""
    seen = tl.load(flag_ptr, volatile=True)
    while seen - epoch < 0:
        seen = tl.load(flag_ptr, volatile=True)


@triton.jit
def _leader_waits_until_reaches(flag_ptr, epoch, BACKOFF_NS: tl.constexpr):
    """Thread 0 alone polls the flag (acquire loads at system scope, napping up to BACKOFF_NS
    between polls) until it is >= epoch; then every thread of the program goes on (barrier).
    One poller per program instead of one per warp keeps the host link free for the data."""
    tl.inline_asm_elementwise(
        "{ .reg .pred %mbp<2>; .reg .b32 %mbr<3>;"
        " mov.u32 %mbr0, %tid.x; setp.ne.u32 %mbp0, %mbr0, 0;"
        " @%mbp0 bra MB_DONE_${:uid};"
        " MB_POLL_${:uid}: ld.acquire.sys.global.b32 %mbr1, [$1];"
        " sub.s32 %mbr2, %mbr1, $2; setp.lt.s32 %mbp1, %mbr2, 0;"
        " @!%mbp1 bra MB_DONE_${:uid}; nanosleep.u32 $3; bra MB_POLL_${:uid};"
        " MB_DONE_${:uid}: mov.u32 $0, 0; }",
        "=r,l,r,r",
        [flag_ptr.to(tl.int64, bitcast=True), epoch, BACKOFF_NS],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    tl.debug_barrier()


@triton.jit
def _leader_releases(flag_ptr, epoch):
    """After a barrier, thread 0 stores epoch with release semantics at system scope: every
    store the program made before is visible to the host and other GPUs before the flag is."""
    tl.debug_barrier()
    tl.inline_asm_elementwise(
        "{ .reg .pred %mbq; .reg .b32 %mbt; mov.u32 %mbt, %tid.x; setp.eq.u32 %mbq, %mbt, 0;"
        " @%mbq st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [flag_ptr.to(tl.int64, bitcast=True), epoch],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _slice_of(num_bytes, i, num_slices):
    """Byte range [start, end) of slice i: slices of one length, a multiple of 16 bytes, the
    last ones shorter or empty. Both ends of a pair cut a block alike from its size alone."""
    per = tl.cdiv(tl.cdiv(num_bytes, num_slices), 16) * 16
    start = tl.minimum(i * per, num_bytes)
    return start, tl.minimum(start + per, num_bytes)


@triton.jit
def _copy_bytes(dst, src, start, end, BLOCK: tl.constexpr, WIDE: tl.constexpr, FROM_HOST):
    """dst[start:end] <- src[start:end] (byte offsets). WIDE: both blocks 16-byte aligned and
    a multiple of 16 bytes long, so every access moves 16 bytes (4 int32 per thread)."""
    if WIDE:
        start = tl.multiple_of(start, 16)
        count = tl.multiple_of((end - start) // 4, 4)
        dst_words = tl.multiple_of((dst + start).to(tl.pointer_type(tl.int32), bitcast=True), 16)
        src_words = tl.multiple_of((src + start).to(tl.pointer_type(tl.int32), bitcast=True), 16)
    else:
        dst_words = dst + start
        src_words = src + start
        count = end - start
    for at in range(0, count, BLOCK):
        offs = at + tl.arange(0, BLOCK)
        mask = offs < count
        # host memory is read volatile: fetched again every time, never from a cached line
        values = tl.load(src_words + offs, mask=mask, volatile=FROM_HOST)
        tl.store(dst_words + offs, values, mask=mask)


@triton.jit
def _take_turn(
    epochs, i, num_slices, num_bytes, wait_on, lag, raise_on, box, block, box_bytes,
    INTO_BOX: tl.constexpr, WIDE: tl.constexpr, FROM_HOST: tl.constexpr, BLOCK: tl.constexpr,
    ON_GPU: tl.constexpr, BACKOFF_NS: tl.constexpr,
):  # fmt: skip
    """Program i's part of one direction of exchange e (its next exchange number): wait until
    wait_on[i] >= e - lag, copy slice i between the block and buffer e % 2 of the box (into the
    box when sending), then raise_on[i] = e."""
    epoch = tl.load(epochs + i) + 1
    if ON_GPU:
        _leader_waits_until_reaches(wait_on + i, epoch - lag, BACKOFF_NS)
    else:
        _wait_until_reaches(wait_on + i, epoch - lag)
    start, end = _slice_of(num_bytes, i, num_slices)
    buffer = box + (epoch & 1).to(tl.int64) * box_bytes
    if INTO_BOX:
        _copy_bytes(buffer, block, start, end, BLOCK, WIDE, FROM_HOST)
    else:
        _copy_bytes(block, buffer, start, end, BLOCK, WIDE, FROM_HOST)
    if ON_GPU:
        _leader_releases(raise_on + i, epoch)
    else:
        tl.store(raise_on + i, epoch)
    tl.store(epochs + i, epoch)


@triton.jit
def host_mailbox_kernel(
    send_src,  # [send_bytes] uint8, device: the block for the peer (unused when send_bytes == 0)
    send_box,  # [2 * box_bytes] uint8, host: this pair's two buffers
    send_flags,  # [num_slices] int32, host: exchange number of each slice written
    send_acks,  # [num_slices] int32, host: exchange number of each slice read by the peer
    send_epochs,  # [num_slices] int32, device: exchanges sent to this peer so far
    send_bytes,
    recv_dst,  # [recv_bytes] uint8, device: where the peer's block lands
    recv_box,
    recv_flags,
    recv_acks,
    recv_epochs,
    recv_bytes,
    box_bytes,
    SEND_WIDE: tl.constexpr,
    RECV_WIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    ON_GPU: tl.constexpr,  # False: Triton's interpreter (no PTX; plain polls and stores)
    BACKOFF_NS: tl.constexpr,
    VOLATILE_DATA: tl.constexpr,
):
    # grid: (num_slices, 2): axis 1 is 0 for the sending programs, 1 for the receiving ones
    # (sending programs come first in launch order, so they never wait behind spinning ones).
    i = tl.program_id(0)
    num_slices = tl.num_programs(0)
    if tl.program_id(1) == 0:
        if send_bytes > 0:  # wait for the buffer's last reader, fill it, raise the flag
            _take_turn(
                send_epochs, i, num_slices, send_bytes, send_acks, 2, send_flags, send_box,
                send_src, box_bytes, True, SEND_WIDE, False, BLOCK, ON_GPU, BACKOFF_NS,
            )  # fmt: skip
    else:
        if recv_bytes > 0:  # wait for the flag, empty the buffer, raise the ack
            _take_turn(
                recv_epochs, i, num_slices, recv_bytes, recv_flags, 0, recv_acks, recv_box,
                recv_dst, box_bytes, False, RECV_WIDE, VOLATILE_DATA, BLOCK, ON_GPU, BACKOFF_NS,
            )  # fmt: skip


class MailboxSide(NamedTuple):
    """One direction of one pair, as the kernel sees it: the block (device), the pair's two
    host buffers, its host flags and acks, and this rank's exchange numbers (device)."""

    block: torch.Tensor  # [num_bytes] uint8
    box: torch.Tensor  # [2 * box_bytes] uint8, host
    flags: torch.Tensor  # [num_slices] int32, host
    acks: torch.Tensor  # [num_slices] int32, host
    epochs: torch.Tensor  # [num_slices] int32, device


def host_mailbox_exchange(
    send: MailboxSide | None,
    recv: MailboxSide | None,
    box_bytes: int,
    num_slices: int,
    block_words: int = 1024,
    num_warps: int = 4,
    backoff_ns: int = 0,
    volatile_data: bool = True,
) -> None:
    """Queue one launch on the current stream: send.block to the peer of `send`, and the block
    from the peer of `recv` into recv.block (either may be None). Every block must fit a box."""
    if send is None and recv is None:
        return
    anchor = send or recv
    for side in (send, recv):
        if side is not None and side.block.numel() > box_bytes:
            raise ValueError(f"a {side.block.numel()}-byte block exceeds the {box_bytes}-byte box")
    send = send or _idle_side(anchor)
    recv = recv or _idle_side(anchor)
    host_mailbox_kernel[(num_slices, 2)](
        send.block,
        send.box,
        send.flags,
        send.acks,
        send.epochs,
        send.block.numel(),
        recv.block,
        recv.box,
        recv.flags,
        recv.acks,
        recv.epochs,
        recv.block.numel(),
        box_bytes,
        SEND_WIDE=is_wide(send.block),
        RECV_WIDE=is_wide(recv.block),
        BLOCK=block_words,
        ON_GPU=anchor.epochs.is_cuda,
        BACKOFF_NS=backoff_ns,
        VOLATILE_DATA=volatile_data,
        num_warps=num_warps,
    )


def _idle_side(like: MailboxSide) -> MailboxSide:
    """Arguments for the direction that moves nothing this launch (its programs return)."""
    return like._replace(block=like.block[:0])


def exchange_reference(send_block: torch.Tensor, recv_block: torch.Tensor) -> None:
    """What one pair's exchange amounts to: the peer's block lands in recv_block unchanged."""
    recv_block.copy_(send_block)
