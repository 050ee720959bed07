"""The copy engine's MoE path as data: the operations of one expert-parallel call on one rank.

Buffers, in rows of bytes (the executor knows each buffer's row width):

    send    mine: the sorted outgoing rows (``Stage.outgoing``); rank d's block at send_off[d]
    back    mine: phase 2's rows of every piece, in the received order
    ret     mine: the rows sent back to me, sorted as ``send``: what ``Stage.finish`` reads
    inbox   symmetric: slot s, rows [s x S, (s + 1) x S), holds what rank s pushed me
    outbox  symmetric: slot d holds what rank d computed for me and pushed back
    S       the rows a slot holds: the slots' size as made (at least the token bound x k,
            ``MoeSchedule.problem.tokens_max``; a source never sends one rank more rows than its
            tokens x k), the same for every call until the slots grow, and each slot at the same
            bytes whatever a call's row width (``slot_span``): a guard frees one source's slot
            only, so a slot that moved between calls could take a push while the peer still reads
            another source's rows of the previous call there

Flags (``Cell(owner, name, index)``), 0 or 1, set by one rank and reset by the stream that
waited for it; the ``free_*`` cells start at 1 (buffer-reuse guards, as the dense protocol's):

    landed(s, c)     rank s's piece c for me is in my inbox slot s
    returned(d, c)   rank d's rows back of piece c are in my outbox slot d
    free_in(d)       rank d's inbox slot for me is free: d ran phase 1 on my previous push
    free_out(s)      rank s's outbox slot for me is free: s copied out my previous push

Rank r of w; pieces c = 0 .. C-1 are ranges of local experts (``expert_ranges``, the same on
every rank); peers in ring order, j = 1 .. w-1 (push to r + j, consume from r - j); a piece
without rows moves nothing and sets no flag (both ends know its size from the counts)::

    main   record(sent)                                      (the host wrote ``send``)
    local  wait_event(sent)
    side   wait_event(sent); for j: d = r+j: take free_in(d)
               for c: copy send[d, c] -> d.inbox[slot r, c]; signal d.landed(r, c)
    main   for c: phase1(mine, c) from send                  (my own rows never leave)
           for j: s = r-j: for c: take landed(s, c); phase1(s, c) from inbox[slot s, c]
                  signal s.free_in(r)                        (the AllGather + GEMM pattern)
           for j: s = r-j: for c: phase2(s, c) -> back; record(done)
    side       [first piece of s: take free_out(s)]; wait_event(done)
               copy back[s, c] -> s.outbox[slot r, c]; signal s.returned(r, c)
                                                             (the GEMM + ReduceScatter pattern)
    main   for c: phase2(mine, c) -> ret                     (mine last: it sends nothing)
    local  for j: d = r+j: for c: take returned(d, c); copy outbox[slot d, c] -> ret[d, c]
               signal d.free_out(r)
    main   join side; join local                             (then the weighted sum, ``finish``)

Every rank queues the pushes a peer waits for before its own waits on that peer, so the list
completes with all of a rank's streams on one FIFO (the dense protocol's rule,
``fo_kernels.engines.copy_engine.modes``). Every flag returns to its starting value, so calls
follow each other without a barrier.
"""

from __future__ import annotations

from dataclasses import dataclass

from fo_kernels.engines.copy_engine.layout import Cell, Rows
from fo_kernels.engines.copy_engine.ops import (
    LOCAL,
    MAIN,
    SIDE,
    Copy,
    Join,
    Op,
    Record,
    Reset,
    Signal,
    Wait,
    WaitEvent,
)
from fo_kernels.moe.schedule import MAX_CHUNKS as MAX_PIECES

CALLER = ("send", "back", "ret")  # this rank's own tensors of the call
SYMMETRIC = ("inbox", "outbox")  # the symmetric regions, one slot per peer
OUTGOING = frozenset(("send", "inbox"))  # buffers of outgoing rows; the rest hold rows sent back
GUARDS = ("free_in", "free_out")  # the cells that start at 1


@dataclass(frozen=True, slots=True)
class Phase:
    """Phase 1 (read ``rows``) or 2 (write ``rows``) of piece (slot, experts [e0, e1))."""

    stream: str
    phase: int
    slot: int
    experts: tuple[int, int]
    rows: Rows


MoeOp = Op | Phase


@dataclass(frozen=True)
class MoeCall:
    """One call as the protocol sees it on rank ``rank``: ``send[d][e]`` rows to rank d for its
    local expert e, ``recv[s][e]`` rows from rank s for my local expert e, ``slot_rows`` S."""

    rank: int
    send: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[int, ...], ...]
    chunks: int
    slot_rows: int

    @property
    def world(self) -> int:
        return len(self.send)

    @property
    def experts(self) -> int:
        return len(self.send[0])


@dataclass(frozen=True)
class MoePlan:
    """The operations of one call on one rank."""

    call: MoeCall
    ops: tuple[MoeOp, ...]


@dataclass(frozen=True)
class MoeFlags:
    """Slots of the flag cells of a ``world``-rank group in each rank's int32 array."""

    world: int

    @property
    def slots(self) -> int:
        return 2 * self.world * MAX_PIECES + 2 * self.world

    def slot(self, cell: Cell) -> int:
        """The index of ``cell`` in its owner's flag array."""
        w = self.world
        if cell.name in ("landed", "returned"):
            q, c = cell.index
            if not (0 <= q < w and 0 <= c < MAX_PIECES):
                raise IndexError(f"{cell}: outside the flags of {w} ranks")
            return (0 if cell.name == "landed" else w * MAX_PIECES) + q * MAX_PIECES + c
        (q,) = cell.index
        if not 0 <= q < w:
            raise IndexError(f"{cell}: outside the flags of {w} ranks")
        return 2 * w * MAX_PIECES + (0 if cell.name == "free_in" else w) + q


def expert_ranges(experts: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` ranges of local experts, as equal as can be (fewer when there are fewer experts)."""
    n = min(chunks, experts)
    bounds = [e * experts // n for e in range(n + 1)]
    return [(bounds[c], bounds[c + 1]) for c in range(n)]


def slot_span(rows: Rows, slot_rows: int, slot_width: int, width: int) -> tuple[int, int]:
    """The bytes [b0, b1) of ``rows`` of a symmetric buffer (numbered as ``build`` numbers them,
    slot s from row s x ``slot_rows``) in a region of slots of ``slot_rows`` rows of
    ``slot_width`` bytes: slot s starts at byte s x slot_rows x slot_width, and the call's rows of
    ``width`` bytes are packed from there."""
    slot, first = divmod(rows.r0, slot_rows)
    if rows.count < 0 or first + rows.count > slot_rows or width > slot_width:
        raise IndexError(f"{rows} of {width} bytes do not fit one slot of {slot_rows} x {slot_width} bytes")
    start = slot * slot_rows * slot_width + first * width
    return start, start + rows.count * width


def guard_cells(rank: int, world: int) -> list[Cell]:
    """``rank``'s guard cells (1 while the guarded slot is free)."""
    return [Cell(rank, name, (q,)) for name in GUARDS for q in range(world) if q != rank]


def _offsets(counts: tuple[int, ...]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def build(call: MoeCall) -> MoePlan:
    """The operation list of ``call`` (see the module docstring)."""
    r, w, big = call.rank, call.world, call.slot_rows
    ranges = expert_ranges(call.experts, call.chunks)
    send_off = _offsets(tuple(sum(row) for row in call.send))
    recv_off = _offsets(tuple(sum(row) for row in call.recv))

    def piece(counts: tuple[int, ...], e0: int, e1: int) -> tuple[int, int]:
        """Rows [p0, p1) of experts [e0, e1) within one block."""
        p0 = sum(counts[:e0])
        return p0, p0 + sum(counts[e0:e1])

    # the side streams start after everything the caller's stream did before the call (``send``,
    # and the memory of ``ret``, which the local stream writes)
    ops: list[MoeOp] = [Record(MAIN, 0), WaitEvent(SIDE, 0), WaitEvent(LOCAL, 0)]
    events = 1
    for j in range(1, w):  # dispatch pushes
        d = (r + j) % w
        if not sum(call.send[d]):
            continue
        ops += [Wait(SIDE, Cell(r, "free_in", (d,))), Reset(SIDE, Cell(r, "free_in", (d,)))]
        for c, (e0, e1) in enumerate(ranges):
            p0, p1 = piece(call.send[d], e0, e1)
            if p1 > p0:
                src = Rows("send", r, send_off[d] + p0, send_off[d] + p1)
                ops += [Copy(SIDE, Rows("inbox", d, r * big + p0, r * big + p1), src)]
                ops += [Signal(SIDE, Cell(d, "landed", (r, c)))]
    for e0, e1 in ranges:  # phase 1 of my own rows
        p0, p1 = piece(call.send[r], e0, e1)
        if p1 > p0:
            ops.append(Phase(MAIN, 1, r, (e0, e1), Rows("send", r, send_off[r] + p0, send_off[r] + p1)))
    for j in range(1, w):  # phase 1 of each source's rows as they land
        s = (r - j) % w
        if not sum(call.recv[s]):
            continue
        for c, (e0, e1) in enumerate(ranges):
            p0, p1 = piece(call.recv[s], e0, e1)
            if p1 > p0:
                cell = Cell(r, "landed", (s, c))
                ops += [Wait(MAIN, cell), Reset(MAIN, cell)]
                ops.append(Phase(MAIN, 1, s, (e0, e1), Rows("inbox", r, s * big + p0, s * big + p1)))
        ops.append(Signal(MAIN, Cell(s, "free_in", (r,))))
    for j in range(1, w):  # phase 2 of each source's rows, each piece pushed back as it ends
        s = (r - j) % w
        if not sum(call.recv[s]):
            continue
        ops += [Wait(SIDE, Cell(r, "free_out", (s,))), Reset(SIDE, Cell(r, "free_out", (s,)))]
        for c, (e0, e1) in enumerate(ranges):
            p0, p1 = piece(call.recv[s], e0, e1)
            if p1 > p0:
                rows = Rows("back", r, recv_off[s] + p0, recv_off[s] + p1)
                ops += [Phase(MAIN, 2, s, (e0, e1), rows), Record(MAIN, events), WaitEvent(SIDE, events)]
                ops += [Copy(SIDE, Rows("outbox", s, r * big + p0, r * big + p1), rows)]
                ops += [Signal(SIDE, Cell(s, "returned", (r, c)))]
                events += 1
    for e0, e1 in ranges:  # phase 2 of my own rows, straight into ret
        p0, p1 = piece(call.send[r], e0, e1)
        if p1 > p0:
            ops.append(Phase(MAIN, 2, r, (e0, e1), Rows("ret", r, send_off[r] + p0, send_off[r] + p1)))
    for j in range(1, w):  # my rows back from each destination
        d = (r + j) % w
        if not sum(call.send[d]):
            continue
        for c, (e0, e1) in enumerate(ranges):
            p0, p1 = piece(call.send[d], e0, e1)
            if p1 > p0:
                cell = Cell(r, "returned", (d, c))
                ops += [Wait(LOCAL, cell), Reset(LOCAL, cell)]
                src = Rows("outbox", r, d * big + p0, d * big + p1)
                ops.append(Copy(LOCAL, Rows("ret", r, send_off[d] + p0, send_off[d] + p1), src))
        ops.append(Signal(LOCAL, Cell(d, "free_out", (r,))))
    ops += [Join(MAIN, SIDE), Join(MAIN, LOCAL)]
    return MoePlan(call, tuple(ops))
