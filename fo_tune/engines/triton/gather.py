"""The Triton engine's cost-model term for all_gather (AllGather + GEMM, the column-parallel direction).

Unvalidated: no all_gather was ever measured on GPUs, so no prediction below has been compared
with a measurement (``fo-tune model check`` reports measured rows and trials only, and there are
none). The pieces are the calibration's measurements of other calls, applied to this one's.

The runtime (``fo_kernels.engines.triton.executor``) runs the reverse pipeline of GEMM + collective: group g
is rows [i0, i1) of every rank's shard (whole bands of tile rows, ``row_band``); the communication
stream gathers each group's rows with one NCCL all_gather, records an event and copies the chunk
into the gathered A; the caller's stream waits for group g's event and runs its chunk GEMMs, w
launches of the persistent Triton GEMM over (i1 - i0) x N x K. For a schedule and the gathered
(M, N, K), with the plan of ``fo_kernels.plan`` (S = w shards of Ms = M / w rows)::

    gather(g) = the all_gather curve of the schedule's CTA cap at w (i1 - i0) K elements
    copy(g)   = read + write of those bytes at RESTORE_GBS (the chunk into the gathered A)
    gemm(g)   = sum over the w launches of the tile profile's time for (i1 - i0) x N x K on the
                plan's grid (the measured point, else the tile's wave model: its fixed cost is
                paid per launch), x the GEMM's slowdown
    issue(g)  = gather_end(g - 1) + copy(g - 1);  gather_end(0) = COMM_ISSUE_GAP_MS + gather(0):
                the first gather is exposed, nothing can be computed before it lands
    gather_end(g) = a gather beside running GEMMs progresses 1 / comm_slowdown as fast; where the
                calibration saw NCCL not run beside the GEMM at these free SMs and this cap, it
                waits for the GEMMs issued before it to end (``fo_tune.engines.triton.model._group_end``)
    gemm_end(g) = max(gemm_end(g - 1), gather_end(g)) + gemm(g)
    device    = max(last gemm_end, last copy end)
    exposed   = the time the GEMMs wait for gathers (the first gather's at least)

The GEMMs' slowdown is ``1 + (gemm_slowdown - 1) * f``, f the fraction of GEMM time beside a
gather, iterated to a fixed point. The interference table is all_gather's where the calibration
measured it, else every other collective's points (its ``matched`` says so). Host time of an eager
call, from the calibration's ``triton`` section (measured and fitted on the other collectives'
calls): ``host_launch_ms`` once (a call with its first GEMM launch), ``host_per_group_ms`` per
gather (a torch.distributed call and its stream ordering) and ``host_spin_extra_ms`` for each
further chunk GEMM launch (what one more Triton launch costs the host: the spin wait's kernel);
a call costs ``max(device, host)``.

``best_grouping`` is a dynamic program over cut positions whose state is the pair (when the
communication stream is free, when the GEMMs end), keeping each prefix's Pareto front (thinned to
``FRONT``), with the GEMMs' slowdown fixed at its full value; each group count's best is then
priced by ``predict``. ``TritonCollectivesTerm`` (what the Triton plug-in makes) prices all_gather
schedules here and every other collective's with ``fo_tune.engines.triton.model.TritonTerm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.plan import Plan, cdiv
from fo_kernels.schedule import Schedule
from fo_kernels.tile import Tile
from fo_tune.engines.triton.model import (
    COMM_ISSUE_GAP_MS,
    FIXED_POINT_ROUNDS,
    RESTORE_GBS,
    TritonTerm,
    _group_end,
    num_units,
    with_groups,
)
from fo_tune.model.types import Interference, Prediction, element_bytes

COLLECTIVE = "all_gather"
# Pareto states kept per (group count, cut) in best_grouping: the front is a handful of states on
# the suite's shapes; thinning it bounds the DP's cost at FRONT x a scalar DP's.
FRONT = 4
# Cut positions the DP considers (beyond it, thinned evenly): its state is a front, not one time.
DP_MAX_CUTS = 32


def _row_of(plan: Plan, u: int) -> int:
    """The first shard row of signal unit ``u`` (every cut falls on a band of tile rows)."""
    local = min(u * plan.unit_tiles, plan.num_tiles) // plan.shards
    return min((local // plan.tiles_n) * plan.block_m, plan.rows_per_shard)


class GatherPieces:
    """The alone times of one config's gathers, copies and chunk GEMMs (cached by rows)."""

    def __init__(self, term: TritonTerm, schedule: Schedule, plan: Plan, n: int, k: int) -> None:
        st = schedule.settings
        assert isinstance(st, TritonSettings)
        self.term, self.st, self.plan, self.n, self.k = term, st, plan, n, k
        self.elem = element_bytes(schedule.dtype)
        self._gemm: dict[int, float] = {}
        self.sources: set[str] = set()

    def gather(self, rows: int) -> float:
        nbytes = self.plan.shards * rows * self.k * self.elem
        return self.term.comm_time(COLLECTIVE, self.st.nccl_max_ctas, nbytes) if rows else 0.0

    def copy(self, rows: int) -> float:
        return 2 * self.plan.shards * rows * self.k * self.elem / (RESTORE_GBS * 1e6)

    def gemm(self, rows: int) -> float:
        """The group's w chunk GEMMs alone (ms)."""
        if rows not in self._gemm:
            t = self.st.tile
            grid = max(1, min(self.plan.grid, cdiv(rows, t.block_m) * cdiv(self.n, t.block_n)))
            profile = self.term.model.tile_profile
            # rows_gemm runs the chunks: no split tail
            ms, source = profile.time(t, rows, self.n, self.k, grid, split=False) if rows else (0.0, "")
            self.sources.add(source)
            self._gemm[rows] = self.plan.shards * ms
        return self._gemm[rows]


def _step(
    comm_free: float, gemm_end: float, rows: int, pieces: GatherPieces, slow: float, inter: Interference
) -> tuple[float, float, float, float]:
    """One group after the previous ones: (gather end, communication stream free, GEMMs end, GEMM
    time beside the gather)."""
    if rows == 0:  # the runtime issues nothing for an empty group
        return comm_free, comm_free, gemm_end, 0.0
    end = _group_end(comm_free, pieces.gather(rows), gemm_end, inter)
    beside = max(0.0, min(end, gemm_end) - (comm_free + COMM_ISSUE_GAP_MS))
    return end, end + pieces.copy(rows), max(gemm_end, end) + pieces.gemm(rows) * slow, beside


@dataclass(frozen=True, slots=True)
class _Line:
    """A pipeline of groups: each group's gather issue and end and its gather alone, when the
    communication stream is free and the GEMMs end, the GEMM time beside gathers and the GEMMs'
    time waiting for them."""

    issue: tuple[float, ...]
    ends: tuple[float, ...]
    comm: tuple[float, ...]
    comm_free: float
    gemm_end: float
    beside: float
    waited: float


def _timeline(rows: list[int], pieces: GatherPieces, slow: float, inter: Interference) -> _Line:
    """The pipeline of groups of ``rows`` shard rows."""
    comm_free = gemm_end = beside = waited = 0.0
    issue, ends, comm = [], [], []
    for r in rows:
        issue.append(comm_free)
        end, comm_free, after, b = _step(comm_free, gemm_end, r, pieces, slow, inter)
        waited += max(0.0, end - gemm_end) if r else 0.0
        gemm_end = after
        ends.append(end)
        comm.append(pieces.gather(r))
        beside += b
    return _Line(tuple(issue), tuple(ends), tuple(comm), comm_free, gemm_end, beside, waited)


def host_ms(term: TritonTerm, groups: int, shards: int) -> float:
    """An eager call's host time with ``groups`` gathers of ``shards`` chunk GEMMs each."""
    h = term.host
    launches = max(1, groups * shards)
    return h["host_launch_ms"] + groups * h["host_per_group_ms"] + (launches - 1) * h["host_spin_extra_ms"]


def predict(term: TritonTerm, schedule: Schedule, m: int, n: int, k: int) -> Prediction:
    """Predicted latency of an all_gather ``schedule`` on the gathered (m, n, k) (module docstring)."""
    st = schedule.settings
    assert isinstance(st, TritonSettings)
    plan = term.plan(schedule, m, n, k)
    pieces = GatherPieces(term, schedule, plan, n, k)
    rows = [i1 - i0 for i0, i1 in plan.group_rows]
    inter = term.model.interference(COLLECTIVE, st.sms_free, st.nccl_max_ctas)
    alone = sum(pieces.gemm(r) for r in rows)
    slow = 1.0
    for _ in range(FIXED_POINT_ROUNDS):
        line = _timeline(rows, pieces, slow, inter)
        busy = alone * slow
        frac = min(1.0, line.beside / busy) if busy > 0 else 0.0
        slow = 1 + (inter.gemm_slowdown - 1) * frac
    line = _timeline(rows, pieces, slow, inter)
    device = max(line.gemm_end, line.comm_free)
    host = host_ms(term, sum(1 for r in rows if r), plan.shards)
    source = "measured" if pieces.sources == {"measured"} else "wave-model"
    return Prediction(
        total_ms=max(device, host),
        device_ms=device,
        host_ms=host,
        gemm_alone_ms=alone,
        gemm_ms=alone * slow,
        engine="triton",
        group_ready_ms=line.issue,
        group_start_ms=line.issue,
        group_end_ms=line.ends,
        group_comm_ms=line.comm,
        exposed_comm_ms=line.waited,
        interference=inter,
        gemm_source=source,
    )


def lower_bound(term: TritonTerm, task: Any, tile: Tile, sms_free: int, cap: int, unit_tiles: int) -> float:
    """A time no grouping of this config beats: the first gather (at least one signal unit's rows)
    then every chunk GEMM (at least the tile's least profiled/wave-model ratio times the wave model
    of one whole shard, w times: the wave model's fixed cost is paid per launch and its waves round
    up per launch); and no less than one group's host time."""
    m, n, k, w = task.m, task.n, task.k, task.shards
    rows = m // w
    profile = term.model.tile_profile
    tiles = w * cdiv(rows, tile.block_m) * cdiv(n, tile.block_n)
    grid = max(1, min(term.model.sm_count - sms_free, tiles))
    gemm = w * profile.wave_floor(tile) * profile.wave_model_time(tile, rows, n, k, grid, split=False)
    unit_rows = min(rows, unit_tiles // w // cdiv(n, tile.block_n) * tile.block_m)
    first = COMM_ISSUE_GAP_MS + term.comm_time(COLLECTIVE, cap, w * unit_rows * k * element_bytes(task.dtype))
    return max(first + gemm, host_ms(term, 1, w))


def best_grouping(
    term: TritonTerm, schedule: Schedule, m: int, n: int, k: int, *, max_groups: int
) -> tuple[int, ...]:
    """The grouping of signal units into at most ``max_groups`` groups with the earliest predicted
    end (module docstring); the schedule's groups are ignored."""
    st = schedule.settings
    assert isinstance(st, TritonSettings)
    plan = term.plan(with_groups(schedule, (num_units(schedule, m, n),)), m, n, k)
    units = plan.num_units
    pieces = GatherPieces(term, schedule, plan, n, k)
    inter = term.model.interference(COLLECTIVE, st.sms_free, st.nccl_max_ctas)
    slow = inter.gemm_slowdown if inter.concurrent else 1.0
    # every unit is a cut, thinned evenly past DP_MAX_CUTS without listing them (a huge M has millions)
    if units + 1 > DP_MAX_CUTS:
        step = (units + 1) / DP_MAX_CUTS
        cuts = sorted({int(i * step) for i in range(DP_MAX_CUTS)} | {0, units})
    else:
        cuts = list(range(units + 1))
    rows_at = [_row_of(plan, u) for u in cuts]
    # fronts[g][j]: (comm free, GEMMs end, previous cut, index in the previous front)
    fronts: list[list[list[tuple[float, float, int, int]]]] = [
        [[] for _ in cuts] for _ in range(max_groups + 1)
    ]
    fronts[0][0] = [(0.0, 0.0, -1, -1)]
    # a group's (gather, copy, GEMMs x slowdown) by its rows, priced once for every state (_step's)
    priced: dict[int, tuple[float, float, float]] = {}
    for g in range(1, max_groups + 1):
        for j in range(1, len(cuts)):
            found = []
            for i in range(j):
                rows = rows_at[j] - rows_at[i]
                front = fronts[g - 1][i]
                if not rows:  # the runtime issues nothing for an empty group
                    found.extend((cf, ge, i, idx) for idx, (cf, ge, _, _) in enumerate(front))
                    continue
                if front and rows not in priced:
                    priced[rows] = (pieces.gather(rows), pieces.copy(rows), pieces.gemm(rows) * slow)
                for idx, (cf, ge, _, _) in enumerate(front):
                    gather, copy, gemm = priced[rows]
                    end = _group_end(cf, gather, ge, inter)
                    found.append((end + copy, max(ge, end) + gemm, i, idx))
            fronts[g][j] = _pareto(found)
    last = len(cuts) - 1

    def sizes_for(g: int) -> tuple[int, ...]:
        _, _, i, idx = min(fronts[g][last], key=lambda s: (max(s[0], s[1]), s[1]))
        sizes, j = [], last
        while g > 0:
            sizes.append(cuts[j] - cuts[i])
            j, g = i, g - 1
            _, _, i, idx = fronts[g][j][idx]
        return tuple(reversed(sizes))

    options = [sizes_for(g) for g in range(1, max_groups + 1) if fronts[g][last]]
    priced = [(predict(term, with_groups(schedule, s), m, n, k).total_ms, len(s), s) for s in options]
    return min(priced)[2] if priced else (units,)


def _pareto(states: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int, int]]:
    """The states no other beats in both times, at most ``FRONT`` (the ones ending first)."""
    front: list[tuple[float, float, int, int]] = []
    best_end = math.inf
    for s in sorted(states, key=lambda s: (s[0], s[1])):
        if s[1] < best_end:
            front.append(s)
            best_end = s[1]
    if len(front) > FRONT:
        front = sorted(front, key=lambda s: max(s[0], s[1]))[:FRONT]
    return front


class TritonCollectivesTerm(TritonTerm):
    """The Triton engine's term for every collective its runtime runs: all_gather by this module's
    pipeline, all_reduce and reduce_scatter by ``TritonTerm``."""

    def predict(self, schedule: Schedule, m: int, n: int, k: int) -> Prediction:
        if schedule.collective == COLLECTIVE:
            return predict(self, schedule, m, n, k)
        return super().predict(schedule, m, n, k)

    def lower_bound(
        self, task: Any, tile: Tile, sms_free: int, cap: int, unit_tiles: int, layout: str, wait_mode: str
    ) -> float:
        if task.collective == COLLECTIVE:
            return lower_bound(self, task, tile, sms_free, cap, unit_tiles)
        return super().lower_bound(task, tile, sms_free, cap, unit_tiles, layout, wait_mode)

    def best_grouping(
        self, schedule: Schedule, m: int, n: int, k: int, *, max_groups: int
    ) -> tuple[int, ...]:
        if schedule.collective == COLLECTIVE:
            return best_grouping(self, schedule, m, n, k, max_groups=max_groups)
        return super().best_grouping(schedule, m, n, k, max_groups=max_groups)
