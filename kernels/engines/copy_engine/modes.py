"""The copy engine's modes, registered by exact name: each builds the operation list of a call.

``ring`` (cuBLAS GEMMs per row chunk, any world size w >= 2):

- reduce_scatter. At step s = 0 .. w-1 rank r computes, chunk by chunk, its partial of shard
  d = (r - s - 1) mod w. At s = 0 into ``part0`` (beta = 0); at s >= 1 it first pulls its left
  neighbour's accumulator of that chunk (from ``part<s-1>``, copy engine) into its own
  destination and adds its partial in the GEMM's epilogue (beta = 1). The destination is
  ``part<s>``, which the right neighbour pulls at step s + 1, until s = w - 1, where the shard is
  r's own and the sum final (into ``out``). w - 1 hops of M/w rows per rank: the bandwidth optimum
  of a ring; with several chunks a hop runs beside the GEMMs of the chunks after it::

      main/alt  [wait pulled(0)] step 0: for c: part0[c] = A[d0, c] @ B; right.partial(0, c) = 1
      side      for s = 1 .. w-1: [wait pulled(s) | all_reduce, last step: wait every gathered(q)]
                    for c: wait partial(s-1, c); dst_s[c] = left.part<s-1>[c]; record pulled(s, c)
                    left.pulled(s-1) = 1
      main/alt      for c: wait pulled(s, c); dst_s[c] += A[d_s, c] @ B;
                        s < w-1: right.partial(s, c) = 1   |  last, all_reduce: q.summed(r, c) = 1

- all_reduce: the same into my symmetric ``final``, then every rank pulls each peer's final
  chunks as they are summed (``summed``, one hop on NVSwitch, beside the remaining GEMMs), my own
  on the local stream, and tells the owner (``gathered``) once it has all of them.
- all_gather: my shard of A goes into my symmetric ``shard`` (local stream, after every peer
  took the previous call's: ``taken``), each peer is told (``shard``); my own rows' GEMM runs at
  once from ``a``; the side stream pulls each peer's shard chunk by chunk (peers in ring order
  r+1, r+2, ..., so each owner serves one reader at a time) into the gathered A, and the GEMM of
  each chunk waits only for its pull. With rowwise fp8 scales (``row_scales``) my shard's scale
  rows go into my symmetric ``scales`` beside it, and the side stream pulls a peer's scale rows
  before its first chunk (4 bytes a row against the chunks' K), so each chunk's pull event also
  covers its rows' scales.

GEMMs alternate between the caller's stream and ``alt``, each chunk's flag written after its
GEMM on its own stream: the next chunk's tiles then fill the SMs a GEMM's last wave leaves
(docs/design.md#copy-engine).

``tiled`` (world size 2, reduce_scatter and all_reduce): each phase is one persistent Triton GEMM
on all SMs (``rows_gemm``) instead of a cuBLAS GEMM per chunk, so no chunk pays a small GEMM's
wave quantization. Phase 1's tiles count per chunk; the notify stream forwards each finished
chunk to the peer; my side stream pulls the peer's partial of my chunk c into my shard of the
output and sets ready(c); each chunk of phase 2 waits in the kernel for its ready(c) and adds the
pulled rows in float32. Its AllReduce also stores each sum into the peer's ``final`` (NVLink
stores from the kernel) and counts it in the peer's summed cells, so no pull of the sums waits
for the GEMM's end. It stays at two ranks: at w > 2 each ring step would be a kernel whose tiles
wait on the previous hop, w - 1 kernels a call instead of two.

Every mode queues the work a peer waits for before the waits on that peer's data: two streams
can share one of the GPU's hardware queues, and a wait queued first would block the work behind
it (docs/design.md#copy-engine). Run by the CPU executor with all of a rank's streams on one FIFO
(``CpuOptions(fifos=...)``) the lists complete, which is that rule. A rank rewrites a symmetric
buffer only after its readers said they finished the previous call's data (``pulled``,
``gathered``, ``taken``), so calls follow each other without a barrier.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping

from fo_kernels.engines.copy_engine.layout import (
    SCALE_REGION,
    Cell,
    Rows,
    chunks_of,
    shard_rows,
    tile_row_bounds,
)
from fo_kernels.engines.copy_engine.ops import (
    ALT,
    LOCAL,
    MAIN,
    NOTIFY,
    SIDE,
    CallPlan,
    CallSpec,
    Clear,
    Copy,
    Gemm,
    Join,
    Op,
    Record,
    Reset,
    Signal,
    TiledGemm,
    Wait,
    WaitEvent,
)
from fo_kernels.engines.copy_engine.settings import MAX_CHUNKS
from fo_kernels.errors import ScheduleError, ShapeError
from fo_kernels.tile import Tile

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


class _Builder:
    """Accumulates a call's operations; hands out events and the chunk GEMMs' streams."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._events = 0
        self._gemms = 0

    def add(self, *ops: Op) -> None:
        self.ops.extend(ops)

    def take(self, stream: str, cell: Cell, target: int = 1) -> None:
        """Wait for my ``cell`` on ``stream``, then reset it for the next call."""
        self.add(Wait(stream, cell, target), Reset(stream, cell))

    def event(self) -> int:
        self._events += 1
        return self._events - 1

    def gemm_stream(self) -> str:
        """Chunk GEMM g of a call runs on the caller's stream (g even) or ``alt`` (g odd)."""
        self._gemms += 1
        return (MAIN, ALT)[(self._gemms - 1) % 2]


class Mode(ABC):
    """A way to run a call; ``build`` must give every rank's list for the same spec fields."""

    name: str

    @abstractmethod
    def blocker(self, collective: str, world: int, tile: Tile | None) -> str:
        """Why this mode cannot run the call ("" if it can)."""

    @abstractmethod
    def build(self, spec: CallSpec) -> CallPlan:
        """The operations of ``spec``'s call on rank ``spec.rank``."""


class RingMode(Mode):
    name = "ring"

    def blocker(self, collective: str, world: int, tile: Tile | None) -> str:
        if collective not in COLLECTIVES:
            return f"runs {', '.join(COLLECTIVES)}, not {collective!r}"
        if world < 2:
            return f"needs at least 2 ranks, got {world}"
        if tile is not None:
            return "uses cuBLAS chunk GEMMs and takes no tile (the tiled mode does)"
        return ""

    def build(self, spec: CallSpec) -> CallPlan:
        if spec.collective == "all_gather":
            return _ring_all_gather(spec)
        return _ring_reduce(spec)


class TiledMode(Mode):
    name = "tiled"

    def blocker(self, collective: str, world: int, tile: Tile | None) -> str:
        if collective not in ("all_reduce", "reduce_scatter"):
            return f"runs all_reduce and reduce_scatter, not {collective!r}"
        if world != 2:
            return f"runs between exactly 2 ranks, this group has {world}"
        if not isinstance(tile, Tile):
            return "needs the persistent GEMM's tile"
        return ""

    def build(self, spec: CallSpec) -> CallPlan:
        return _tiled(spec)


MODES: Mapping[str, Mode] = {mode.name: mode for mode in (RingMode(), TiledMode())}
MODE_NAMES = tuple(MODES)


def mode_named(name: str) -> Mode:
    """The mode registered as ``name``; an unknown name raises ``ScheduleError`` listing them."""
    mode = MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise ScheduleError(f"mode: {name!r} is not a copy-engine mode; valid: {', '.join(MODE_NAMES)}")
    return mode


def mode_blocker(name: str, collective: str, world: int, tile: Tile | None = None) -> str:
    """Why mode ``name`` cannot run ``collective`` on ``world`` ranks ("" if it can)."""
    return mode_named(name).blocker(collective, world, tile)


def check_weights(weights: object) -> tuple[int, ...]:
    """``weights`` as a tuple of 1 to ``MAX_CHUNKS`` positive integers, else ``ScheduleError``."""
    got = tuple(weights) if isinstance(weights, (tuple, list)) else ()
    if not 1 <= len(got) <= MAX_CHUNKS or any(
        isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in got
    ):
        raise ScheduleError(
            f"weights: expected 1 to {MAX_CHUNKS} positive integers (the chunks' relative rows), "
            f"got {weights!r}"
        )
    return got


def plan_call(
    mode: str,
    collective: str,
    world: int,
    rank: int,
    m: int,
    n: int,
    k: int,
    weights: tuple[int, ...],
    tile: Tile | None = None,
    row_scales: bool = False,
) -> CallPlan:
    """The operation list of one call on ``rank`` (``m``: rows of the output, for all_gather of
    the gathered A), after the checks of what a caller can get wrong, before any work.
    ``row_scales``: an fp8 call with rowwise scales (an all_gather moves them with the rows)."""
    chosen = mode_named(mode)
    if collective not in COLLECTIVES:
        raise ScheduleError(f"collective: {collective!r} is not one of {', '.join(COLLECTIVES)}")
    why = chosen.blocker(collective, world, tile)
    if why:
        raise ScheduleError(f"mode {chosen.name}: {why}")
    weights = check_weights(weights)
    if m < world:  # a rank would own no row, and its flags would go unpaired
        raise ShapeError(
            f"engine copy_engine needs M >= the world size {world} (a row per rank), got M={m}; "
            "the ops run smaller M as GEMM then the collective"
        )
    if collective != "all_reduce" and m % world:  # (all_gather: every shard has M / world rows)
        raise ShapeError(f"{collective} needs M divisible by the world size {world}, got M={m}")
    if n < 1 or k < 1:
        raise ShapeError(f"engine copy_engine: empty operands (N={n}, K={k})")
    return chosen.build(CallSpec(collective, world, rank, m, n, k, weights, tile, row_scales))


def _ring_reduce(spec: CallSpec) -> CallPlan:
    w, r = spec.world, spec.rank
    all_reduce = spec.collective == "all_reduce"
    spans = shard_rows(spec.m, w)
    chunks = [chunks_of(r1 - r0, spec.weights) for r0, r1 in spans]
    left, right = (r - 1) % w, (r + 1) % w
    peers = [(r + i) % w for i in range(1, w)]

    def a_rows(d: int, c0: int, c1: int) -> Rows:
        return Rows("a", r, spans[d][0] + c0, spans[d][0] + c1)

    b = _Builder()
    b.add(Join(MAIN, SIDE), Join(MAIN, LOCAL))  # eager only: the previous call's streams are done
    b.add(Join(SIDE, MAIN))  # the inputs and the output's memory are ready
    b.take(MAIN, Cell(r, "pulled", (0,)))  # my right neighbour has pulled my previous part0
    b.add(Join(ALT, MAIN))
    d = (r - 1) % w
    for c, (c0, c1) in enumerate(chunks[d]):  # step 0: partials, beta = 0
        g = b.gemm_stream()
        b.add(Gemm(g, a_rows(d, c0, c1), Rows("part0", r, c0, c1), 0))
        b.add(Signal(g, Cell(right, "partial", (0, c))))
    summed: list[int] = []
    for s in range(1, w):
        d = (r - s - 1) % w
        last = s == w - 1
        dst = f"part{s}" if not last else ("final" if all_reduce else "out")
        if not last:  # my right neighbour has pulled my previous part<s>
            b.take(SIDE, Cell(r, "pulled", (s,)))
        elif all_reduce:  # every peer has gathered my previous final
            for q in peers:
                b.take(SIDE, Cell(r, "gathered", (q,)))
        pulled = []
        for c, (c0, c1) in enumerate(chunks[d]):
            b.take(SIDE, Cell(r, "partial", (s - 1, c)))
            pulled.append(b.event())
            b.add(
                Copy(SIDE, Rows(dst, r, c0, c1), Rows(f"part{s - 1}", left, c0, c1)), Record(SIDE, pulled[c])
            )
        b.add(Signal(SIDE, Cell(left, "pulled", (s - 1,))))
        for c, (c0, c1) in enumerate(chunks[d]):  # the sum in the GEMM's epilogue, beta = 1
            g = b.gemm_stream()
            b.add(WaitEvent(g, pulled[c]), Gemm(g, a_rows(d, c0, c1), Rows(dst, r, c0, c1), 1))
            if not last:
                b.add(Signal(g, Cell(right, "partial", (s, c))))
            elif all_reduce:
                b.add(*(Signal(g, Cell(q, "summed", (r, c))) for q in peers))
                summed.append(b.event())
                b.add(Record(g, summed[c]))
    if all_reduce:
        m0 = spans[r][0]
        for c, (c0, c1) in enumerate(chunks[r]):  # my sums into the output, as each is done
            b.add(
                WaitEvent(LOCAL, summed[c]),
                Copy(LOCAL, Rows("out", r, m0 + c0, m0 + c1), Rows("final", r, c0, c1)),
            )
        _gather(b, r, peers, spans, chunks)
        b.add(Join(MAIN, LOCAL))
    b.add(Join(MAIN, ALT), Join(MAIN, SIDE))
    out_rows = spec.m if all_reduce else spans[r][1] - spans[r][0]
    rows = max(r1 - r0 for r0, r1 in spans)
    return CallPlan(spec, "ring", tuple(b.ops), 2, out_rows, {"n": rows})


def _gather(b: _Builder, r: int, peers: list[int], spans, chunks) -> None:
    """The peers' final chunks into my output, chunk by chunk across the peers (every rank sums
    its chunk c at about the same time); each owner is told once I have all of its chunks."""
    for c in range(max(len(chunks[q]) for q in peers)):
        for q in peers:
            if c >= len(chunks[q]):
                continue
            (c0, c1), q0 = chunks[q][c], spans[q][0]
            b.take(SIDE, Cell(r, "summed", (q, c)))
            b.add(Copy(SIDE, Rows("out", r, q0 + c0, q0 + c1), Rows("final", q, c0, c1)))
            if c == len(chunks[q]) - 1:
                b.add(Signal(SIDE, Cell(q, "gathered", (r,))))


def _ring_all_gather(spec: CallSpec) -> CallPlan:
    w, r = spec.world, spec.rank
    spans = shard_rows(spec.m, w)
    rows = spans[r][1] - spans[r][0]
    chunks = chunks_of(rows, spec.weights)
    peers = [(r + i) % w for i in range(1, w)]
    b = _Builder()
    b.add(Join(MAIN, SIDE), Join(MAIN, LOCAL))  # eager only: the previous call's streams are done
    b.add(Join(LOCAL, MAIN), Join(SIDE, MAIN))
    for q in peers:  # every peer has taken my previous shard
        b.take(LOCAL, Cell(r, "taken", (q,)))
    b.add(Copy(LOCAL, Rows("shard", r, 0, rows), Rows("a", r, 0, rows)))
    m0 = spans[r][0]
    if spec.row_scales:  # my rows' scales beside them (my own rows' GEMM reads scale_a)
        b.add(Copy(LOCAL, Rows(SCALE_REGION, r, 0, rows), Rows("scale_a", r, 0, rows)))
    b.add(*(Signal(LOCAL, Cell(q, "shard", (r,))) for q in peers))
    b.add(Copy(LOCAL, Rows("gathered", r, m0, m0 + rows), Rows("a", r, 0, rows)))
    b.add(Join(ALT, MAIN))
    b.add(Gemm(b.gemm_stream(), Rows("a", r, 0, rows), Rows("out", r, m0, m0 + rows), 0))  # my rows first
    pulled = {}
    for q in peers:
        b.take(SIDE, Cell(r, "shard", (q,)))
        q0 = spans[q][0]
        if spec.row_scales:  # (before its first chunk: every chunk's event covers it)
            b.add(Copy(SIDE, Rows("gathered_scale", r, q0, q0 + rows), Rows(SCALE_REGION, q, 0, rows)))
        for c, (c0, c1) in enumerate(chunks):
            pulled[q, c] = b.event()
            b.add(
                Copy(SIDE, Rows("gathered", r, q0 + c0, q0 + c1), Rows("shard", q, c0, c1)),
                Record(SIDE, pulled[q, c]),
            )
        b.add(Signal(SIDE, Cell(q, "taken", (r,))))
    for q in peers:
        q0 = spans[q][0]
        for c, (c0, c1) in enumerate(chunks):
            g = b.gemm_stream()
            rows_c = (q0 + c0, q0 + c1)
            b.add(
                WaitEvent(g, pulled[q, c]), Gemm(g, Rows("gathered", r, *rows_c), Rows("out", r, *rows_c), 0)
            )
    b.add(Join(MAIN, LOCAL), Join(MAIN, ALT), Join(MAIN, SIDE))
    region_rows = {"k": rows, "s": rows} if spec.row_scales else {"k": rows}
    return CallPlan(spec, "ring", tuple(b.ops), 2, spec.m, region_rows)


def _tiled(spec: CallSpec) -> CallPlan:
    r, p = spec.rank, 1 - spec.rank
    all_reduce = spec.collective == "all_reduce"
    tile = spec.tile
    assert tile is not None
    (m0, m1), (t0, t1) = shard_rows(spec.m, 2)[r], shard_rows(spec.m, 2)[p]
    tiles_n = -(-spec.n // tile.block_n)

    def cut(rows: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        b = tile_row_bounds(rows, spec.weights, tile.block_m)
        chunks = tuple(itertools.pairwise(b))
        return chunks, tuple(-(-(c1 - c0) // tile.block_m) * tiles_n for c0, c1 in chunks)

    own, own_tiles = cut(m1 - m0)
    other, other_tiles = cut(t1 - t0)
    base = m0 if all_reduce else 0  # my shard's first row in the output
    b = _Builder()
    b.add(Join(MAIN, SIDE), Join(MAIN, NOTIFY))  # eager only
    b.add(Join(SIDE, MAIN), Join(NOTIFY, MAIN))
    b.take(MAIN, Cell(r, "pulled", (0,)))  # the peer has pulled my previous partials
    b.add(
        TiledGemm(
            MAIN, Rows("a", r, t0, t1), Rows("part0", r, 0, t1 - t0), tile, other, other_tiles,
            counters=Cell(r, "counter", (0,)),
        )
    )  # fmt: skip
    for c in range(len(other)):  # each of the peer's chunks, once its tiles are stored
        b.take(NOTIFY, Cell(r, "counter", (c,)), other_tiles[c])
        b.add(Signal(NOTIFY, Cell(p, "partial", (0, c))))
    for c, (c0, c1) in enumerate(own):  # the peer's partials into my shard of the output
        b.take(SIDE, Cell(r, "partial", (0, c)))
        b.add(Copy(SIDE, Rows("out", r, base + c0, base + c1), Rows("part0", p, c0, c1)))
        b.add(Signal(SIDE, Cell(r, "ready", (c,))))
    b.add(Signal(SIDE, Cell(p, "pulled", (0,))))
    b.add(
        TiledGemm(
            MAIN, Rows("a", r, m0, m1), Rows("out", r, base, base + m1 - m0), tile, own, own_tiles,
            counters=Cell(p, "summed", (r, 0)) if all_reduce else None,
            ready=Cell(r, "ready", (0,)),
            copy_to=Rows("final", p, 0, m1 - m0) if all_reduce else None,
        )
    )  # fmt: skip
    b.add(Clear(MAIN, Cell(r, "ready", (0,)), len(own)))  # ready is read again after the next pulls
    if all_reduce:  # (queued after phase 2: a wait queued first could block it)
        for c, (c0, c1) in enumerate(other):  # the peer's sums, as each chunk's count completes
            b.take(SIDE, Cell(r, "summed", (p, c)), other_tiles[c])
            b.add(Copy(SIDE, Rows("out", r, t0 + c0, t0 + c1), Rows("final", r, c0, c1)))
    b.add(Join(MAIN, NOTIFY), Join(MAIN, SIDE))
    out_rows = spec.m if all_reduce else m1 - m0
    return CallPlan(spec, "tiled", tuple(b.ops), 2, out_rows, {"n": max(m1 - m0, t1 - t0)})
