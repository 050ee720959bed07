"""The cost model: the predicted latency of a schedule on one machine, read from its calibration.

For an overlapped schedule and a shape (``predict``), with the plan of ``fo_kernels.plan``:

1. GEMM alone, ``T0``: the calibration's measured time when it profiled this (shape, tile, grid);
   else the tile's wave model ``a + c * waves * K`` (least squares over every profiled point of
   that tile; ``waves = ceil(tiles / grid)``), which fits the H200 profile within ~10%.
2. Unit ``u`` is ready when the wave holding its last tile ends: ``ready_u = T * (w_u + 1) / W``
   (program p runs tiles p, p + G, ...; ``W`` waves; ``T`` the GEMM time under contention).
3. Group ``g``'s collective: its chunk's bytes on the bandwidth curve of (collective, CTA cap),
   interpolated between measured sizes (latency floor below, the fit beyond). It starts at
   ``max(ready_g, end_{g-1}) + COMM_ISSUE_GAP_MS`` and, while the GEMM still runs, progresses
   ``1 / comm_slowdown`` as fast (interference table). Where the calibration saw NCCL *not* run
   beside the GEMM for these free SMs and this cap (too few SMs free), it starts after the GEMM.
4. The GEMM slows by ``1 + (gemm_slowdown - 1) * f``, ``f`` the fraction of it that overlaps a
   collective; steps 2-4 are iterated to a fixed point (``FIXED_POINT_ROUNDS``).
5. ``tile_major`` adds the restore (read + write of the output at ``RESTORE_GBS``).
6. Device time ``max(last collective end, GEMM end) + restore``; the call costs at least the host
   time to issue it (``host_ms``): back-to-back calls, as ``time_region`` measures them, run at
   ``max(device, host)``.

This is FlashOverlap's pipeline recurrence (group g's collective starts when the group is ready
and the previous one is done), corrected by the interference table. ``sequential`` predicts the
baseline (cuBLAS, then one collective on NCCL's default communicator); ``best_grouping`` is the
dynamic program over signal units that minimises the recurrence's end time for a fixed config.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from fo_kernels.plan import Plan, cdiv, make_plan
from fo_kernels.schedule import Schedule, Tile

from .calibration import BandwidthPoint, Calibration, CalibrationError, GemmPoint, InterferencePoint

# Host cost of one overlapped call, measured on H200 x2: Triton launch of the persistent GEMM
# 0.086 ms, each torch.distributed call 0.044 ms, each stream wait 0.01 ms (docs/design.md#host-time).
HOST_GEMM_LAUNCH_MS = 0.086
HOST_COLLECTIVE_CALL_MS = 0.044
HOST_WAIT_MS = 0.010
# The spin wait is a one-program Triton launch instead of a stream memory op (Triton launch cost).
HOST_SPIN_WAIT_MS = 0.03
# The restore kernel's launch (a Triton launch, as above, minus the persistent GEMM's larger arg list).
HOST_RESTORE_LAUNCH_MS = 0.03
# Host cost of the sequential baseline: one cuBLAS launch and one collective call (torch eager).
HOST_SEQUENTIAL_MS = 0.06
# From a group's counter completing to its collective's first NCCL kernel running: the stream wait
# resolves and the high-priority stream's kernel is scheduled (a few microseconds on Hopper).
COMM_ISSUE_GAP_MS = 0.005
# Read + write rate of the tile-major restore. Not calibrated: an H200 moves ~3 TB/s in a device
# copy (HBM3e 4.8 TB/s peak); the restore is a few percent of the suite's GEMM times either way.
RESTORE_GBS = 3000.0
# Fixed-point rounds of the GEMM-slowdown / overlap-fraction loop (it settles in 2-3).
FIXED_POINT_ROUNDS = 4
# DP over at most this many signal units (beyond it, candidate cuts are thinned evenly).
DP_MAX_UNITS = 256

_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def element_bytes(dtype: str) -> int:
    return _ELEM_BYTES[dtype]


@dataclass(frozen=True, slots=True)
class Interference:
    """How the collective and the GEMM affect each other at (sms_free, cap)."""

    concurrent: bool  # the collective ran beside the GEMM at all
    comm_slowdown: float
    gemm_slowdown: float
    matched: str  # "exact" or the nearest calibrated (sms_free, cap) used


@dataclass(frozen=True, slots=True)
class Prediction:
    """The model's view of one call (milliseconds)."""

    total_ms: float
    device_ms: float
    host_ms: float
    gemm_alone_ms: float
    gemm_ms: float  # under contention
    restore_ms: float
    group_ready_ms: tuple[float, ...]
    group_start_ms: tuple[float, ...]
    group_end_ms: tuple[float, ...]
    group_comm_ms: tuple[float, ...]  # each group's collective alone
    exposed_comm_ms: float  # comm time after the GEMM ended
    interference: Interference | None
    gemm_source: str  # "measured" (profiled point) or "wave-model"


@dataclass(frozen=True, slots=True)
class Baseline:
    """GEMM then collective, predicted."""

    gemm_ms: float
    comm_ms: float
    sequential_ms: float  # max(gemm + comm, host)


@dataclass(frozen=True, slots=True)
class _WaveFit:
    a_ms: float  # fixed cost
    c_ms: float  # per wave per unit of K


def _waves(m: int, n: int, tile: Tile, grid: int) -> int:
    return cdiv(cdiv(m, tile.block_m) * cdiv(n, tile.block_n), max(1, grid))


def _point_tile(p: GemmPoint) -> Tile:
    """The tile config a profiled point measured (its fields of ``Tile``, by name)."""
    return Tile(**{f.name: getattr(p, f.name) for f in fields(Tile)})


class CostModel:
    """Predictions for one calibration (see the module docstring)."""

    def __init__(self, cal: Calibration) -> None:
        self.cal = cal
        self.sm_count = cal.fingerprint.sm_count
        self.world_size = cal.world_size
        self._points: dict[tuple, GemmPoint] = {}  # (m, n, k, tile, grid); a Tile is its own key
        by_tile: dict[Tile, list[GemmPoint]] = {}
        self._cublas: dict[tuple[int, int, int], float] = {}
        for p in cal.gemm:
            if p.status != "ok" or not p.time_ms > 0:
                continue
            key = _point_tile(p)
            self._points[(p.m, p.n, p.k, key, p.grid)] = p
            by_tile.setdefault(key, []).append(p)
            if p.cublas_ms > 0:
                self._cublas[(p.m, p.n, p.k)] = p.cublas_ms
        self._fits = {key: self._fit_waves(pts) for key, pts in by_tile.items()}
        self._curves: dict[tuple[str, int], list[BandwidthPoint]] = {}
        for b in cal.bandwidth:
            self._curves.setdefault((b.collective, b.nccl_max_ctas), []).append(b)
        for pts in self._curves.values():
            pts.sort(key=lambda b: b.size_bytes)
        self._interference: dict[str, list[InterferencePoint]] = {}
        for q in cal.interference:
            self._interference.setdefault(q.collective, []).append(q)

    # ------------------------------------------------------------------------------ GEMM
    def tiles(self) -> list[Tile]:
        """Tile configs the calibration profiled (the only ones the model can predict)."""
        return list(self._fits)

    def knows_tile(self, tile: Tile) -> bool:
        return tile in self._fits

    def knows_collective(self, collective: str) -> bool:
        """The calibration has a bandwidth curve for ``collective``."""
        return any(name == collective for name, _ in self._curves)

    @staticmethod
    def _fit_waves(points: Sequence[GemmPoint]) -> _WaveFit:
        xs = [_waves(p.m, p.n, _point_tile(p), p.grid) * p.k for p in points]
        ys = [p.time_ms for p in points]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else my / mx
        if c <= 0:  # one shape only, or noise: proportional through the origin
            c, a = my / mx, 0.0
        else:
            a = max(0.0, my - c * mx)
        return _WaveFit(a, c)

    def gemm_time(self, tile: Tile, m: int, n: int, k: int, grid: int) -> tuple[float, str]:
        """(ms, source) of the signalled GEMM alone on ``grid`` programs."""
        if tile not in self._fits:
            raise CalibrationError(
                f"the calibration has no GEMM profile for tile {tile}; profile it with "
                "`fo-tune calibrate` (or `fo-tune profile`), or search in --mode measure"
            )
        point = self._points.get((m, n, k, tile, grid))
        if point is not None:
            return point.time_ms, "measured"
        return self.wave_model_time(tile, m, n, k, grid), "wave-model"

    def wave_model_time(self, tile: Tile, m: int, n: int, k: int, grid: int) -> float:
        """The tile's fitted ``a + c * waves * K`` (ms), ignoring any profiled point."""
        fit = self._fits[tile]
        return fit.a_ms + fit.c_ms * _waves(m, n, tile, grid) * k

    def cublas_time(self, m: int, n: int, k: int) -> float:
        """cuBLAS (the sequential baseline's GEMM): measured, else the nearest profiled shape's rate."""
        if (m, n, k) in self._cublas:
            return self._cublas[(m, n, k)]
        if not self._cublas:
            raise CalibrationError("the calibration has no GEMM profile; re-run `fo-tune calibrate`")
        flops = m * n * k
        near = min(self._cublas, key=lambda s: abs(math.log(s[0] * s[1] * s[2] / flops)))
        return self._cublas[near] * flops / (near[0] * near[1] * near[2])

    # ------------------------------------------------------------------------------ collectives
    def _curve(self, collective: str, cap: int) -> list[BandwidthPoint]:
        caps = sorted(c for (name, c) in self._curves if name == collective)
        if not caps:
            raise CalibrationError(
                f"the calibration has no bandwidth curve for {collective}; "
                f"re-run `fo-tune calibrate --collectives {collective}`"
            )
        use = cap if cap in caps else min(caps, key=lambda c: (abs(c - cap), c))
        return self._curves[(collective, use)]

    def comm_time(self, collective: str, cap: int, nbytes: int) -> float:
        """The collective alone on ``nbytes`` (nccl-tests sizing), interpolated on the curve."""
        pts = self._curve(collective, cap)
        sizes = [p.size_bytes for p in pts]
        if nbytes <= sizes[0]:
            return pts[0].time_ms
        i = bisect.bisect_left(sizes, nbytes)
        if i < len(pts):
            lo, hi = pts[i - 1], pts[i]
            frac = (nbytes - lo.size_bytes) / (hi.size_bytes - lo.size_bytes)
            return lo.time_ms + frac * (hi.time_ms - lo.time_ms)
        last = pts[-1]
        fit = self.cal.fit_for(collective, last.nccl_max_ctas)
        bw = fit.bandwidth_gbs if fit is not None and fit.bandwidth_gbs > 0 else last.algbw_gbs
        return last.time_ms + (nbytes - last.size_bytes) / (bw * 1e6)

    def interference(self, collective: str, sms_free: int, cap: int) -> Interference:
        """Nearest calibrated (sms_free - cap, cap); cap 0 (NCCL's default) counts as the largest
        calibrated cap. No interference data at all: the two never ran together (CPU calibration)."""
        pts = self._interference.get(collective) or [q for qs in self._interference.values() for q in qs]
        if not pts:
            return Interference(False, 1.0, 1.0, "none calibrated")
        caps = sorted({q.nccl_max_ctas for q in pts})
        eff = cap if cap > 0 else caps[-1]
        exact = [q for q in pts if (q.sms_free, q.nccl_max_ctas) == (sms_free, eff)]
        if exact:
            chosen, matched = exact, "exact"
        else:

            def dist(q: InterferencePoint) -> tuple[float, float]:
                return (abs((q.sms_free - q.nccl_max_ctas) - (sms_free - eff)), abs(q.nccl_max_ctas - eff))

            best = min(dist(q) for q in pts)
            chosen = [q for q in pts if dist(q) == best]
            matched = f"nearest r={chosen[0].sms_free} cap={chosen[0].nccl_max_ctas}"
        concurrent = all(q.concurrent for q in chosen) and 2 * sum(q.comm_during_gemm for q in chosen) > len(
            chosen
        )
        during = [q for q in chosen if q.comm_during_gemm] or chosen
        comm = sum(max(1.0, q.comm_slowdown) for q in during) / len(during)
        gemm = sum(max(1.0, q.gemm_slowdown) for q in during) / len(during)
        return Interference(concurrent, comm, gemm, matched)

    # ------------------------------------------------------------------------------ predictions
    def sequential(self, collective: str, m: int, n: int, k: int, dtype: str) -> Baseline:
        gemm = self.cublas_time(m, n, k)
        comm = self.comm_time(collective, 0, m * n * element_bytes(dtype))
        return Baseline(gemm, comm, max(gemm + comm, HOST_SEQUENTIAL_MS))

    def plan(self, schedule: Schedule, m: int, n: int, k: int) -> Plan:
        return make_plan(schedule, m, n, k, sm_count=self.sm_count)

    def host_ms(self, schedule: Schedule, groups: int) -> float:
        wait = HOST_SPIN_WAIT_MS if schedule.wait_mode == "spin" else HOST_WAIT_MS
        restore = HOST_RESTORE_LAUNCH_MS if schedule.layout == "tile_major" else 0.0
        return HOST_GEMM_LAUNCH_MS + groups * (HOST_COLLECTIVE_CALL_MS + wait) + restore

    def unit_ready_fractions(self, plan: Plan) -> list[float]:
        """Per signal unit: when it is complete, as a fraction of the GEMM's duration."""
        waves = cdiv(plan.num_tiles, plan.grid)
        out = []
        for u in range(plan.num_units):
            last = min((u + 1) * plan.unit_tiles, plan.num_tiles) - 1
            out.append((last // plan.grid + 1) / waves)
        return out

    def predict(self, schedule: Schedule, m: int, n: int, k: int) -> Prediction:
        """Predicted latency of ``schedule`` on (m, n, k); raises ``ScheduleError`` if infeasible."""
        if not schedule.overlap:
            base = self.sequential(schedule.collective, m, n, k, schedule.dtype)
            return Prediction(
                total_ms=base.sequential_ms,
                device_ms=base.gemm_ms + base.comm_ms,
                host_ms=HOST_SEQUENTIAL_MS,
                gemm_alone_ms=base.gemm_ms,
                gemm_ms=base.gemm_ms,
                restore_ms=0.0,
                group_ready_ms=(base.gemm_ms,),
                group_start_ms=(base.gemm_ms,),
                group_end_ms=(base.gemm_ms + base.comm_ms,),
                group_comm_ms=(base.comm_ms,),
                exposed_comm_ms=base.comm_ms,
                interference=None,
                gemm_source="cublas",
            )
        plan = self.plan(schedule, m, n, k)
        assert schedule.tile is not None
        t0, source = self.gemm_time(schedule.tile, m, n, k, plan.grid)
        elem = element_bytes(schedule.dtype)
        comm = [
            self.comm_time(schedule.collective, schedule.nccl_max_ctas, (c1 - c0) * elem)
            for c0, c1 in (plan.chunk_range(g) for g in range(plan.num_groups))
        ]
        fractions = self.unit_ready_fractions(plan)
        ends_of_groups = []
        u = 0
        for size in plan.group_units:
            u += size
            ends_of_groups.append(fractions[u - 1])
        inter = self.interference(schedule.collective, schedule.sms_free, schedule.nccl_max_ctas)
        gemm_ms = t0
        starts: list[float] = []
        ends: list[float] = []
        for _ in range(FIXED_POINT_ROUNDS):
            ready = [f * gemm_ms for f in ends_of_groups]
            starts, ends = _recurrence(ready, comm, gemm_ms, inter)
            busy = sum(max(0.0, min(e, gemm_ms) - s) for s, e in zip(starts, ends, strict=True))
            frac = min(1.0, busy / gemm_ms) if gemm_ms > 0 else 0.0
            gemm_ms = t0 * (1 + (inter.gemm_slowdown - 1) * frac)
        ready = [f * gemm_ms for f in ends_of_groups]
        starts, ends = _recurrence(ready, comm, gemm_ms, inter)
        restore = 0.0
        if schedule.layout == "tile_major":
            rows = m if schedule.collective == "all_reduce" else plan.rows_per_shard
            restore = 2 * rows * n * elem / (RESTORE_GBS * 1e6)
        device = max(ends[-1], gemm_ms) + restore
        host = self.host_ms(schedule, plan.num_groups)
        return Prediction(
            total_ms=max(device, host),
            device_ms=device,
            host_ms=host,
            gemm_alone_ms=t0,
            gemm_ms=gemm_ms,
            restore_ms=restore,
            group_ready_ms=tuple(ready),
            group_start_ms=tuple(starts),
            group_end_ms=tuple(ends),
            group_comm_ms=tuple(comm),
            exposed_comm_ms=max(0.0, ends[-1] - gemm_ms),
            interference=inter,
            gemm_source=source,
        )

    def best_grouping(
        self, schedule: Schedule, m: int, n: int, k: int, *, max_groups: int
    ) -> tuple[int, ...]:
        """The composition of signal units into at most ``max_groups`` groups with the earliest
        predicted end (dynamic program over cut positions); ``schedule.groups`` is ignored.

        A group's end depends only on its ready time and the previous group's end, and never
        decreases with either; so for each group count the earliest end over prefixes is optimal,
        and each count's grouping is priced by ``predict`` (host cost per group, slowdown scaled by
        the overlapped fraction) to choose the count. One approximation remains: inside the DP the
        GEMM's duration is fixed at alone x its full slowdown, so the result can trail the best
        composition ``predict`` would find (tests/test_search.py bounds it at 1% on suite shapes).
        ``row_band`` cuts are allowed only where a band of tile rows starts.
        """
        assert schedule.tile is not None
        plan = self.plan(with_groups(schedule, (num_units(schedule, m, n),)), m, n, k)
        units = plan.num_units
        t0, _ = self.gemm_time(schedule.tile, m, n, k, plan.grid)
        inter = self.interference(schedule.collective, schedule.sms_free, schedule.nccl_max_ctas)
        gemm_ms = t0 * (inter.gemm_slowdown if inter.concurrent else 1.0)
        fractions = self.unit_ready_fractions(plan)
        elem = element_bytes(schedule.dtype)
        shards = plan.shards
        span = plan.block_m * plan.block_n if plan.layout == "tile_major" else 0
        band = schedule.tile.group_m * plan.tiles_n

        def start_tile(u: int) -> int:
            return min(u * plan.unit_tiles, plan.num_tiles)

        def allowed(u: int) -> bool:
            if u in (0, units) or plan.layout == "tile_major":
                return True
            local = start_tile(u) // shards
            return local % band == 0

        cuts = [u for u in range(units + 1) if allowed(u)]
        if len(cuts) > DP_MAX_UNITS:
            step = len(cuts) / DP_MAX_UNITS
            keep = {cuts[int(i * step)] for i in range(DP_MAX_UNITS)} | {0, units}
            cuts = sorted(keep)

        def chunk_bytes(u0: int, u1: int) -> int:
            l0, l1 = start_tile(u0) // shards, start_tile(u1) // shards
            if plan.layout == "tile_major":
                return shards * (l1 - l0) * span * elem
            rows0 = min((l0 // plan.tiles_n) * plan.block_m, plan.rows_per_shard)
            rows1 = min((l1 // plan.tiles_n) * plan.block_m, plan.rows_per_shard)
            return shards * (rows1 - rows0) * n * elem

        index = {u: i for i, u in enumerate(cuts)}
        inf = math.inf
        # best[g][i]: earliest end of g groups covering units [0, cuts[i]); back[g][i]: previous cut
        best = [[inf] * len(cuts) for _ in range(max_groups + 1)]
        back = [[-1] * len(cuts) for _ in range(max_groups + 1)]
        best[0][0] = 0.0
        for g in range(1, max_groups + 1):
            for j in range(1, len(cuts)):
                ready = fractions[cuts[j] - 1] * gemm_ms
                for i in range(j):
                    prev = best[g - 1][i]
                    if prev == inf:
                        continue
                    dur = self.comm_time(
                        schedule.collective, schedule.nccl_max_ctas, chunk_bytes(cuts[i], cuts[j])
                    )
                    end = _group_end(max(ready, prev), dur, gemm_ms, inter)
                    if end < best[g][j]:
                        best[g][j], back[g][j] = end, i
        last = index[units]

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
        options = [sizes_for(g) for g in range(1, max_groups + 1) if best[g][last] < inf]
        priced = [
            (self.predict(with_groups(schedule, sizes), m, n, k).total_ms, len(sizes), sizes)
            for sizes in options
        ]
        return min(priced)[2]


def num_units(schedule: Schedule, m: int, n: int) -> int:
    """Signal units of ``schedule`` on an (m, n) output (``Plan.num_units`` without a plan)."""
    tile = schedule.tile
    assert tile is not None
    shards = schedule.world_size if schedule.collective == "reduce_scatter" else 1
    tiles = shards * cdiv(m // shards, tile.block_m) * cdiv(n, tile.block_n)
    return cdiv(tiles, schedule.signal_tiles)


def with_groups(schedule: Schedule, groups: Sequence[int]) -> Schedule:
    return dataclasses.replace(schedule, groups=tuple(groups))


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
