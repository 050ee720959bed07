"""Geometry of one overlapped call: which tile goes to which group, and where each group's data lives.

Given a schedule, the call's shape and the SM count, ``make_plan`` derives (pure Python, no torch):

    S      = world_size for reduce_scatter and all_gather (one shard of M/S rows per rank),
             1 for all_reduce
    Ms     = M / S rows per shard;  mt = ceil(Ms / BM), nt = ceil(N / BN) tiles per shard
    Ts     = mt * nt local tile positions l; T = S * Ts tiles in all
    tile t = l * S + s         (the same local tile of every shard is adjacent in schedule order)
    (tm, tn) = grouped_swizzle(l, GROUP_M)  (as in Triton's matmul tutorial)
    program p of G runs tiles p, p + G, p + 2G, ...   (wave w = tiles [wG, (w+1)G))
    unit u = tiles [uU, (u+1)U), U = signal_tiles (a multiple of S)
    group g = consecutive units; its local positions [l0, l1) and, for row_band, rows [i0, i1)

A group's data is one contiguous chunk of the GEMM output buffer, shard-major inside the group, so
that ``reduce_scatter`` of the chunk hands rank s exactly shard s's part of it:

    tile_major: slot(t) = S*l0 + s*(l1 - l0) + (l - l0); a slot is BM*BN elements
    row_band:   row(s, i) = S*i0 + s*(i1 - i0) + (i - i0); a row is N elements
    chunk g  = [S*a0*E, S*a1*E) of the buffer;  its part for one rank = [a0*E, a1*E)
               with (a0, a1, E) = (l0, l1, BM*BN) for tile_major and (i0, i1, N) for row_band.

For all_reduce with row_band (S = 1) the buffer is the row-major output itself: nothing to restore.
For all_gather (row_band only) the same formula places the gathered A rows, with E = K: one
all_gather of rows [i0, i1) of every shard fills chunk g, and the group's tiles are the output
rows [s*Ms + i0, s*Ms + i1) of every shard s (``fo_kernels.engines.triton.executor``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.errors import ScheduleError, ShapeError
from fo_kernels.schedule import SHARDED_COLLECTIVES, Schedule
from fo_kernels.tile import MIN_BLOCK, Tile

# Most groups one call may use: the runtime keeps this many counters (4 KiB of int32) and the
# signalled GEMM adds to counter g of every group g, so ``make_plan`` refuses a schedule with more
# before anything is launched.
MAX_GROUPS = 1024


def check_group_count(count: int) -> None:
    """Refuse a call of ``count`` groups where the runtime has fewer counters (``MAX_GROUPS``)."""
    if count > MAX_GROUPS:
        raise ScheduleError(
            f"groups: at most {MAX_GROUPS} groups per call (the runtime's counters), got {count}"
        )


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


# The split tail's pieces (``fo_kernels.gemm.tail``) are at least this many rows and columns (a forced
# split goes down to MIN_BLOCK): the measured pieces are 128x128 and 64x128 of 128x256 tiles
# (docs/perf-notes.md, "The split tail").
SPLIT_MIN_BLOCK = 64
# The split tail costs host time (its pieces' descriptors and arrival counts): calls of fewer
# multiply-adds than this (2^35, ~45 us of H200 work) are not split. Measured in the whole waves'
# launch (the split tail fused into it) against the whole waves, 2048x4096x4096 (2^35) on 124 / 120 /
# 116 programs: -6, +17, +16% issued eagerly back to back, +20, +18, +20% replayed from CUDA graphs
# (the GPU's own time); 8192x4096x2048 (2^36): +3, +1% eager, +2, +2, -4% graphed; from
# 4096x8192x4096 (2^37) up the split gained up to 6%. In a launch of its own the split made the two
# short shapes host-bound (-20..-55% eager).
SPLIT_MIN_MACS = 1 << 35


def tail_split(
    num_tiles: int, grid: int, tile: Tile, force: bool = False, macs: int = SPLIT_MIN_MACS
) -> tuple[int, int]:
    """(SPLIT_M, SPLIT_N): how the tiles of a last, partial wave are cut so that their pieces run
    as one wave on the grid; ``(1, 1)``: not cut (the tiles fill whole waves, there is a single
    wave, the call has fewer than ``SPLIT_MIN_MACS`` multiply-adds (``macs``: M x N x K), or the tail
    holds more than half the grid, where a wave of pieces gains nothing: its time is a whole
    piece's and no piece is smaller than half a tile). Quarters where four pieces a tile fit, else
    halves across the tile's longer side. ``force``: cut any partial last wave, into halves at
    least, with pieces down to ``MIN_BLOCK``."""
    tail = num_tiles % grid
    if tail == 0 or num_tiles < grid or (macs < SPLIT_MIN_MACS and not force):
        return 1, 1
    least = MIN_BLOCK if force else SPLIT_MIN_BLOCK
    can_m, can_n = tile.block_m // 2 >= least, tile.block_n // 2 >= least
    if can_m and can_n and 4 * tail <= grid:
        return 2, 2
    if not (can_m or can_n) or (2 * tail > grid and not force):
        return 1, 1
    return (2, 1) if can_m and (tile.block_m > tile.block_n or not can_n) else (1, 2)


# The measured rule for ``fo_kernels.gemm.KernelOptions(stream_k=None)`` (docs/perf-notes.md, "Where
# the stream-K tail's time goes" and "The rule from the K blocks stream-K saves"): the tail's
# programs run their K blocks at the whole waves' rate (0.64 us a 128x256x64 block on one H200, in a
# per-program timeline) plus ~5 us a part (pipeline fill, float32 part store) and ~8 us for the
# last program's sum and epilogue, so it pays where it saves each program at least this many of a
# whole tile's K blocks, (1 - tail / grid) x K blocks. Measured (aligned, in the whole waves'
# launch, against whole waves; 23 shape-grid pairs): +2.4..+11.6% on all 8 that save >= 64,
# -5.7..+1.6% on the 15 that save fewer (K = 2048 lost more before).
STREAM_K_MIN_SAVED_BLOCKS = 64
# A tail tile is cut into at most this many programs' parts: its last program reads every other
# part (128 KB of float32 each for a 128x256 tile) alone, at one SM's bandwidth. Cut into 15 parts
# (8 tail tiles over 124 programs) the tail cost more than the whole wave it replaced.
STREAM_K_MAX_PARTS = 4


def stream_k_split(num_tiles: int, grid: int, k_tiles: int, force: bool = False) -> tuple[int, int]:
    """(tiles in whole waves, K blocks per program in the tail): ``(num_tiles, 0)`` when the tiles
    fill whole waves or (unless ``force``) the measured rule says sharing out the last partial
    wave does not pay. Each program's share is at least ``1 / STREAM_K_MAX_PARTS`` of a tile's K
    blocks (programs past the tail's end have none)."""
    tail = num_tiles % grid
    if tail == 0 or num_tiles < grid:
        return num_tiles, 0
    if not force and (grid - tail) * k_tiles < STREAM_K_MIN_SAVED_BLOCKS * grid:
        return num_tiles, 0
    share = max(-(-tail * k_tiles // grid), -(-k_tiles // STREAM_K_MAX_PARTS))
    return num_tiles - tail, share


# The ping-pong kernel's K-split tail (``fo_kernels.gemm.pingpong``) cuts each tile of the last,
# partial wave into at most this many K ranges, one program each, run as the program's first item;
# the last of a tile's programs to finish reads the others' float32 parts (64 KB each for 128x128)
# alone while its other consumer runs a whole tile's main loop. Measured on one H200 (graphed;
# docs/perf-notes.md, "The K-split tail run first"): up to 4 parts cost nothing beyond
# their K blocks; 7-8 parts (8-16 tail tiles on 120-124 programs) cost 7-13% more than 4 at
# K = 2048-4096, where the last program's read of them outlasts the other consumer's main loop.
PINGPONG_MAX_PARTS = 4


def pingpong_parts(num_tiles: int, grid: int, k_tiles: int) -> int:
    """K parts a tile of the ping-pong kernel's K-split tail (0: none): as many as fit the grid at
    one part a program, at most ``PINGPONG_MAX_PARTS`` and ``k_tiles`` (every part has a K block);
    none where the tiles fill whole waves, there is a single wave, or fewer than two parts fit (the
    tail holds more than half the grid, where its wave of parts takes as long as a whole one)."""
    tail = num_tiles % grid
    if tail == 0 or num_tiles < grid:
        return 0
    parts = min(grid // tail, PINGPONG_MAX_PARTS, k_tiles)
    return parts if parts >= 2 else 0


@dataclass(frozen=True, slots=True)
class TailPlan:
    """How ``signalled_gemm`` runs a call's last, partial wave: ``split`` (SPLIT_M, SPLIT_N; (1, 1):
    not split), ``main_tiles`` (the tiles of the whole waves' loop; the rest is the tail),
    ``share`` (K blocks per program of the plain kernel's stream-K tail; 0: none) and ``parts``
    (K parts per tail tile of the ping-pong kernel's K-split tail; 0: none)."""

    split: tuple[int, int]
    main_tiles: int
    share: int
    parts: int = 0


def tail_plan(
    num_tiles: int, grid: int, tile: Tile, k: int, macs: int, stream_k: bool | None = None,
    split_tail: bool | None = None,
) -> TailPlan:  # fmt: skip
    """The kernel's choice for the last partial wave (``stream_k`` and ``split_tail`` as
    ``fo_kernels.gemm.KernelOptions``; None: the measured rules); ``macs`` is M x N x K.

    The plain kernel: the split tail first, unless stream-K is forced, else stream-K where its
    rule (or ``stream_k=True``) says. A ping-pong tile (``Tile.pingpong``): its K-split tail
    (``pingpong_parts``) where the parts fit and, unless ``stream_k`` is True, the call has
    ``SPLIT_MIN_MACS`` multiply-adds (as the split tail); never where ``stream_k`` is False or
    ``split_tail`` True. Else the split tail's pieces, in a launch of the plain kernel after its
    whole waves."""
    k_tiles = cdiv(k, tile.block_k)
    if tile.pingpong:
        if stream_k is not False and split_tail is not True:
            parts = pingpong_parts(num_tiles, grid, k_tiles)
            if parts and (stream_k is True or macs >= SPLIT_MIN_MACS):
                return TailPlan((1, 1), num_tiles - num_tiles % grid, 0, parts)
        stream_k = False
    if stream_k is not True and split_tail is not False:
        split = tail_split(num_tiles, grid, tile, split_tail is True, macs)
        if split != (1, 1):
            return TailPlan(split, num_tiles - num_tiles % grid, 0)
    if stream_k is False:
        return TailPlan((1, 1), num_tiles, 0)
    main, share = stream_k_split(num_tiles, grid, k_tiles, bool(stream_k))
    return TailPlan((1, 1), main, share)


def resolve_groups(groups: tuple[int, ...], num_units: int, *, exact: bool, step: int = 1) -> tuple[int, ...]:
    """Group sizes in units for this call.

    On an exact-shape row the sizes must already sum to ``num_units``. On an M-range row they are
    relative weights: scaled to ``num_units`` by largest remainder, each group keeping >= 1 unit;
    with fewer units than groups, every unit becomes its own group. ``step`` (range rows only):
    groups start only at multiples of ``step`` units (``row_band``: where a band of tile rows
    starts, ``band_step``), so the weights are scaled over the ``ceil(num_units / step)`` spans
    and the last group ends at ``num_units``.
    """
    total = sum(groups)
    if exact:
        if total != num_units:
            raise ScheduleError(
                f"groups: sizes sum to {total} signal units but this shape has {num_units} "
                f"(ceil(tiles / signal_tiles))"
            )
        return tuple(groups)
    if step > 1:
        sizes = [size * step for size in resolve_groups(groups, cdiv(num_units, step), exact=False)]
        sizes[-1] -= sum(sizes) - num_units  # (the last span is the partial one)
        return tuple(sizes)
    if num_units <= len(groups):
        return (1,) * num_units
    spare = num_units - len(groups)
    raw = [g / total * spare for g in groups]
    base = [int(x) for x in raw]
    order = sorted(range(len(groups)), key=lambda i: raw[i] - base[i], reverse=True)
    for i in order[: spare - sum(base)]:
        base[i] += 1
    return tuple(1 + b for b in base)


def band_step(unit: int, shards: int, band: int) -> int:
    """Signal units from one start of a band of tile rows to the next: unit ``u`` ends at tile
    ``u * unit``, local tile ``u * unit / shards``, which starts a band when ``u * unit`` is a
    multiple of ``shards * band`` (``band`` local tiles)."""
    return math.lcm(unit, shards * band) // unit


def group_step(schedule: Schedule, m: int, n: int) -> int:
    """Signal units between the places a group of a Triton schedule may start on an (m, n)
    output: 1, or with ``row_band`` the units from one band of tile rows to the next
    (``band_step``). ``resolve_groups`` takes it to scale relative weights."""
    st = schedule.settings
    assert isinstance(st, TritonSettings)
    if st.layout != "row_band":
        return 1
    shards = schedule.world_size if schedule.collective in SHARDED_COLLECTIVES else 1
    return band_step(st.signal_tiles, shards, st.tile.group_m * cdiv(n, st.tile.block_n))


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything the launcher needs for one call; see the module docstring for the symbols."""

    m: int
    n: int
    k: int
    block_m: int
    block_n: int
    shards: int  # S
    rows_per_shard: int  # Ms
    tiles_m: int  # mt
    tiles_n: int  # nt
    grid: int  # G
    unit_tiles: int  # U
    layout: str
    group_units: tuple[int, ...]
    group_local: tuple[tuple[int, int], ...]  # [l0, l1) per group
    group_rows: tuple[tuple[int, int], ...]  # [i0, i1) per group (row_band), else ()

    @property
    def tiles_per_shard(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def num_tiles(self) -> int:
        return self.shards * self.tiles_per_shard

    @property
    def num_units(self) -> int:
        return cdiv(self.num_tiles, self.unit_tiles)

    @property
    def num_groups(self) -> int:
        return len(self.group_units)

    @property
    def elems_per_unit_of_a(self) -> int:
        """E: elements per slot (tile_major) or per row (row_band)."""
        return self.block_m * self.block_n if self.layout == "tile_major" else self.n

    def group_span(self, g: int) -> tuple[int, int]:
        """(a0, a1): the group's positions in layout units (local tiles or shard-local rows)."""
        return self.group_local[g] if self.layout == "tile_major" else self.group_rows[g]

    def group_tiles(self, g: int) -> int:
        """Tiles that signal group g's counter in one call."""
        l0, l1 = self.group_local[g]
        return self.shards * (l1 - l0)

    def chunk_range(self, g: int) -> tuple[int, int]:
        """Element range of group g's chunk in the GEMM output buffer."""
        a0, a1 = self.group_span(g)
        e = self.elems_per_unit_of_a
        return self.shards * a0 * e, self.shards * a1 * e

    def part_range(self, g: int) -> tuple[int, int]:
        """Element range of one rank's part of group g (reduce_scatter output, or restore input)."""
        a0, a1 = self.group_span(g)
        e = self.elems_per_unit_of_a
        return a0 * e, a1 * e

    def buffer_numel(self) -> int:
        if self.layout == "tile_major":
            return self.num_tiles * self.block_m * self.block_n
        return self.m * self.n

    def unit_group(self) -> list[int]:
        """Group index of every signal unit (what the kernel's epilogue looks up)."""
        out: list[int] = []
        for g, size in enumerate(self.group_units):
            out.extend([g] * size)
        return out

    def group_info(self) -> list[tuple[int, int]]:
        """(a0, a1 - a0) per group: the base and length the epilogue's address formula needs."""
        return [(a0, a1 - a0) for a0, a1 in (self.group_span(g) for g in range(self.num_groups))]


def make_plan(schedule: Schedule, m: int, n: int, k: int, *, sm_count: int) -> Plan:
    """Check the schedule against the call's shape and derive the plan; errors name the field."""
    st = schedule.settings
    if not isinstance(st, TritonSettings):
        raise ScheduleError(
            f"engine: a tile plan is made for engine triton, not {schedule.engine or 'overlap: false'}"
        )
    if not schedule.problem.covers(m, n, k):
        raise ScheduleError(
            f"problem: the schedule is for {schedule.problem.describe()}, called with {m}x{n}x{k}"
        )
    tile = st.tile
    shards = schedule.world_size if schedule.collective in SHARDED_COLLECTIVES else 1
    if m % shards:
        raise ShapeError(f"{schedule.collective} needs M divisible by the world size {shards}, got M={m}")
    rows = m // shards
    mt, nt = cdiv(rows, tile.block_m), cdiv(n, tile.block_n)
    num_tiles = shards * mt * nt
    grid = sm_count - st.sms_free
    if grid < 1:
        raise ScheduleError(f"sms_free: {st.sms_free} leaves no SM of {sm_count} for the GEMM")
    grid = min(grid, num_tiles)
    unit = st.signal_tiles
    num_units = cdiv(num_tiles, unit)
    band = tile.group_m * nt  # local tiles in one band of GROUP_M tile rows
    # (an M-range row_band row cuts its groups where bands start, whatever the call's M)
    step = group_step(schedule, m, n)
    sizes = resolve_groups(st.groups, num_units, exact=not schedule.problem.is_range, step=step)
    check_group_count(len(sizes))

    local: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        stop = min(start + size * unit, num_tiles)
        local.append((start // shards, stop // shards))
        start = stop
    rows_of: list[tuple[int, int]] = []
    if st.layout == "row_band":
        for g, (l0, _l1) in enumerate(local):
            if l0 % band and l0 != mt * nt:
                raise ScheduleError(
                    "groups: with layout row_band every group must start on a band of "
                    f"group_m={tile.group_m} "
                    f"tile rows ({band} local tiles); group {g} starts at local tile {l0}"
                )
        rows_of = [
            (min((l0 // nt) * tile.block_m, rows), min((l1 // nt) * tile.block_m, rows)) for l0, l1 in local
        ]
    return Plan(
        m=m,
        n=n,
        k=k,
        block_m=tile.block_m,
        block_n=tile.block_n,
        shards=shards,
        rows_per_shard=rows,
        tiles_m=mt,
        tiles_n=nt,
        grid=grid,
        unit_tiles=unit,
        layout=st.layout,
        group_units=sizes,
        group_local=tuple(local),
        group_rows=tuple(rows_of),
    )


def check_fits(schedule: Schedule, m: int, n: int, k: int, *, sm_count: int) -> None:
    """Raise ``ScheduleError`` / ``ShapeError`` when an overlapped schedule cannot run (M, N, K).

    The Triton engine must give a plan (``make_plan``); an ``engine: copy_engine`` schedule cuts
    row chunks of any M (``fo_kernels.engines.copy_engine.chunk_bounds`` cuts fewer when a shard is short).
    """
    if isinstance(schedule.settings, TritonSettings):
        make_plan(schedule, m, n, k, sm_count=sm_count)
