"""The cost model's predictions as properties over many seeded random shapes, on the calibrations
an offline plan reads (the packaged H200 x2 one, extrapolated to 4 and 8): finite and positive,
never less for more work or more bytes. In-process, no search: each check prices a few hundred
shapes in well under a second."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from fo_tune.calibrate.find import choose_calibration
from fo_tune.engines import cost_model

# Random shapes priced per (world size, dtype, collective).
SHAPES = 400
# The relative slack of a "never less" comparison (float rounding only).
ROUNDING = 1e-9


# (world size, dtype) of the offline plans checked; the packaged TP=2 calibration has no
# all_gather curve (``test_the_tp2_calibration_has_no_all_gather_curve``), so the all_gather checks
# run on the extrapolated ones.
PLANS = [(2, "bfloat16"), (4, "bfloat16"), (8, "float8_e4m3fn")]
GATHER_PLANS = [plan for plan in PLANS if plan[0] != 2]


@pytest.fixture(scope="module", params=PLANS)
def offline(request):
    """(world size, dtype, the cost model an offline plan of them reads)."""
    import torch

    world, dtype = request.param
    cal, _mode = choose_calibration(None, "predict", world, "gloo", torch.device("cpu"), dtype)
    return world, dtype, cost_model(cal)


def _dims(rng: random.Random, fp8: bool) -> list[int]:
    m = rng.randint(1, 1 << 17)
    n, k = (rng.choice([rng.randint(1, 32768), 16 * rng.randint(1, 2048)]) for _ in range(2))
    if fp8:  # torch._scaled_mm's rule
        n, k = 16 * max(1, n // 16), 16 * max(1, k // 16)
    return [m, n, k]


def test_the_tp2_calibration_has_no_all_gather_curve():
    """What ``GATHER_PLANS`` leaves out: were a TP=2 all_gather curve packaged, the all_gather
    checks below would take world size 2 too."""
    import torch

    cal, _mode = choose_calibration(None, "predict", 2, "gloo", torch.device("cpu"), "bfloat16")
    curves = cost_model(cal).curves
    assert curves.knows("all_reduce") and curves.knows("reduce_scatter")
    assert not curves.knows("all_gather"), "add (2, 'bfloat16') to GATHER_PLANS"


@pytest.mark.parametrize(
    "offline, collective",
    [
        *[(plan, c) for plan in PLANS for c in ("all_reduce", "reduce_scatter")],
        *[(plan, "all_gather") for plan in GATHER_PLANS],
    ],
    indirect=["offline"],
)
def test_a_collective_never_takes_less_for_more_bytes(offline, collective):
    """Over every CTA cap's curve: the measured points dip by a few microseconds as the size grows at
    NCCL's latency floor (the packaged TP=2 all_reduce curve at 256 KB-2 MB), and a plan read
    through them priced a bigger output's GEMM then collective below a smaller one's."""
    world, _dtype, model = offline
    curves = model.curves
    assert curves.knows(collective), (world, collective)
    caps = sorted({b.nccl_max_ctas for b in model.cal.bandwidth if b.collective == collective})
    assert caps, (world, collective)
    sizes = sorted({b.size_bytes for b in model.cal.bandwidth} | {1, 1 << 33})
    # every measured size, the points around it, and sizes between and beyond them
    probe = sorted({max(1, s + d) for s in sizes for d in (-1, 0, 1, s // 3)})
    for cap in caps:
        times = [curves.time(collective, cap, nbytes) for nbytes in probe]
        assert all(math.isfinite(t) and t > 0 for t in times), (world, cap, times)
        for (a, ta), (b, tb) in itertools.pairwise(zip(probe, times, strict=True)):
            assert tb >= ta * (1 - ROUNDING), (world, collective, cap, a, ta, b, tb)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_the_sequential_time_grows_with_m_n_and_k(offline, collective):
    world, dtype, model = offline
    rng = random.Random(world)
    for _ in range(SHAPES):
        a = _dims(rng, dtype == "float8_e4m3fn")
        b = list(a)
        dim = rng.randrange(3)
        b[dim] += rng.choice([1, 16, world, rng.randint(1, 4096)])
        if dtype == "float8_e4m3fn" and dim > 0:
            b[dim] = 16 * -(-b[dim] // 16)
        if {(*a, 0), (*b, 0)} & model.library.points.keys() - model.library.sibling:
            continue  # a measured shape keeps its time (docs/design.md#cost-model)
        before = model.baseline(collective, *a, dtype)
        after = model.baseline(collective, *b, dtype)
        for t in (before.gemm_ms, before.comm_ms, before.sequential_ms, before.fallback_ms):
            assert math.isfinite(t) and t > 0, (a, before)
        assert after.sequential_ms >= before.sequential_ms * (1 - ROUNDING), (world, a, b, before, after)
        assert before.fallback_ms <= before.sequential_ms  # (its graph replay costs less host time)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_a_triton_schedule_is_never_below_its_collective_alone(offline, collective):
    """The heuristic Triton schedule of random shapes (its groups' collectives run on NCCL, after
    their tiles): predicted at least the whole collective alone, finite. The copy engine has no such
    bound (docs/design.md#cost-model)."""
    from fo_tune.engines.triton.defaults import default_schedule

    world, dtype, model = offline
    rng = random.Random(world + 1)
    priced = 0
    for _ in range(SHAPES // 4):
        m, n, k = _dims(rng, dtype == "float8_e4m3fn")
        m = world * max(1, m // world)
        schedule = default_schedule(
            collective, m, n, k, dtype=dtype, world_size=world, sm_count=model.sm_count, on_gpu=True
        )
        if schedule.settings is None:  # too small to overlap
            continue
        got = model.predict(schedule, m, n, k).total_ms
        base = model.baseline(collective, m, n, k, dtype)
        assert math.isfinite(got) and got >= base.comm_ms * (1 - ROUNDING), (world, m, n, k, got, base)
        priced += 1
    assert priced > SHAPES // 8


def test_a_siblings_chunk_gemms_do_not_price_the_baseline(offline):
    """The packaged calibration's N-peer chunk GEMMs were measured on a sibling H100 (one of them,
    256x8192x1024, reads 15x its neighbours): a plan of the H200 priced the baseline at that exact
    shape from it, 2.5x that of 264x8192x1024, and overlapped it at a predicted 1.73x where the shape
    next to it did not overlap. Only the copy engine's chunks at N > 2 read them."""
    world, dtype, model = offline
    library = model.library
    checked = 0
    for m, n, k, beta in library.sibling:
        if beta:
            continue
        for collective in ("all_reduce", "reduce_scatter"):
            at = model.baseline(collective, m, n, k, dtype).sequential_ms
            assert at <= model.baseline(collective, m + 1, n, k, dtype).sequential_ms, (world, m, n, k)
        assert library.time(m, n, k) == library.paced_ms(m, n, k) * library.clock
        checked += 1
    assert checked, f"the packaged calibration's sibling holds no beta-0 chunk GEMM ({world}, {dtype})"


def test_the_grouping_dp_reads_the_curve_once(offline):
    """The Triton term's dynamic program over a large M's signal units (thinned to
    ``DP_MAX_UNITS + 1`` cuts) reads every candidate group's collective from the curve in one
    array read, not once per group count (a predict search of 1048576x8192x4096 spent minutes
    there, over 3 at -w 8 -d float8_e4m3fn) nor once per pair (53 s for -w 8 -d float8_e4m3fn -s
    1048576x8192x8192); only the pricing of each count's grouping reads it per group."""
    from fo_tune.engines.triton.defaults import default_schedule
    from fo_tune.engines.triton.model import DP_MAX_UNITS

    world, dtype, model = offline
    shape = (1 << 20, 8192, 4096)
    schedule = default_schedule(
        "all_reduce", *shape, dtype=dtype, world_size=world, sm_count=model.sm_count, on_gpu=True
    )
    term = model.term("triton")
    reads, calls = [], []
    times, priced = model.curves.times, term.comm_time

    def read(collective, cap, nbytes):
        reads.append(nbytes.shape)
        return times(collective, cap, nbytes)

    def counted(*args):
        calls.append(args)
        return priced(*args)

    model.curves.times, term.comm_time = read, counted
    try:
        groups = term.best_grouping(schedule, *shape, max_groups=8)
    finally:
        del model.curves.times, term.comm_time
    cuts = DP_MAX_UNITS + 1
    assert reads == [(cuts, cuts)] and 1 <= len(groups) <= 8 and len(calls) <= 8 * 8, (world, reads, calls)


def _exhaustive_grouping(model, schedule, m, n, k, max_groups):
    """``TritonTerm.best_grouping`` as a loop: every unit scanned for a band start, every (cut,
    cut) pair's collective read from the curve alone, the DP's pairs one at a time."""
    from fo_kernels.plan import make_plan
    from fo_tune.engines.triton.model import (
        COMM_ISSUE_GAP_MS,
        DP_MAX_UNITS,
        num_units,
        unit_ready_fractions,
        with_groups,
    )
    from fo_tune.model.types import output_bytes

    st, term = schedule.settings, model.term("triton")
    units = num_units(schedule, m, n)
    plan = make_plan(with_groups(schedule, (units,)), m, n, k, sm_count=model.sm_count)

    def local(u):
        return min(u * plan.unit_tiles, plan.num_tiles) // plan.shards

    band = st.tile.group_m * plan.tiles_n
    cuts = [
        u for u in range(units + 1) if u in (0, units) or st.layout == "tile_major" or local(u) % band == 0
    ]
    if len(cuts) > DP_MAX_UNITS:
        step = len(cuts) / DP_MAX_UNITS
        cuts = sorted({cuts[int(i * step)] for i in range(DP_MAX_UNITS)} | {0, units})

    def chunk_bytes(u0, u1):
        if st.layout == "tile_major":
            return (
                plan.shards
                * (local(u1) - local(u0))
                * plan.block_m
                * plan.block_n
                * output_bytes(schedule.dtype)
            )
        rows = [min((local(u) // plan.tiles_n) * plan.block_m, plan.rows_per_shard) for u in (u0, u1)]
        return plan.shards * (rows[1] - rows[0]) * n * output_bytes(schedule.dtype)

    t0, _ = model.tile_profile.time(st.tile, m, n, k, plan.grid)
    inter = model.interference(schedule.collective, st.sms_free, st.nccl_max_ctas)
    gemm = t0 * (inter.gemm_slowdown if inter.concurrent else 1.0)

    def curve(nbytes):
        return model.curves.time(schedule.collective, st.nccl_max_ctas, nbytes)

    def end_of(start, dur):
        start += COMM_ISSUE_GAP_MS
        if start >= gemm:
            return start + dur
        if not inter.concurrent:
            return gemm + dur
        progress = (gemm - start) / inter.comm_slowdown
        return start + dur * inter.comm_slowdown if progress >= dur else gemm + (dur - progress)

    ready = [0.0, *(f * gemm for f in unit_ready_fractions(plan, st.tile, [c - 1 for c in cuts[1:]]))]
    dur = [[curve(chunk_bytes(cuts[i], c)) for i in range(j)] for j, c in enumerate(cuts)]
    best = [[math.inf] * len(cuts) for _ in range(max_groups + 1)]
    back = [[-1] * len(cuts) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    for g in range(1, max_groups + 1):
        for j in range(1, len(cuts)):
            for i in range(j):
                if best[g - 1][i] < math.inf:
                    end = end_of(max(ready[j], best[g - 1][i]), dur[j][i])
                    if end < best[g][j]:
                        best[g][j], back[g][j] = end, i
    options = []
    for g in range(1, max_groups + 1):
        if best[g][-1] < math.inf:
            sizes, j = [], len(cuts) - 1
            for h in range(g, 0, -1):
                sizes.append(cuts[j] - cuts[back[h][j]])
                j = back[h][j]
            options.append(tuple(reversed(sizes)))
    priced = [(term.predict(with_groups(schedule, s), m, n, k).total_ms, len(s), s) for s in options]
    return min(priced)[2]


def test_the_grouping_dp_matches_its_exhaustive_loop(offline):
    """``best_grouping`` (closed-form band starts, one curve read, one array step per group count)
    gives the grouping of the loop over every unit and every pair, on random small M (up to a few
    hundred cuts, so the thinning too), N, layouts, signal units, SMs left free and CTA caps."""
    import dataclasses

    from fo_tune.engines.triton.defaults import default_schedule

    world, dtype, model = offline
    term = model.term("triton")
    rng = random.Random(world + 2)
    tiles = model.tiles()
    checked = 0
    for _ in range(20):
        collective = rng.choice(["all_reduce", "reduce_scatter"])
        shards = world if collective == "reduce_scatter" else 1
        tile = rng.choice(tiles)
        n = rng.choice([tile.block_n, 3 * tile.block_n - 16, 4096, 5120])
        # tile rows: a few (a few cuts), dozens (tile_major past DP_MAX_UNITS cuts), a thousand (row_band too)
        m = shards * rng.randint(1, rng.choice([4, 4, 4, 40, 1200]) * tile.block_m)
        k = 16 * rng.randint(1, 256)
        base = default_schedule(
            collective, m, n, k, dtype=dtype, world_size=world, sm_count=model.sm_count, on_gpu=False
        )
        settings = dataclasses.replace(
            base.settings,
            tile=tile,
            signal_tiles=shards * rng.choice([1, 2, 3, 5]),
            layout=rng.choice(["row_band", "tile_major"]),
            sms_free=rng.choice([0, 16, 24]),
            nccl_max_ctas=rng.choice([0, 16]),
        )
        schedule = dataclasses.replace(base, settings=settings)
        max_groups = rng.choice([1, 3, 8])
        got = term.best_grouping(schedule, m, n, k, max_groups=max_groups)
        assert got == _exhaustive_grouping(model, schedule, m, n, k, max_groups), (world, schedule, m, n, k)
        checked += 1
    assert checked == 20


@pytest.mark.parametrize("offline", GATHER_PLANS, indirect=True)
def test_the_all_gather_dp_matches_its_loop(offline):
    """The all_gather term's DP (each group's pieces priced once per row count, the cuts thinned
    without listing every unit) gives the grouping of the loop over every unit and over each
    front state through ``_step``, on random M, N, tiles, SMs left free and CTA caps."""
    import dataclasses

    from fo_tune.engines.triton import gather
    from fo_tune.engines.triton.defaults import default_schedule
    from fo_tune.engines.triton.model import num_units, with_groups

    world, dtype, model = offline
    assert model.curves.knows("all_gather"), world
    term = model.term("triton")
    rng = random.Random(world + 3)
    for _ in range(8):
        tile = rng.choice(model.tiles())
        m, n, k = (
            world * rng.randint(1, rng.choice([40, 400, 1200]) * tile.block_m),
            rng.choice([4096, 5120]),
            4096,
        )
        base = default_schedule(
            "all_gather", m, n, k, dtype=dtype, world_size=world, sm_count=model.sm_count, on_gpu=False
        )
        unit = world * tile.group_m * -(-n // tile.block_n) * rng.choice([1, 2])
        settings = dataclasses.replace(
            base.settings,
            tile=tile,
            signal_tiles=unit,
            sms_free=rng.choice([0, 24]),
            nccl_max_ctas=rng.choice([0, 16]),
        )
        schedule = dataclasses.replace(base, settings=settings)
        units = num_units(schedule, m, n)
        plan = term.plan(with_groups(schedule, (units,)), m, n, k)
        pieces = gather.GatherPieces(term, schedule, plan, n, k)
        inter = model.interference("all_gather", settings.sms_free, settings.nccl_max_ctas)
        slow = inter.gemm_slowdown if inter.concurrent else 1.0
        cuts = list(range(units + 1))
        if len(cuts) > gather.DP_MAX_CUTS:
            step = len(cuts) / gather.DP_MAX_CUTS
            cuts = sorted({cuts[int(i * step)] for i in range(gather.DP_MAX_CUTS)} | {0, units})
        rows_at = [gather._row_of(plan, u) for u in cuts]
        fronts = [[[] for _ in cuts] for _ in range(9)]
        fronts[0][0] = [(0.0, 0.0, -1, -1)]
        for g in range(1, 9):
            for j in range(1, len(cuts)):
                found = []
                for i in range(j):
                    for idx, (cf, ge, _, _) in enumerate(fronts[g - 1][i]):
                        _, cf2, ge2, _ = gather._step(cf, ge, rows_at[j] - rows_at[i], pieces, slow, inter)
                        found.append((cf2, ge2, i, idx))
                fronts[g][j] = gather._pareto(found)
        options = []
        for g in range(1, 9):
            if fronts[g][-1]:
                _, _, i, idx = min(fronts[g][-1], key=lambda s: (max(s[0], s[1]), s[1]))
                sizes, j, h = [], len(cuts) - 1, g
                while h > 0:
                    sizes.append(cuts[j] - cuts[i])
                    j, h = i, h - 1
                    _, _, i, idx = fronts[h][j][idx]
                options.append(tuple(reversed(sizes)))
        priced = [
            (gather.predict(term, with_groups(schedule, s), m, n, k).total_ms, len(s), s) for s in options
        ]
        assert term.best_grouping(schedule, m, n, k, max_groups=8) == min(priced)[2], (world, settings, m, n)


def test_a_huge_m_is_grouped_in_seconds(offline):
    """The grouping DP and the prediction of its grouping for M = 2^31 - 1 (1M-16M signal units of
    one tile a rank, row_band and tile_major) take well under 5 s each: listing every unit to find the
    bands' starts took minutes for -w 7 -s 2147483647x16x16."""
    import dataclasses
    import time

    from fo_tune.engines.triton.defaults import default_schedule
    from fo_tune.engines.triton.model import num_units, with_groups

    world, dtype, model = offline
    term = model.term("triton")
    for collective in ("all_reduce", "reduce_scatter"):
        shards = world if collective == "reduce_scatter" else 1
        m, n, k = (2**31 - 1) // shards * shards, 64, 64
        base = default_schedule(
            collective, m, n, k, dtype=dtype, world_size=world, sm_count=model.sm_count, on_gpu=True
        )
        for layout in ("row_band", "tile_major"):
            settings = dataclasses.replace(
                base.settings, tile=model.tiles()[0], signal_tiles=shards, layout=layout, groups=(1,)
            )
            schedule = dataclasses.replace(base, settings=settings)
            assert num_units(schedule, m, n) >= 1 << 20
            t0 = time.perf_counter()
            groups = term.best_grouping(schedule, m, n, k, max_groups=8)
            got = model.predict(with_groups(schedule, groups), m, n, k).total_ms
            assert time.perf_counter() - t0 < 5.0 and math.isfinite(got) and got > 0, (collective, layout)


def test_a_prediction_reads_only_its_groups_last_units(offline):
    """A Triton schedule of 16M signal units (one tile a unit, 1<<26 rows) is predicted in well
    under a second: the term computed every unit's ready time to read its groups' last ones (2.7 s
    a prediction at 4M units here, and a predict search of -w 7 -s 1x2147483647x1 ran for minutes)."""
    import dataclasses
    import time

    from fo_tune.engines.triton.defaults import default_schedule
    from fo_tune.engines.triton.model import num_units

    world, dtype, model = offline
    shape = (1 << 26, 8192, 64)
    schedule = default_schedule(
        "all_reduce", *shape, dtype=dtype, world_size=world, sm_count=model.sm_count, on_gpu=True
    )
    schedule = dataclasses.replace(schedule, settings=dataclasses.replace(schedule.settings, signal_tiles=1))
    units = num_units(schedule, *shape[:2])
    schedule = dataclasses.replace(schedule, settings=dataclasses.replace(schedule.settings, groups=(units,)))
    assert units >= 1 << 24
    t0 = time.perf_counter()
    got = model.predict(schedule, *shape).total_ms
    assert time.perf_counter() - t0 < 1.0 and math.isfinite(got) and got > 0
