"""The Triton engine's cost-model term: a signalled persistent GEMM and one NCCL call per group.

For a ``TritonSettings`` schedule and a shape (``predict``), with the plan of ``fo_kernels.plan``:

1. GEMM alone, ``T0``: the calibration's tile profile (``TileProfile``: the measured point, else
   the tile's wave model).
2. Unit ``u`` is ready when the wave after the one holding its last tile ends (a tile is
   signalled at its program's next tile's epilogue): ``ready_u = T * (w_u + 2) / W``, or
   ``T * (w_u + 1) / W`` where that wave's tiles have no next whole tile or the ping-pong kernel
   signals them (program p runs tiles p, p + G, ...; ``W`` waves, a split last wave counted as
   its share; ``T`` the GEMM time under contention; a last partial wave split or shared out runs
   after the whole waves, the ping-pong kernel's K-split tail before them: ``unit_ready_fractions``).
3. Group ``g``'s collective: its chunk's bytes on the bandwidth curve of (collective, CTA cap).
   It starts at ``max(ready_g, end_{g-1}) + COMM_ISSUE_GAP_MS`` and, while the GEMM still runs,
   progresses ``1 / comm_slowdown`` as fast (interference table). Where the calibration saw NCCL
   *not* run beside the GEMM for these free SMs and this cap (too few SMs free), it starts after
   the GEMM.
4. The GEMM slows by ``1 + (gemm_slowdown - 1) * f``, ``f`` the fraction of it that overlaps a
   collective; steps 2-4 are iterated to a fixed point (``FIXED_POINT_ROUNDS``).
5. ``tile_major`` adds the restore (read + write of the output at ``RESTORE_GBS``).
6. Device time ``max(last collective end, GEMM end) + restore``; back-to-back calls, as the
   search times them, cost ``max(device, host)``; the host time of an eager call is
   ``host_launch_ms + groups * host_per_group_ms`` (+ ``host_spin_extra_ms`` per group with spin
   waits, + ``host_restore_ms`` for tile_major), from the calibration's ``triton`` section when it
   has one, else ``DEFAULT_HOST``.

This is FlashOverlap's pipeline recurrence, corrected by the interference table;
``best_grouping`` is the dynamic program over signal units that minimises its end time. An
all_gather schedule runs the reverse pipeline (each group's gather, then its chunk GEMMs):
``fo_tune.engines.triton.gather.TritonCollectivesTerm``, the term the plug-in makes, prices it
(unvalidated: no all_gather was measured on GPUs) and leaves the others to this one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.plan import Plan, cdiv, make_plan, tail_plan
from fo_kernels.schedule import SHARDED_COLLECTIVES, Schedule
from fo_kernels.tile import Tile
from fo_tune.model.profiles import last_wave_share
from fo_tune.model.types import Interference, Prediction, output_bytes

if TYPE_CHECKING:
    from fo_tune.model.core import CostModel

# Host time of one eager call (ms), used when the calibration has no `triton` section. Measured on
# H200 x2 (docs/design.md#cost-model): the persistent GEMM's launch 0.086 ms, each
# torch.distributed call 0.044 ms and each stream wait 0.01 ms; a spin wait is a one-program Triton
# launch instead of a stream memory op (~0.02 ms more), the restore one more Triton launch.
DEFAULT_HOST = {
    "host_launch_ms": 0.086,
    "host_per_group_ms": 0.054,
    "host_spin_extra_ms": 0.02,
    "host_restore_ms": 0.03,
}
# From a group's counter completing to its collective's first NCCL kernel running: the stream wait
# resolves and the high-priority stream's kernel is scheduled (a few microseconds on Hopper).
COMM_ISSUE_GAP_MS = 0.005
# Read + write rate of the tile-major restore. Not calibrated: an H200 moves ~3 TB/s in a device
# copy (HBM3e 4.8 TB/s peak); the restore is a few percent of the suite's GEMM times either way.
RESTORE_GBS = 3000.0
# Fixed-point rounds of the GEMM-slowdown / overlap-fraction loop (it settles in 2-3).
FIXED_POINT_ROUNDS = 4
# DP over at most this many cut positions (beyond it, candidate cuts are thinned evenly).
DP_MAX_UNITS = 128


def num_units(schedule: Schedule, m: int, n: int) -> int:
    """Signal units of a Triton schedule on an (m, n) output (``Plan.num_units`` without a plan)."""
    st = schedule.settings
    assert isinstance(st, TritonSettings)
    shards = schedule.world_size if schedule.collective in SHARDED_COLLECTIVES else 1
    tiles = shards * cdiv(m // shards, st.tile.block_m) * cdiv(n, st.tile.block_n)
    return cdiv(tiles, st.signal_tiles)


def with_groups(schedule: Schedule, groups: Sequence[int]) -> Schedule:
    """The Triton schedule with other group sizes."""
    st = schedule.settings
    assert isinstance(st, TritonSettings)
    return dataclasses.replace(schedule, settings=dataclasses.replace(st, groups=tuple(groups)))


def unit_ready_fractions(plan: Plan, tile: Tile, units: Sequence[int] | None = None) -> list[float]:
    """Per signal unit: when it is complete, as a fraction of the GEMM's duration. The plain
    kernel signals a tile at its program's next tile's epilogue (``fo_kernels.gemm.waves``),
    so a unit whose last wave's tiles have a next tile in the whole waves' loop is complete one
    wave after that wave; the ping-pong kernel (``tile.pingpong``) signals each tile at its own
    epilogue, when its wave ends. Where the last, partial wave runs after that loop (the split
    tail or the stream-K tail, ``fo_kernels.plan``; after it in the same launch, or in a launch of
    its own), the whole waves' last tiles have no next tile there and are signalled when their
    wave ends, and the tail lasts its share of a wave (``last_wave_share``). The ping-pong
    kernel's K-split tail runs first instead: its tiles are ready after their share, and the whole
    tiles of the programs that ran a part end that share later. ``units``: only these units' (in
    their order; a GPU-sized M has millions of units, and a prediction reads its groups' last)."""
    # read once: a large M's plan has thousands of units, and its properties compute on each read
    num_tiles, grid, unit_tiles = plan.num_tiles, plan.grid, plan.unit_tiles
    waves = cdiv(num_tiles, grid)
    tail = tail_plan(num_tiles, grid, tile, plan.k, plan.m * plan.n * plan.k)
    main_tiles = tail.main_tiles
    share = last_wave_share(tail, cdiv(plan.k, tile.block_k))
    duration = waves - 1 + share
    part_programs = (num_tiles - main_tiles) * tail.parts  # programs [0, this) ran a part
    out = []
    for u in range(plan.num_units) if units is None else units:
        first = u * unit_tiles
        final = min(first + unit_tiles, num_tiles) - 1
        if tail.parts:  # the K-split tail first, then the whole waves
            last_whole = min(final, main_tiles - 1)
            if last_whole < first:  # every tile of the unit is a tail tile
                out.append(share / duration)
                continue
            wave = last_whole // grid
            lowest = max(first, wave * grid) - wave * grid  # its first program in that wave
            out.append((wave + 1 + (share if lowest < part_programs else 0.0)) / duration)
            continue
        wave = final // grid
        # the unit's earliest tile in that wave: if it has a next tile, so do the later programs
        deferred = not tile.pingpong and max(first, wave * grid) + grid < main_tiles
        done = wave + deferred  # the wave whose end completes the unit
        out.append((done + 1 if done < waves - 1 else duration) / duration)
    return out


class TritonTerm:
    """Predictions of Triton-engine schedules (see the module docstring)."""

    def __init__(self, model: CostModel, host: Mapping[str, float] | None = None) -> None:
        self.model = model
        self.host = {**DEFAULT_HOST, **(host or {})}
        self._comm: dict[tuple[str, int, int], float] = {}

    def comm_time(self, collective: str, cap: int, nbytes: int) -> float:
        key = (collective, cap, nbytes)
        if key not in self._comm:
            self._comm[key] = self.model.curves.time(collective, cap, nbytes)
        return self._comm[key]

    def host_ms(self, st: TritonSettings, groups: int) -> float:
        h = self.host
        per_group = h["host_per_group_ms"] + (h["host_spin_extra_ms"] if st.wait_mode == "spin" else 0.0)
        restore = h["host_restore_ms"] if st.layout == "tile_major" else 0.0
        return h["host_launch_ms"] + groups * per_group + restore

    def plan(self, schedule: Schedule, m: int, n: int, k: int) -> Plan:
        return make_plan(schedule, m, n, k, sm_count=self.model.sm_count)

    def predict(self, schedule: Schedule, m: int, n: int, k: int) -> Prediction:
        """Predicted latency of ``schedule`` on (m, n, k); raises ``ScheduleError`` if infeasible."""
        st = schedule.settings
        assert isinstance(st, TritonSettings)
        plan = self.plan(schedule, m, n, k)
        t0, source = self.model.tile_profile.time(st.tile, m, n, k, plan.grid)
        elem = output_bytes(schedule.dtype)
        comm = [
            self.comm_time(schedule.collective, st.nccl_max_ctas, (c1 - c0) * elem)
            for c0, c1 in (plan.chunk_range(g) for g in range(plan.num_groups))
        ]
        ends_of_groups = unit_ready_fractions(
            plan, st.tile, [u - 1 for u in itertools.accumulate(plan.group_units)]
        )
        inter = self.model.interference(schedule.collective, st.sms_free, st.nccl_max_ctas)
        gemm_ms = t0
        for _ in range(FIXED_POINT_ROUNDS):
            ready = [f * gemm_ms for f in ends_of_groups]
            starts, ends = _recurrence(ready, comm, gemm_ms, inter)
            busy = sum(max(0.0, min(e, gemm_ms) - s) for s, e in zip(starts, ends, strict=True))
            frac = min(1.0, busy / gemm_ms) if gemm_ms > 0 else 0.0
            gemm_ms = t0 * (1 + (inter.gemm_slowdown - 1) * frac)
        ready = [f * gemm_ms for f in ends_of_groups]
        starts, ends = _recurrence(ready, comm, gemm_ms, inter)
        restore = 0.0
        if st.layout == "tile_major":
            rows = m if schedule.collective == "all_reduce" else plan.rows_per_shard
            restore = 2 * rows * n * elem / (RESTORE_GBS * 1e6)
        device = max(ends[-1], gemm_ms) + restore
        host = self.host_ms(st, plan.num_groups)
        return Prediction(
            total_ms=max(device, host),
            device_ms=device,
            host_ms=host,
            gemm_alone_ms=t0,
            gemm_ms=gemm_ms,
            engine="triton",
            restore_ms=restore,
            group_ready_ms=tuple(ready),
            group_start_ms=tuple(starts),
            group_end_ms=tuple(ends),
            group_comm_ms=tuple(comm),
            exposed_comm_ms=max(0.0, ends[-1] - gemm_ms),
            interference=inter,
            gemm_source=source,
        )

    def _cut_durations(self, schedule: Schedule, plan: Plan, cuts: Sequence[int], n: int) -> Any:
        """The (cuts x cuts) array of each group's collective alone, ``[i, j]`` for the units
        [cut i, cut j) (i < j; the rest unread), the curve read once for all of them."""
        import numpy as np

        st = schedule.settings
        assert isinstance(st, TritonSettings)
        per = plan.shards * output_bytes(schedule.dtype)
        per *= plan.block_m * plan.block_n if plan.layout == "tile_major" else n
        pos = np.asarray(_cut_positions(plan, cuts), dtype=np.int64)
        spans = np.maximum(pos[None, :] - pos[:, None], 0)
        return self.model.curves.times(schedule.collective, st.nccl_max_ctas, spans * per)

    def lower_bound(
        self, task: Any, tile: Tile, sms_free: int, cap: int, unit_tiles: int, layout: str, wait_mode: str
    ) -> float:
        """A time no grouping of this config beats on ``task``'s shape: the GEMM alone on its grid,
        then at least one signal unit's collective (the last group holds the last unit, ready when
        the GEMM ends), then the restore; and no less than one group's host time."""
        m, n, k = task.m, task.n, task.k
        shards = task.shards
        rows = m // shards
        tiles = shards * cdiv(rows, tile.block_m) * cdiv(n, tile.block_n)
        grid = min(max(1, self.model.sm_count - sms_free), tiles)
        t0, _ = self.model.tile_profile.time(tile, m, n, k, grid)
        elem = output_bytes(task.dtype)
        unit_bytes = min(unit_tiles * tile.block_m * tile.block_n, shards * rows * n) * elem
        tail = COMM_ISSUE_GAP_MS + self.comm_time(task.collective, cap, unit_bytes)
        restore = 0.0
        if layout == "tile_major":
            restore = 2 * (m if task.collective == "all_reduce" else rows) * n * elem / (RESTORE_GBS * 1e6)
        h = self.host
        spin = h["host_spin_extra_ms"] if wait_mode == "spin" else 0.0
        host = (
            h["host_launch_ms"] + h["host_per_group_ms"] + spin + (h["host_restore_ms"] if restore else 0.0)
        )
        return max(t0 + tail + restore, host)

    def best_grouping(
        self, schedule: Schedule, m: int, n: int, k: int, *, max_groups: int
    ) -> tuple[int, ...]:
        """The composition of signal units into at most ``max_groups`` groups with the earliest
        predicted end (dynamic program over cut positions); the schedule's groups are ignored.

        A group's end depends only on its ready time and the previous group's end, and never
        decreases with either; so for each group count the earliest end over prefixes is optimal,
        and each count's grouping is priced by ``predict`` (host cost per group, slowdown scaled by
        the overlapped fraction) to choose the count. One approximation remains: inside the DP the
        GEMM's duration is fixed at alone x its full slowdown, so the result can trail the best
        composition ``predict`` would find (tests/test_search.py bounds it at 1% on suite shapes).
        ``row_band`` cuts are allowed only where a band of tile rows starts.
        """
        st = schedule.settings
        assert isinstance(st, TritonSettings)
        plan = self.plan(with_groups(schedule, (num_units(schedule, m, n),)), m, n, k)
        units = plan.num_units
        t0, _ = self.model.tile_profile.time(st.tile, m, n, k, plan.grid)
        inter = self.model.interference(schedule.collective, st.sms_free, st.nccl_max_ctas)
        gemm_ms = t0 * (inter.gemm_slowdown if inter.concurrent else 1.0)
        cuts = _allowed_cuts(plan, st, units)
        # each group's ready time and collective, priced once for every group count
        ready = [0.0, *(f * gemm_ms for f in unit_ready_fractions(plan, st.tile, [c - 1 for c in cuts[1:]]))]
        dur = self._cut_durations(schedule, plan, cuts, n)
        ends, back = _grouping_dp(ready, dur, gemm_ms, inter, max_groups)
        last = len(cuts) - 1

        def sizes_for(g: int) -> tuple[int, ...]:
            sizes: list[int] = []
            j = last
            while g > 0:
                i = back[g][j]
                sizes.append(cuts[j] - cuts[i])
                j, g = i, g - 1
            return tuple(reversed(sizes))

        # the DP's best grouping per group count, priced by predict() itself (which also scales the
        # GEMM's slowdown by how much of it overlaps and adds the host cost per group)
        options = [sizes_for(g) for g in range(1, max_groups + 1) if ends[g] < math.inf]
        priced = [
            (self.predict(with_groups(schedule, sizes), m, n, k).total_ms, len(sizes), sizes)
            for sizes in options
        ]
        return min(priced)[2]


class _BandStarts(Sequence[int]):
    """The signal units a ``row_band`` group may start at, in order, without listing them: ``u``
    in [0, units) whose first local tile ``(u * U) // S`` starts a band of ``band`` local tiles,
    then ``units`` itself. That holds when ``u * U mod (S * band) < S``, which repeats every
    ``period`` units at a few residues (the ``u * U = c * gcd(U, S * band)`` with ``c * gcd < S``,
    at most S of them), so the i-th start and the count are closed forms: a huge M's plan has
    millions of units."""

    def __init__(self, units: int, unit_tiles: int, shards: int, band: int) -> None:
        span = shards * band
        common = math.gcd(unit_tiles, span)
        self.period = span // common
        inverse = pow(unit_tiles // common, -1, self.period)
        counts = min(self.period, cdiv(shards, common))
        self.residues = sorted({c * inverse % self.period for c in range(counts)})
        self.units = units
        whole, rest = divmod(units, self.period)
        self.starts = whole * len(self.residues) + sum(1 for r in self.residues if r < rest)

    def __len__(self) -> int:
        return self.starts + 1

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        if not 0 <= i <= self.starts:
            raise IndexError(i)
        if i == self.starts:
            return self.units
        period, at = divmod(i, len(self.residues))
        return period * self.period + self.residues[at]


def _allowed_cuts(plan: Plan, st: TritonSettings, units: int) -> list[int]:
    """Unit indices a group may start at (row_band: a band's first unit), thinned to DP_MAX_UNITS
    evenly by index. The positions are closed forms (``_BandStarts``; tile_major: every unit), so
    this costs the same for any M."""
    cuts: Sequence[int] = range(units + 1)
    if plan.layout != "tile_major":
        cuts = _BandStarts(units, plan.unit_tiles, plan.shards, st.tile.group_m * plan.tiles_n)
    if len(cuts) > DP_MAX_UNITS:
        step = len(cuts) / DP_MAX_UNITS
        return sorted({cuts[int(i * step)] for i in range(DP_MAX_UNITS)} | {0, units})
    return list(cuts)


def _cut_positions(plan: Plan, cuts: Sequence[int]) -> list[int]:
    """Where each cut falls in the group chunks' layout units (local tiles for tile_major, shard
    rows for row_band): the chunk of units [cuts[i], cuts[j]) is ``shards * (pos[j] - pos[i])``
    of them."""
    out = []
    for u in cuts:
        local = min(u * plan.unit_tiles, plan.num_tiles) // plan.shards
        if plan.layout != "tile_major":
            local = min((local // plan.tiles_n) * plan.block_m, plan.rows_per_shard)
        out.append(local)
    return out


def _grouping_dp(
    ready: Sequence[float], dur: Any, gemm_ms: float, inter: Interference, max_groups: int
) -> tuple[list[float], list[list[int]]]:
    """(ends, back): ``ends[g]`` the earliest end of ``g`` groups covering every unit (inf: none),
    ``back[g][j]`` the cut before the last of ``g`` groups ending at cut ``j`` (-1: none). One
    array step per group count over every (previous cut i, cut j) pair, ``dur[i, j]`` the
    collective of units [cut i, cut j); the same arithmetic as ``_group_end`` element by element,
    and the earliest i wins a tie, as a loop over i in order that keeps only a strictly earlier
    end."""
    import numpy as np

    count = len(ready)
    # a pair i >= j is no group: an infinite collective ends at inf in every branch below
    dur = np.where(np.triu(np.ones((count, count), dtype=bool), k=1), dur, np.inf)
    stretched = dur * inter.comm_slowdown
    ready_j = np.asarray(ready, dtype=np.float64)
    before = np.full(count, np.inf)
    before[0] = 0.0
    ends = [math.inf] * (max_groups + 1)
    back = [[-1] * count for _ in range(max_groups + 1)]
    for g in range(1, max_groups + 1):
        # the cuts g - 1 groups reach are a run [lo, hi) (any cut after a reached one is reached
        # next), and only the cuts after lo can end a group
        reached = np.flatnonzero(np.isfinite(before))
        if not reached.size or reached[0] + 1 >= count:
            break
        lo, hi = int(reached[0]), int(reached[-1]) + 1
        start = np.maximum(ready_j[None, lo + 1 :], before[lo:hi, None]) + COMM_ISSUE_GAP_MS
        d = dur[lo:hi, lo + 1 :]
        if inter.concurrent:
            progress = (gemm_ms - start) / inter.comm_slowdown
            during = np.where(progress >= d, start + stretched[lo:hi, lo + 1 :], gemm_ms + (d - progress))
        else:
            during = gemm_ms + d
        end = np.where(start >= gemm_ms, start + d, during)
        arg = end.argmin(axis=0)
        before = np.full(count, np.inf)
        before[lo + 1 :] = end[arg, np.arange(count - lo - 1)]
        back[g][lo + 1 :] = np.where(np.isfinite(before[lo + 1 :]), arg + lo, -1).tolist()
        ends[g] = float(before[-1])
    return ends, back


def _group_end(start: float, dur: float, gemm_end: float, inter: Interference) -> float:
    """End of a collective of ``dur`` ms (alone) started at ``start``: slowed while the GEMM runs,
    and held until the GEMM ends when the two cannot run together."""
    start += COMM_ISSUE_GAP_MS
    if start >= gemm_end:
        return start + dur
    if not inter.concurrent:
        return gemm_end + dur
    progress = (gemm_end - start) / inter.comm_slowdown
    if progress >= dur:
        return start + dur * inter.comm_slowdown
    return gemm_end + (dur - progress)


def _recurrence(
    ready: Sequence[float], comm: Sequence[float], gemm_end: float, inter: Interference
) -> tuple[list[float], list[float]]:
    starts, ends = [], []
    prev = 0.0
    for r, d in zip(ready, comm, strict=True):
        s = max(r, prev)
        e = _group_end(s, d, gemm_end, inter)
        starts.append(s)
        ends.append(e)
        prev = e
    return starts, ends
