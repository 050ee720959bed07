"""Where a copy-engine call's rows and flags live: shards, chunks, flag cells and buffer regions.

Rows. Rank r owns shard r of the output rows (``shard_rows``: the first ``M mod w`` shards one row
longer, so two ranks split M as ceil(M/2) then the rest). Every shard is cut into row chunks by the
schedule's weights (``chunk_bounds``); every rank cuts every shard the same way, so a chunk is named
by (shard, index) on all ranks.

Flags. Each rank has one symmetric int32 array of flag cells that its peers write
(``cuStreamWriteValue32`` after a system fence) and it waits on (``cuStreamWaitValue32`` GEQ).
A cell is named ``Cell(owner, name, index)``; ``FlagLayout`` maps names to slots:

    partial(s, c)  ring step s's accumulator of chunk c is ready in my left neighbour's ``part<s>``
    summed(q, c)   rank q's final sums of its chunk c are ready in q's ``final`` (all_reduce);
                   the tiled mode's kernels count the stored tiles there instead
    pulled(s)      my right neighbour has finished reading my ``part<s>`` (starts at 1)
    gathered(q)    rank q has finished reading my ``final`` (starts at 1)
    ready(c)       the tiled mode: my side stream has pulled chunk c for the phase-2 kernel
    shard(q)       all_gather: rank q's shard of A is in its symmetric ``shard`` buffer
    taken(q)       all_gather: rank q has finished reading my ``shard`` (starts at 1)

A flag is 0 or 1: set by one rank, reset to 0 by the stream that waited for it. The ``starts at 1``
cells are the buffer-reuse guards: a rank rewrites a buffer only after the readers of the previous
call's data have said they are done, so a call can follow the previous one without a barrier.

Buffers. Each rank's symmetric data memory is one allocation cut into equal regions, named by
``regions(world)``: ``part0`` .. ``part<w-2>`` (the ring's accumulators, one per step that a
neighbour pulls from), ``final`` (all_reduce: my summed shard, which every peer pulls) and
``shard`` (all_gather: my shard of A), then one small region ``scales`` (an fp8 all_gather with
rowwise scales: my shard's rows of scale_a, float32). The caller's tensors are named ``a``,
``out`` and ``gathered``, and for fp8 ``scale_a`` (my rows' scales) and ``gathered_scale`` (the
gathered A's); ``a``, ``shard`` and ``gathered`` have K columns of the operand dtype, the scale
buffers one float32 column, the others N columns of the output dtype.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

from fo_kernels.engines.copy_engine.settings import MAX_CHUNKS

# Inner chunk cuts fall on multiples of this many rows when the shard is big enough: 128 is the
# tallest cuBLAS tile on Hopper, so no chunk's GEMM ends in a partly filled row of tiles.
ROW_ALIGN = 128
# Regions are sized in multiples of this many bytes, so a region grown for one dtype can be viewed
# as any other (float32 needs a size divisible by 4) and every region starts aligned.
BUFFER_ALIGN = 16

# The call's own tensors (this rank's memory).
CALLER_BUFFERS = ("a", "out", "gathered", "scale_a", "gathered_scale")
K_WIDE = frozenset(("a", "shard", "gathered"))  # buffers with K columns of the operand dtype
SCALE_REGION = "scales"  # the small symmetric region after the equal ones
SCALE_BUFFERS = frozenset(("scale_a", "gathered_scale", SCALE_REGION))  # one float32 column
# The scale rows of the rows of each A buffer a chunk GEMM reads (fp8, rowwise).
SCALES_OF = {"a": "scale_a", "gathered": "gathered_scale"}


def shard_rows(m: int, world: int = 2) -> tuple[tuple[int, int], ...]:
    """Rows [r0, r1) of each rank's shard: shard d starts at ceil(d * M / w)."""
    bounds = [-(-d * m // world) for d in range(world + 1)]
    return tuple((bounds[d], bounds[d + 1]) for d in range(world))


def chunk_bounds(rows: int, weights: tuple[int, ...], align: int | None = None) -> list[int]:
    """Row boundaries cutting ``rows`` by ``weights`` (each chunk >= 1 row; fewer chunks when the
    shard has fewer rows than weights). Inner cuts are rounded to ``align`` (default: to
    ``ROW_ALIGN`` when every chunk can still get that many rows)."""
    if rows <= 0:
        return [0]
    if align is None:
        align = ROW_ALIGN if rows >= ROW_ALIGN * len(weights) else 1
    total = sum(weights)
    bounds = [0]
    acc = 0
    for w in weights[:-1]:
        acc += w
        cut = round(rows * acc / total / align) * align
        if bounds[-1] < cut < rows:
            bounds.append(cut)
    bounds.append(rows)
    return bounds


def tile_row_bounds(rows: int, weights: tuple[int, ...], block_m: int) -> list[int]:
    """The tiled mode's row chunks: ``rows`` cut by ``weights`` on whole tile rows of ``block_m``
    (each chunk >= 1 tile row, so each tile belongs to exactly one chunk; fewer chunks when the
    shard has fewer tile rows than weights)."""
    tile_rows = -(-rows // block_m)
    return [min(c * block_m, rows) for c in chunk_bounds(tile_rows, weights, align=1)]


def chunks_of(rows: int, weights: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``chunk_bounds`` as (r0, r1) pairs."""
    b = chunk_bounds(rows, weights)
    return tuple(itertools.pairwise(b))


def regions(world: int) -> tuple[str, ...]:
    """The names of a rank's symmetric data regions, in memory order."""
    return (*(f"part{s}" for s in range(world - 1)), "final", "shard")


@dataclass(frozen=True, slots=True)
class Cell:
    """One int32 flag (or tile counter) cell of rank ``owner``."""

    owner: int
    name: str
    index: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"rank {self.owner}'s {self.name}{list(self.index)}"


def shifted(cell: Cell, c: int) -> Cell:
    """The cell ``c`` places after ``cell`` in its last index (a chunk's cell from the first)."""
    return Cell(cell.owner, cell.name, (*cell.index[:-1], cell.index[-1] + c))


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows [r0, r1) of a buffer of rank ``owner`` (a symmetric region, or the call's tensors)."""

    buffer: str
    owner: int
    r0: int
    r1: int

    @property
    def count(self) -> int:
        return self.r1 - self.r0

    def __str__(self) -> str:
        return f"rank {self.owner}'s {self.buffer}[{self.r0}:{self.r1}]"


# The flag kinds, each an array of cells per rank whose shape depends on the world size w.
_KINDS = (
    ("partial", lambda w: (w - 1, MAX_CHUNKS)),  # (step, chunk)
    ("summed", lambda w: (w, MAX_CHUNKS)),  # (source rank, chunk)
    ("pulled", lambda w: (w - 1,)),  # (step,)
    ("gathered", lambda w: (w,)),  # (reader rank,)
    ("ready", lambda w: (MAX_CHUNKS,)),  # (chunk,)
    ("shard", lambda w: (w,)),  # (source rank,)
    ("taken", lambda w: (w,)),  # (reader rank,)
)
GUARDS = ("pulled", "gathered", "taken")  # the cells that start at 1
COUNTER_SLOTS = MAX_CHUNKS  # the tiled mode's local tile counters, one per chunk


@dataclass(frozen=True)
class FlagLayout:
    """Slots of the flag cells of a ``world``-rank group (the same on every rank)."""

    world: int

    @cached_property
    def _kinds(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        kinds, at = {}, 0
        for name, shape_of in _KINDS:
            shape = shape_of(self.world)
            kinds[name] = (at, shape)
            at += math.prod(shape)
        return kinds

    @property
    def slots(self) -> int:
        base, shape = self._kinds[_KINDS[-1][0]]
        return base + math.prod(shape)

    def slot(self, cell: Cell) -> int:
        """The index of ``cell`` in its owner's flag array (``counter`` cells: in the counters)."""
        if cell.name == "counter":
            (c,) = cell.index
            return c
        base, shape = self._kinds[cell.name]
        if len(cell.index) != len(shape) or not all(
            0 <= i < n for i, n in zip(cell.index, shape, strict=True)
        ):
            raise IndexError(f"{cell}: outside the flag layout of {self.world} ranks")
        at = 0
        for i, n in zip(cell.index, shape, strict=True):
            at = at * n + i
        return base + at

    def cells(self, owner: int) -> list[Cell]:
        """Every flag cell of ``owner``, in slot order."""
        out = []
        for name, shape_of in _KINDS:
            out += [
                Cell(owner, name, index) for index in itertools.product(*map(range, shape_of(self.world)))
            ]
        return out

    def guards(self, owner: int) -> list[Cell]:
        """``owner``'s guard cells (1 while nobody reads the guarded buffer)."""
        w = self.world
        out = [Cell(owner, "pulled", (s,)) for s in range(w - 1)]
        for name in ("gathered", "taken"):
            out += [Cell(owner, name, (q,)) for q in range(w) if q != owner]
        return out
