"""A worker's shared-memory arena for the KV it exports: the same-node hand-off's memory.

The exporting worker copies a request's KV straight into its arena (device -> page-locked
shared host memory, one copy) and sends decode a header naming the span (`ArenaSpan`); an
importer on the same Ray node maps the arena (kv_arena_maps.py) and copies from the mapping
straight into its cache (one copy). Nothing passes through the object store.

The arena is one file, `rayinfer-kv-<pid>-<token>` in /dev/shm (or the temp folder when /dev/shm
is too small, as comm/shm.py chooses):
  [0, HEADER_BYTES)     int64 [MAX_SPANS, 2]: per slot, the generation of the span its owner
                        holds there (0: none), and the last generation an importer released
  [HEADER_BYTES, size)  the spans' bytes, each starting on a page
Each field has one writer (the owner the first, importers the second), so no lock is needed.

Lifetime of a span: the owner allocates it for one export, and takes it back when an importer
has released it (landed, or dropped the hand-off), or when it has been held past `lease_s`
and the space is needed. Taking a span back clears its generation first: an importer checks
the generation before and after its copy, so a span reused under it reads as lost, never as
another request's bytes.

Lifetime of the file: the owner holds an exclusive `flock` on it for its whole life and
unlinks it when it closes (at worker shutdown, or at exit). A shared `flock` taken without
waiting succeeds only once the owner is dead (the kernel drops a dead process's locks): then
importers read its KV as lost (decode recomputes, the KV-loss policy), and the first importer to
find it so, the next arena made on the node, or `unlink_dead_arenas` (a node's cleanup), unlinks
the file.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from rayinfer.comm.rendezvous import this_node_id
from rayinfer.comm.shm import (
    create_file,
    map_file,
    pin_host,
    reserve_range,
    shared_folder,
    unpin_host,
)

FILE_PREFIX = "rayinfer-kv-"
MAX_SPANS = 512  # exports one arena holds at once; the next one goes through the object store
HEADER_BYTES = MAX_SPANS * 2 * 8
PAGE_BYTES = 4096
# A file still under its temporary name this long after it was made belonged to a worker that
# died while creating it.
STALE_TEMP_S = 60.0


@dataclass(frozen=True)
class ArenaSpan:
    """Where one export's bytes lie: what the hand-off's header carries instead of the KV."""

    path: str  # the arena's file
    node_id: str  # the Ray node whose /dev/shm holds it
    slot: int  # the span's row in the arena's header
    generation: int  # the span's number in its arena: a reused span has another
    offset: int  # bytes from the file's start
    num_bytes: int
    owner: Any = None  # the exporting worker's actor handle: reads from another node go to it


@dataclass
class _Held:
    span: ArenaSpan
    since: float  # time.monotonic() at allocation


class KVArena:
    def __init__(self, num_bytes: int, lease_s: float, pin: bool, owner: Any = None):
        """num_bytes: the file's size, header included. pin: page-lock the whole arena for the
        GPU's copies (CUDA; then its pages are allocated now, else as spans use them)."""
        unlink_dead_arenas()
        self.num_bytes = num_bytes
        self.lease_s = lease_s
        self.owner = owner
        self.node_id = this_node_id()
        folder = shared_folder(num_bytes)
        self.path = f"{folder}/{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.held: dict[int, _Held] = {}  # slot -> the span held there
        self._next_generation = 1
        self.fd = _create_locked(self.path, num_bytes, reserve=pin)
        self.is_sparse = not pin
        self.is_pinned = False
        try:
            self.memory = map_file(f"/proc/self/fd/{self.fd}", num_bytes)  # [num_bytes] uint8
            self.table = self.memory[:HEADER_BYTES].view(torch.int64).view(MAX_SPANS, 2).numpy()
            self.is_pinned = pin and pin_host(self.memory)
        except BaseException:  # no arena: leave no file behind
            self.close()
            raise
        atexit.register(self.close)

    # --- spans -------------------------------------------------------------------------------
    def allocate(self, num_bytes: int) -> ArenaSpan | None:
        """A span of num_bytes for one export; None when the arena has no room for it (even
        after taking back the released spans and those held past their lease)."""
        self._take_back(expired=False)
        found = self._find_room(num_bytes)
        if found is None:
            self._take_back(expired=True)
            found = self._find_room(num_bytes)
        if found is None:
            return None
        slot, offset = found
        if self.is_sparse:
            try:
                reserve_range(self.fd, offset, num_bytes)
            except OSError:  # the folder is full: this export goes through the object store
                return None
        generation, self._next_generation = self._next_generation, self._next_generation + 1
        self.table[slot, 0] = generation
        span = ArenaSpan(self.path, self.node_id, slot, generation, offset, num_bytes, self.owner)
        self.held[slot] = _Held(span, time.monotonic())
        return span

    def view(self, span: ArenaSpan) -> torch.Tensor:
        """[span.num_bytes] uint8: the span's bytes in this process's mapping."""
        return self.memory[span.offset : span.offset + span.num_bytes]

    def holds(self, span: ArenaSpan) -> bool:
        """Whether the span is still the one allocated (not released and taken back)."""
        held = self.held.get(span.slot)
        return held is not None and held.span.generation == span.generation

    def free(self, span: ArenaSpan) -> None:
        """Take a span back now (its export failed, or its bytes left through the object store)."""
        if self.holds(span):
            self._forget(span.slot)

    @property
    def num_held(self) -> int:
        return len(self.held)

    def _take_back(self, expired: bool) -> None:
        """Forget the spans importers released; with `expired`, also those past their lease."""
        now = time.monotonic()
        for slot, held in list(self.held.items()):
            released = self.table[slot, 1] == held.span.generation
            if released or (expired and now - held.since > self.lease_s):
                self._forget(slot)

    def _forget(self, slot: int) -> None:
        self.table[slot, 0] = 0  # before the bytes can be reused: a reader's check fails
        del self.held[slot]

    def _find_room(self, num_bytes: int) -> tuple[int, int] | None:
        """(free slot, page-aligned offset of the first gap of num_bytes), or None."""
        if len(self.held) >= MAX_SPANS:
            return None
        slot = next(s for s in range(MAX_SPANS) if s not in self.held)
        start = HEADER_BYTES
        for span in sorted((h.span for h in self.held.values()), key=lambda s: s.offset):
            if span.offset - start >= num_bytes:
                return slot, start
            start = _page_up(span.offset + span.num_bytes)
        if self.num_bytes - start >= num_bytes:
            return slot, start
        return None

    # --- the file ----------------------------------------------------------------------------
    def close(self) -> None:
        """Unlink the file and drop this process's mapping (importers' mappings stay valid
        until they drop theirs). Idempotent."""
        if self.fd < 0:
            return
        if self.is_pinned:
            unpin_host(self.memory)
            self.is_pinned = False
        self.table = None
        self.memory = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)  # releases the lock: importers read this arena's spans as lost
        self.fd = -1
        self.held.clear()
        atexit.unregister(self.close)


def _create_locked(path: str, num_bytes: int, reserve: bool) -> int:
    """The open, exclusively locked file at `path`. It is made under a hidden name and locked
    before it is renamed, so that no cleaner sees it unlocked and takes it for a dead one's."""
    folder, name = os.path.split(path)
    temp = os.path.join(folder, f".{name}")
    fd = create_file(temp, num_bytes, reserve=reserve)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(temp, path)
    except BaseException:
        os.close(fd)
        unlink_quietly(temp)
        raise
    return fd


def owner_is_alive(fd: int) -> bool:
    """Whether the arena open at `fd` still has its owner: a shared lock taken without waiting
    succeeds only when no process holds the owner's exclusive one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def unlink_dead_arenas(folders: tuple[str, ...] | None = None) -> list[str]:
    """Unlink the arena files of this node whose owner died without closing them (killed);
    the paths unlinked. The next arena made on the node calls this; so may a node's cleanup."""
    import tempfile

    folders = folders or tuple(dict.fromkeys(("/dev/shm", tempfile.gettempdir())))
    unlinked = []
    for folder in folders:
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if name.startswith(FILE_PREFIX) and _is_dead(path):
                unlinked += [path] if unlink_quietly(path) else []
            elif name.startswith(f".{FILE_PREFIX}") and _is_stale_temp(path):
                unlinked += [path] if unlink_quietly(path) else []
    return unlinked


def _is_dead(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, PermissionError):
        return False
    try:
        return not owner_is_alive(fd)
    finally:
        os.close(fd)


def _is_stale_temp(path: str) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > STALE_TEMP_S and _is_dead(path)
    except FileNotFoundError:
        return False


def unlink_quietly(path: str) -> bool:
    """Unlink `path` unless it is gone already (or not ours); whether this call unlinked it."""
    try:
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        return False
    return True


def _page_up(offset: int) -> int:
    return -(-offset // PAGE_BYTES) * PAGE_BYTES
