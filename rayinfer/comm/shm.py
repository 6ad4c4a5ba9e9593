"""Shared host memory for the ranks of one node: one segment per rank, mapped by every rank.
The file helpers at the end (`shared_folder`, `create_file`, `map_file`, `pin_host`) also make
the KV hand-off's arenas (workers/runner/kv_arena.py).

Segment of rank r: a header, then one ring of `num_slots` slots of `slot_bytes` for each
destination d (slot bytes r -> d live in r's segment). The header holds
  counters[d]              chunks rank r has published to d (grows forever; CPU protocol)
  counters[world_size + s] chunks rank r has consumed from s (grows forever; CPU protocol)
  flags[0, d, slot]        uint32: sequence number + 1 of the chunk r last put in slot for d
  flags[1, s, slot]        uint32: sequence number + 1 of the chunk r last took from s's slot
The flags are written and waited on by the GPUs themselves (GPU protocol, host_staged.py).
On CUDA every segment is page-locked with cudaHostRegister, so copies to and from it are DMA.
"""

import os
import shutil
import tempfile
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from rayinfer.comm.rendezvous import this_node_id

_PAGE_BYTES = 4096


class SharedSegments:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        slot_bytes: int,
        num_slots: int,
        pin: bool,
    ):
        self.rank, self.world_size = rank, world_size
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self._flags_at = 2 * world_size * 8
        flag_bytes = 2 * world_size * num_slots * 4
        self._header_bytes = -(-(self._flags_at + flag_bytes) // _PAGE_BYTES) * _PAGE_BYTES
        self.segment_bytes = self._header_bytes + world_size * num_slots * slot_bytes
        token = _agree_on_token(store, rank)
        _check_one_node(store, token, rank, world_size)
        folder = shared_folder(self.segment_bytes * world_size) if rank == 0 else None
        if rank == 0:
            store.set(f"shm-folder-{token}", folder)
        folder = store.get(f"shm-folder-{token}").decode()
        paths = [f"{folder}/rayinfer-{token}-{r}" for r in range(world_size)]
        os.close(create_file(paths[rank], self.segment_bytes))
        _wait_all(store, f"shm-created-{token}", world_size)
        self.segments = [map_file(p, self.segment_bytes) for p in paths]
        _wait_all(store, f"shm-mapped-{token}", world_size)
        os.unlink(paths[rank])  # the mappings stay valid; nothing is left behind
        self.headers = [_header(seg, world_size) for seg in self.segments]
        self._flags_base = [seg.data_ptr() + self._flags_at for seg in self.segments]
        self.is_pinned = pin and all(pin_host(seg) for seg in self.segments)

    def slot(self, src: int, dst: int, seq: int, num_bytes: int | None = None) -> torch.Tensor:
        """[slot_bytes] uint8 (or its first num_bytes): the ring slot that carries chunk `seq`
        from src to dst."""
        start = self._header_bytes + (dst * self.num_slots + seq % self.num_slots) * self.slot_bytes
        return self.segments[src][start : start + (num_bytes or self.slot_bytes)]

    def ring(self, src: int, dst: int) -> torch.Tensor:
        """[num_slots * slot_bytes] uint8: every slot of src -> dst, back to back."""
        start = self._header_bytes + dst * self.num_slots * self.slot_bytes
        return self.segments[src][start : start + self.num_slots * self.slot_bytes]

    def published(self, src: int, dst: int) -> int:
        return int(self.headers[src][dst])

    def consumed(self, dst: int, src: int) -> int:
        return int(self.headers[dst][self.world_size + src])

    def publish(self, dst: int, count: int) -> None:
        self.headers[self.rank][dst] = count

    def consume(self, src: int, count: int) -> None:
        self.headers[self.rank][self.world_size + src] = count

    def published_flag(self, src: int, dst: int, slot: int) -> int:
        """Host address of the flag src sets once chunk data src -> dst is in `slot`."""
        return self._flag_address(src, 0, dst, slot)

    def consumed_flag(self, src: int, dst: int, slot: int) -> int:
        """Host address of the flag dst sets once it has copied `slot` of src -> dst out."""
        return self._flag_address(dst, 1, src, slot)

    def _flag_address(self, owner: int, kind: int, peer: int, slot: int) -> int:
        index = (kind * self.world_size + peer) * self.num_slots + slot
        return self._flags_base[owner] + 4 * index

    def close(self) -> None:
        if self.is_pinned:
            for seg in self.segments:
                unpin_host(seg)
        self.segments, self.headers, self._flags_base = [], [], []


def _agree_on_token(store: dist.Store, rank: int) -> str:
    key = "shm-token"
    if rank == 0:
        store.set(key, uuid.uuid4().hex[:12])
    return store.get(key).decode()


def _check_one_node(store: dist.Store, token: str, rank: int, world_size: int) -> None:
    """Every rank raises, naming where each rank runs, unless all ranks share one node: another
    node's ranks would map files of their own and wait forever for chunks that never come."""
    store.set(f"shm-node-{token}-{rank}", this_node_id())
    nodes = [store.get(f"shm-node-{token}-{r}").decode() for r in range(world_size)]
    if len(set(nodes)) == 1:
        return
    ranks_of: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        ranks_of.setdefault(node, []).append(r)
    where = "; ".join(f"ranks {ranks} on node {node[:12]}" for node, ranks in ranks_of.items())
    raise RuntimeError(
        "the host-staged all-to-all exchanges through one node's shared memory, and this "
        f"group spans {len(ranks_of)} nodes ({where}); keep the group on one node (a "
        "rayinfer worker group is one STRICT_PACK placement group) or use "
        "all_to_all.transport=dist (NCCL, gloo on the CPU), which crosses nodes"
    )


def _wait_all(store: dist.Store, key: str, world_size: int) -> None:
    store.add(key, 1)
    while int(store.add(key, 0)) < world_size:
        time.sleep(0.001)


def create_file(path: str, num_bytes: int, reserve: bool = True) -> int:
    """Create `path` (which must not exist) of num_bytes; the open file descriptor (the caller
    closes it). With `reserve` its pages are allocated now, so that a full /dev/shm fails here
    (ENOSPC) and not with SIGBUS on first touch; without, the file is sparse and the caller
    reserves each range before writing it (`reserve_range`)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        if reserve:
            os.posix_fallocate(fd, 0, num_bytes)
        else:
            os.ftruncate(fd, num_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reserve_range(fd: int, offset: int, num_bytes: int) -> None:
    """Allocate the pages of [offset, offset + num_bytes) of a sparse file (OSError ENOSPC when
    the folder is full); a no-op for pages already allocated."""
    os.posix_fallocate(fd, offset, num_bytes)


def shared_folder(num_bytes: int) -> str:
    """/dev/shm when it has room (containers often cap it at 64 MB), else the temp folder."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * num_bytes:
        return "/dev/shm"
    return tempfile.gettempdir()


def map_file(path: str, num_bytes: int) -> torch.Tensor:
    """[num_bytes] uint8: the file's first num_bytes, mapped shared (writes reach every mapper)."""
    return torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)


def _header(segment: torch.Tensor, world_size: int) -> np.ndarray:
    return segment[: 2 * world_size * 8].view(torch.int64).numpy()


def pin_host(memory: torch.Tensor) -> bool:
    """Page-lock host memory (cudaHostRegister), so that copies to and from it are DMA."""
    err = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({err}); is /dev/shm large enough?")
    return True


def unpin_host(memory: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())
