"""The protocol as data: the operations of one copy-engine call on one rank, in issue order.

A mode (``fo_kernels.engines.copy_engine.modes``) turns a call's spec into a ``CallPlan``: a tuple of the
operations below, each queued on one named stream. An executor issues them in list order: the GPU
executor through cuBLAS, the persistent Triton GEMM and the CUDA driver (``gpu.py``); the CPU
executor on one FIFO worker per stream, ranks as threads (``cpu.py``). Operations on one stream run
in order; across streams only ``Join``, ``WaitEvent`` and the flag waits order them, exactly as on
a GPU.

Streams: ``main`` (the caller's stream, or the capture stream), ``alt`` (every other chunk GEMM),
``side`` (pulls from the peers), ``local`` (copies within this GPU), ``notify`` (the tiled mode's
forwarding of finished chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fo_kernels.engines.copy_engine.layout import Cell, Rows
from fo_kernels.tile import Tile

MAIN, ALT, SIDE, LOCAL, NOTIFY = "main", "alt", "side", "local", "notify"
STREAMS = (MAIN, ALT, SIDE, LOCAL, NOTIFY)


@dataclass(frozen=True, slots=True)
class Gemm:
    """``out = a @ B`` (``beta`` 0) or ``out += a @ B`` (``beta`` 1: the sum in the epilogue); fp8:
    ``a``'s rows scaled by their rows of its scale buffer (``layout.SCALES_OF``) and B by its."""

    stream: str
    a: Rows
    out: Rows
    beta: int


@dataclass(frozen=True, slots=True)
class TiledGemm:
    """The persistent Triton GEMM over ``a``'s rows (``fo_kernels.gemm.rows_gemm``), its tile rows
    grouped by ``chunks`` (row bounds relative to ``a``): ``out[c] = a[c] @ B`` and then, per
    chunk, ``counters`` (first cell; one per chunk) grows by the chunk's tiles. ``ready`` (first
    cell): each chunk first waits in the kernel for its cell, then adds ``out``'s pulled rows to
    its sum. ``copy_to``: every result row is stored there too (a peer's memory)."""

    stream: str
    a: Rows
    out: Rows
    tile: Tile
    chunks: tuple[tuple[int, int], ...]
    tiles: tuple[int, ...]  # tiles per chunk: the counters' increments
    counters: Cell | None = None
    ready: Cell | None = None
    copy_to: Rows | None = None


@dataclass(frozen=True, slots=True)
class Copy:
    """``dst = src`` through the copy engine (a pull when ``src`` is a peer's memory)."""

    stream: str
    dst: Rows
    src: Rows


@dataclass(frozen=True, slots=True)
class Signal:
    """Set ``cell`` (a peer's or mine) to 1 once everything before it on the stream is visible."""

    stream: str
    cell: Cell


@dataclass(frozen=True, slots=True)
class Wait:
    """Block the stream until my ``cell`` reaches ``target`` (GPU front end, no SM)."""

    stream: str
    cell: Cell
    target: int = 1


@dataclass(frozen=True, slots=True)
class Reset:
    """Set my ``cell`` back to 0 (after its wait, for the next call)."""

    stream: str
    cell: Cell


@dataclass(frozen=True, slots=True)
class Clear:
    """Set ``count`` consecutive cells of mine, from ``cell`` on, to 0 (one memset)."""

    stream: str
    cell: Cell
    count: int


@dataclass(frozen=True, slots=True)
class Record:
    """Record event ``event`` on the stream."""

    stream: str
    event: int


@dataclass(frozen=True, slots=True)
class WaitEvent:
    """Block the stream until the last ``Record`` of ``event`` issued before this is done."""

    stream: str
    event: int


@dataclass(frozen=True, slots=True)
class Join:
    """Block the stream until all work issued on ``other`` before this is done."""

    stream: str
    other: str


Op = Gemm | TiledGemm | Copy | Signal | Wait | Reset | Clear | Record | WaitEvent | Join


@dataclass(frozen=True)
class CallSpec:
    """One call as the modes see it: ``m`` rows of the output (all_gather: of the gathered A);
    ``row_scales``: A's rows come with scales of their own (fp8, rowwise), which an all_gather
    moves with them."""

    collective: str
    world: int
    rank: int
    m: int
    n: int
    k: int
    weights: tuple[int, ...]
    tile: Tile | None = None
    row_scales: bool = False


@dataclass(frozen=True)
class CallPlan:
    """The operations of one call on one rank. The first ``prologue`` operations are issued only
    by an eager call (they order it after the previous call's side streams; a captured graph
    joins its own); ``region_rows`` is how many rows of each width (``"n"``, ``"k"``; ``"s"``: of
    the scales region) the symmetric regions must hold."""

    spec: CallSpec
    mode: str
    ops: tuple[Op, ...]
    prologue: int
    out_rows: int
    region_rows: dict[str, int] = field(default_factory=dict)

    @property
    def events(self) -> int:
        return 1 + max((op.event for op in self.ops if isinstance(op, (Record, WaitEvent))), default=-1)

    @property
    def streams(self) -> tuple[str, ...]:
        used = {op.stream for op in self.ops} | {op.other for op in self.ops if isinstance(op, Join)}
        return tuple(s for s in STREAMS if s in used)
