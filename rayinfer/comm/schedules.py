"""All-to-all schedules: which blocks travel together, round by round. Picked by name.

out, inp: [rows, row_bytes] uint8; out_splits[s] rows arrive from rank s, in_splits[d] rows
leave for rank d, blocks ordered by rank in both tensors.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from rayinfer.comm.layout import offsets
from rayinfer.comm.transport import Transfer, Transport


@dataclass(frozen=True)
class ScheduleContext:
    """What a schedule may use. islands: ranks grouped by fast links (each island sorted).
    split_matrix: [world, world] rows sent i -> j, only where the schedule needs it."""

    rank: int
    world_size: int
    transport: Transport
    islands: tuple[tuple[int, ...], ...]
    split_matrix: list[list[int]] | None = None


class Schedule(ABC):
    name: str
    needs_split_matrix: bool = False

    @abstractmethod
    def run(self, ctx: ScheduleContext, out, inp, out_splits: list[int], in_splits: list[int]):
        """Fill `out` from every rank's `inp`."""


SCHEDULES: dict[str, Schedule] = {}


def register_schedule(schedule: Schedule) -> Schedule:
    SCHEDULES[schedule.name] = schedule
    return schedule


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown all-to-all schedule {name!r}; use one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]


class OneShot(Schedule):
    """Every pair at once (NCCL's all_to_all_single on the torch.distributed transport)."""

    name = "nccl"

    def run(self, ctx, out, inp, out_splits, in_splits):
        ctx.transport.all_to_all(out, inp, out_splits, in_splits)


class Pairwise(Schedule):
    """world_size - 1 shifted rounds: in round k rank r sends to r + k and receives from r - k,
    so each rank drives one outbound and one inbound stream at a time."""

    name = "pairwise"

    def run(self, ctx, out, inp, out_splits, in_splits):
        out_at, in_at = offsets(out_splits), offsets(in_splits)
        me, n = ctx.rank, ctx.world_size
        out_flat, in_flat = out.view(-1), inp.view(-1)  # one view each; a byte slice per block
        out_row, in_row = out.shape[1], inp.shape[1]
        if out_splits[me]:
            out_flat[out_at[me] * out_row : out_at[me + 1] * out_row].copy_(
                in_flat[in_at[me] * in_row : in_at[me + 1] * in_row]
            )
        for k in range(1, n):
            dst, src = (me + k) % n, (me - k) % n
            send = Transfer(dst, in_flat[in_at[dst] * in_row : in_at[dst + 1] * in_row])
            recv = Transfer(src, out_flat[out_at[src] * out_row : out_at[src + 1] * out_row])
            ctx.transport.exchange([send], [recv])


class Hierarchical(Schedule):
    """Two phases over equal-size islands. Rank (I, i) first hands island-mate (I, j) every block
    bound for local index j of any island; then (I, j) sends (J, j) one aggregated message with
    the blocks of all of island I, so each slow cross-island pair carries one message."""

    name = "hierarchical"
    needs_split_matrix = True

    def run(self, ctx, out, inp, out_splits, in_splits):
        size = len(ctx.islands[0])
        if any(len(isl) != size for isl in ctx.islands):
            raise ValueError(f"hierarchical needs islands of equal size, got {ctx.islands}")
        out_at = offsets(out_splits)
        blocks = self._gather_in_island(ctx, inp, in_splits)
        island = next(i for i, isl in enumerate(ctx.islands) if ctx.rank in isl)
        for mate in ctx.islands[island]:
            out[out_at[mate] : out_at[mate + 1]].copy_(blocks[(mate, island)])
        for src, part in self._cross_islands(ctx, blocks, island, inp):
            out[out_at[src] : out_at[src + 1]].copy_(part)

    @staticmethod
    def _gather_in_island(ctx, inp, in_splits) -> dict[tuple[int, int], torch.Tensor]:
        """Phase 1. Returns {(mate, J): rows from mate bound for (J, my index)}."""
        islands, S, me = ctx.islands, ctx.split_matrix, ctx.rank
        island = next(isl for isl in islands if me in isl)
        my_index, in_at = island.index(me), offsets(in_splits)
        sends, recvs, staged = [], [], {}
        for j, mate in enumerate(island):
            parts = torch.cat([inp[in_at[isl[j]] : in_at[isl[j] + 1]] for isl in islands])
            sizes = [S[mate][isl[my_index]] for isl in islands]
            staged[mate] = (
                parts if mate == me else inp.new_empty((sum(sizes), inp.shape[1])),
                sizes,
            )
            if mate != me:
                sends.append(Transfer(mate, parts.reshape(-1)))
                recvs.append(Transfer(mate, staged[mate][0].reshape(-1)))
        ctx.transport.exchange(sends, recvs)
        return {
            (mate, J): part
            for mate, (buf, sizes) in staged.items()
            for J, part in enumerate(_split_rows(buf, sizes))
        }

    @staticmethod
    def _cross_islands(ctx, blocks, island: int, inp):
        """Phase 2. Yields (source rank, its rows for me) for every rank of other islands."""
        islands, S, me = ctx.islands, ctx.split_matrix, ctx.rank
        mates, my_index = islands[island], islands[island].index(me)
        sends, recvs, arriving = [], [], {}
        for J, isl in enumerate(islands):
            if J == island:
                continue
            peer = isl[my_index]
            sends.append(Transfer(peer, torch.cat([blocks[(m, J)] for m in mates]).reshape(-1)))
            sizes = [S[src][me] for src in isl]
            arriving[J] = (inp.new_empty((sum(sizes), inp.shape[1])), sizes)
            recvs.append(Transfer(peer, arriving[J][0].reshape(-1)))
        ctx.transport.exchange(sends, recvs)
        for J, (buf, sizes) in arriving.items():
            yield from zip(islands[J], _split_rows(buf, sizes), strict=True)


def _split_rows(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    at = offsets(sizes)
    return [buf[at[i] : at[i + 1]] for i in range(len(sizes))]


for _schedule in (OneShot(), Pairwise(), Hierarchical()):
    register_schedule(_schedule)
