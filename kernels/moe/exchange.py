"""Moving rows between the ranks: the counts exchange that opens every call, byte rows, and the
All-to-All of the rows (one collective, or one ring step at a time).

The counts exchange opens every call: two All-to-Alls of int64 rows. The first sends every peer
a row of fixed width: the call signature (``SIGNATURE``: H, I, E_local, k, the dtype, the
direction, the schedule's checksum) and its tokens (T, which may differ between ranks:
``Layout.tokens``, what the table lookup and the schedule's token bound read). Every rank
compares the signatures it received with its own and refuses a disagreement (``ShapeError``;
``ScheduleError`` where only the schedules differ) before any row moves; a mismatch is seen by
every rank, so all of them raise instead of some waiting on a collective that never comes. Only
then does the second send every peer how many rows it sends for each of the peer's local experts:
that row is E_local wide, so it waits until every rank is known to have the same E_local (rows
of different widths in one All-to-All abort gloo ranks and are undefined under NCCL).

Rows travel as bytes (``pack`` / ``unpack``): a row may carry parts of several dtypes (the
backward sends x, dy and a float32 weight in one row), and one exchange moves them all.

    Layout.send[d][e]   rows this rank sends rank d for d's local expert e
    Layout.recv[s][e]   rows rank s sends this rank for this rank's local expert e
    Layout.tokens[s]    rank s's tokens this call
    slot s              the recv rows from rank s: [recv_offsets[s], recv_offsets[s + 1])
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fo_kernels.errors import ScheduleError, ShapeError
from fo_kernels.moe.routing import FfnShape, Routing
from fo_kernels.moe.schedule import MoeSchedule

# The signature fields, in the order every counts row starts with.
# k is among them: ranks with different k would look the MoE table up under different keys (and
# could take different engines), or check a schedule's k apart (one raising, the others waiting).
# The schedule is too (``schedule_code``): ranks given different schedules would run different
# paths, or one engine's slots numbered apart, and wait on each other's collectives for ever.
SIGNATURE = ("hidden", "intermediate", "experts", "top_k", "dtype", "direction", "schedule")
# The dtype field's codes (a stable number per supported dtype).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True, slots=True)
class Layout:
    """Who sends whom how many rows, per local expert (see the module docstring)."""

    rank: int
    send: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...] = ()  # every rank's tokens (empty where the layout was built by hand)
    choices: tuple[int, ...] = ()  # every rank's ``choose`` answer (empty without one)

    @property
    def world(self) -> int:
        return len(self.send)

    @property
    def send_splits(self) -> list[int]:
        return [sum(row) for row in self.send]

    @property
    def recv_splits(self) -> list[int]:
        return [sum(row) for row in self.recv]

    @property
    def send_offsets(self) -> list[int]:
        return [0, *itertools.accumulate(self.send_splits)]

    @property
    def recv_offsets(self) -> list[int]:
        return [0, *itertools.accumulate(self.recv_splits)]


def schedule_code(schedule: MoeSchedule | None) -> int:
    """The signature's schedule field: 0 for none (the table's row, the same on every rank), else
    a checksum of the schedule's text (1 + CRC-32, never 0)."""
    return 0 if schedule is None else 1 + zlib.crc32(schedule.op_text.encode())


def exchange_counts(
    routing: Routing,
    shape: FfnShape,
    dtype: torch.dtype,
    direction: str,
    group: dist.ProcessGroup | None,
    schedule: MoeSchedule | None = None,
    choose: Callable[[tuple[int, ...]], int] | None = None,
) -> Layout:
    """The counts exchange (see the module docstring): this call's ``Layout``; every rank raises
    ``ShapeError`` alike when the ranks' signatures disagree (``ScheduleError`` when only their
    schedules do). ``choose(tokens)`` (every rank's tokens, from the first exchange) gives a number
    the second carries beside the counts (``Layout.choices``: every rank's), so that the ranks
    can check they chose alike (the table's row)."""
    world, rank = shape.world, dist.get_rank(group)
    mine = (
        shape.hidden,
        shape.intermediate,
        shape.experts,
        shape.top_k,
        DTYPE_CODES[dtype],
        DIRECTIONS.index(direction),
        schedule_code(schedule),
    )
    if world == 1:
        chosen = () if choose is None else (choose((shape.tokens,)),)
        return Layout(rank, routing.host_counts, routing.host_counts, (shape.tokens,), chosen)
    head = torch.tensor((*mine, shape.tokens), dtype=torch.int64, device=routing.counts.device)
    rows = _all_to_all_int(head.expand(world, -1), group).tolist()
    bad = [s for s, row in enumerate(rows) if tuple(row[: len(SIGNATURE)]) != mine]
    if bad:
        call = len(SIGNATURE) - 1  # the fields before the schedule's
        if all(tuple(rows[s][:call]) == mine[:call] for s in bad):
            raise ScheduleError(
                f"the ranks' schedules differ (rank {rank} of {world}; ranks {bad} were given another "
                "schedule): every rank of the group must pass the same MoeSchedule, or schedule=None"
            )
        said = {s: dict(zip(SIGNATURE, rows[s][: len(SIGNATURE)], strict=True)) for s in (*bad, rank)}
        raise ShapeError(
            f"the ranks' calls disagree (rank {rank} of {world}): every rank of the group must call with "
            f"the same H, I, E_local, k, dtype, direction and schedule; got {said}"
        )
    tokens = tuple(row[len(SIGNATURE)] for row in rows)
    if choose is None:
        counts = _all_to_all_int(routing.counts, group).tolist()
        return Layout(rank, routing.host_counts, tuple(tuple(row) for row in counts), tokens)
    mine_choice = routing.counts.new_full((world, 1), choose(tokens))
    got = _all_to_all_int(torch.cat((routing.counts, mine_choice), dim=1), group).tolist()
    recv = tuple(tuple(row[:-1]) for row in got)
    return Layout(rank, routing.host_counts, recv, tokens, tuple(row[-1] for row in got))


def _all_to_all_int(send: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Row d of ``send`` (world, width) to rank d; row s of the result from rank s."""
    send = send.contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=group)
    return got


# ----------------------------------------------------------------------------- byte rows
def pack(*parts: torch.Tensor) -> torch.Tensor:
    """``parts`` (each (R, ...), any dtype) side by side as (R, bytes) uint8 rows."""
    rows = parts[0].shape[0]
    flat = [p.reshape(rows, _width(p)) for p in parts]
    return torch.cat([p.contiguous().view(torch.uint8) for p in flat], dim=1)


def _width(t: torch.Tensor) -> int:
    width = 1
    for size in t.shape[1:]:
        width *= size
    return width


def unpack(rows: torch.Tensor, parts: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """The (R, width) tensors of ``parts`` (dtype, width) from (R, bytes) uint8 rows."""
    out, at = [], 0
    for dtype, width in parts:
        nbytes = width * dtype.itemsize
        part = rows[:, at : at + nbytes]
        if not part.is_contiguous() or part.storage_offset() % dtype.itemsize:
            # a copy starts at byte 0; a slice of 0 or 1 rows counts as contiguous and keeps its
            # offset, which a part after an odd number of 2-byte columns leaves misaligned
            part = part.clone(memory_format=torch.contiguous_format)
        out.append(part.view(dtype))
        at += nbytes
    if at != rows.shape[1]:
        raise ShapeError(f"rows of {rows.shape[1]} bytes do not hold parts of {at} bytes")
    return out


def row_bytes(parts: Sequence[tuple[torch.dtype, int]]) -> int:
    """Bytes of one row of ``parts`` (dtype, width) side by side, as ``pack`` lays them out."""
    return sum(width * dtype.itemsize for dtype, width in parts)


# ----------------------------------------------------------------------------- rows
def all_to_all_rows(
    rows: torch.Tensor, send: Sequence[int], recv: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """One All-to-All of byte rows: ``send[d]`` rows to rank d (in rank order), ``recv[s]`` from s."""
    out = rows.new_empty((sum(recv), rows.shape[1]))
    if len(send) == 1:
        out.copy_(rows)
        return out
    dist.all_to_all_single(out, rows, list(recv), list(send), group=group)
    return out


def ring_step(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup | None,
) -> None:
    """One step's point-to-point transfers (``(peer group rank, rows)``), posted together and
    waited for; empty tensors are skipped (both ends know the sizes from the counts exchange)."""
    ops = [
        dist.P2POp(fn, t, dist.get_global_rank(group, peer) if group is not None else peer, group)
        for fn, pairs in ((dist.isend, sends), (dist.irecv, recvs))
        for peer, t in pairs
        if t.numel()
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
