"""Schedule validation (errors name the field) and plan geometry (every tile in one place)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest

from fo_kernels.engines import engine_names
from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.errors import ScheduleError, ShapeError
from fo_kernels.plan import cdiv, make_plan, resolve_groups
from fo_kernels.schedule import Problem, Schedule, settings_type
from fo_kernels.tile import Tile
from fo_tune.engines.triton.defaults import MIN_OVERLAP_BYTES, default_schedule, split_decreasing

TILE = Tile(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
_COMMON = ("collective", "dtype", "world_size", "problem", "provenance")


def sched(**kw) -> Schedule:
    """A Triton-engine schedule; keyword arguments go to the schedule or to its settings by name."""
    common = dict(collective="all_reduce", dtype="float32", world_size=2, problem=Problem(m=64, n=64, k=32))
    settings = dict(tile=TILE, signal_tiles=1, groups=(8,), layout="tile_major", wait_mode="spin")
    for key, value in kw.items():
        (common if key in _COMMON else settings)[key] = value
    return Schedule(**common, settings=TritonSettings(**settings))


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(collective="all_to_all"), "collective"),
        (dict(dtype="int8"), "dtype"),
        (dict(world_size=0), "world_size"),
        (dict(layout="diagonal"), "layout"),
        (dict(wait_mode="poll"), "wait_mode"),
        (dict(groups=()), "groups"),
        (dict(groups=(3, 0)), "groups[1]"),
        (dict(signal_tiles=0), "signal_tiles"),
        (dict(sms_free=-1), "sms_free"),
        (dict(nccl_max_ctas=-2), "nccl_max_ctas"),
        (dict(tile=None), "tile"),
        (
            dict(collective="reduce_scatter", problem=Problem(m=64, n=64, k=32), signal_tiles=3),
            "signal_tiles",
        ),
        (dict(collective="reduce_scatter", problem=Problem(m=63, n=64, k=32)), "problem.m"),
    ],
)
def test_schedule_errors_name_the_field(kw, field):
    with pytest.raises(ScheduleError) as err:
        sched(**kw)
    assert str(err.value).startswith(field), str(err.value)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(block_m=100), "tile.block_m"),
        (dict(block_n=8), "tile.block_n"),
        (dict(block_k=512), "tile.block_k"),
        (dict(num_warps=3), "tile.num_warps"),
        (dict(group_m=0), "tile.group_m"),
        (dict(num_stages=0), "tile.num_stages"),
    ],
)
def test_tile_errors_name_the_field(kw, field):
    args = dict(block_m=64, block_n=64, block_k=32)
    args.update(kw)
    with pytest.raises(ScheduleError, match=rf"^{field}"):
        Tile(**args)


def test_problem_rules():
    with pytest.raises(ScheduleError, match="either m or m_min"):
        Problem(m=4, m_min=1, m_max=8, n=2, k=2)
    with pytest.raises(ScheduleError, match="m_min 9 > m_max 8"):
        Problem(m_min=9, m_max=8, n=2, k=2)
    with pytest.raises(ScheduleError, match="needs m"):
        Problem(n=2, k=2)
    r = Problem(m_min=512, m_max=16384, n=8192, k=4096)
    assert r.covers(512, 8192, 4096) and r.covers(16384, 8192, 4096)
    assert not r.covers(511, 8192, 4096) and not r.covers(1024, 8192, 4095)


def test_round_trip_and_unknown_keys():
    s = sched(provenance={"source": "test"})
    assert Schedule.from_dict(s.to_dict()) == s
    no = Schedule(
        collective="reduce_scatter",
        dtype="bfloat16",
        world_size=4,
        problem=Problem(m_min=8, m_max=64, n=16, k=16),
    )
    assert not no.overlap and no.engine is None
    assert no.to_dict()["overlap"] is False and "settings" not in no.to_dict()
    assert Schedule.from_dict(no.to_dict()) == no
    bad = s.to_dict() | {"tile_size": 3}
    with pytest.raises(ScheduleError, match="unknown key"):
        Schedule.from_dict(bad)
    row = s.to_dict()
    row["settings"] = row["settings"] | {"tile": {"block_m": 16, "block_n": 16, "block_k": 16, "bm": 1}}
    with pytest.raises(ScheduleError, match=r"^tile: unknown key"):
        Schedule.from_dict(row)
    row = s.to_dict()
    row["settings"] = row["settings"] | {"weights": [1]}  # another engine's field
    with pytest.raises(ScheduleError, match=r"^settings \(triton\): unknown key\(s\) weights"):
        Schedule.from_dict(row)


def test_engines_are_a_tagged_union_registered_by_exact_name():
    assert set(engine_names()) == {"triton", "copy_engine"}
    assert settings_type("triton") is TritonSettings
    assert settings_type("copy_engine") is CopyEngineSettings
    with pytest.raises(ScheduleError, match=r"^engine: 'Copy_Engine' is not one of copy_engine, triton"):
        settings_type("Copy_Engine")
    row = sched().to_dict()
    assert row["engine"] == "triton" and set(row["settings"]) >= {"tile", "groups", "layout"}
    with pytest.raises(ScheduleError, match=r"^engine: 'nccl' is not one of"):
        Schedule.from_dict(row | {"engine": "nccl"})
    with pytest.raises(ScheduleError, match=r"^engine: missing"):
        Schedule.from_dict({k: v for k, v in row.items() if k != "engine"})
    with pytest.raises(ScheduleError, match=r"^engine: an overlap: false row"):
        Schedule.from_dict(row | {"overlap": False})


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(weights=()), "weights"),
        (dict(weights=(1, 0)), "weights[1]"),
        (dict(weights=(1,) * 65), "weights"),
        (dict(mode="exchange"), "mode"),
        (dict(mode="tiled"), "tile"),  # the tiled mode needs its GEMM tile
        (dict(mode="ring", tile=TILE), "tile"),  # a ring of library GEMMs takes none
    ],
)
def test_copy_engine_settings_errors_name_the_field(kw, field):
    args = dict(weights=(1, 1)) | kw
    with pytest.raises(ScheduleError, match=rf"^{re.escape(field)}"):
        CopyEngineSettings(**args)


def test_copy_engine_schedule_round_trip_and_world_size():
    tiled = CopyEngineSettings(mode="tiled", weights=(2, 1), tile=TILE)
    for settings, worlds in ((CopyEngineSettings(weights=(1, 1, 1, 1)), (2, 3, 8)), (tiled, (2,))):
        for world in worlds:
            s = Schedule(
                collective="reduce_scatter",
                dtype="bfloat16",
                world_size=world,
                problem=Problem(m_min=8, m_max=4096, n=16, k=16),
                settings=settings,
            )
            assert s.engine == "copy_engine" and Schedule.from_dict(s.to_dict()) == s
    assert "engine copy_engine, tiled, 2 chunk(s) per shard" in s.describe()
    with pytest.raises(ScheduleError, match=r"^mode: tiled runs between exactly 2 GPUs"):
        dataclasses.replace(s, world_size=4)
    with pytest.raises(ScheduleError, match=r"^engine: copy_engine moves data between at least 2"):
        Schedule(
            collective="all_reduce",
            dtype="bfloat16",
            world_size=1,
            problem=Problem(m=8, n=16, k=16),
            settings=tiled,
        )


def test_plan_group_sum_and_band_alignment_errors():
    with pytest.raises(ScheduleError, match=r"^groups: sizes sum to 7"):
        make_plan(sched(groups=(3, 4)), 64, 64, 32, sm_count=4)  # 4 x 2 tiles = 8 units
    with pytest.raises(ScheduleError, match=r"^groups: with layout row_band"):
        make_plan(sched(layout="row_band", groups=(3, 5)), 64, 64, 32, sm_count=4)  # band = 4 tiles
    with pytest.raises(ScheduleError, match=r"^sms_free"):
        make_plan(sched(sms_free=4), 64, 64, 32, sm_count=4)
    with pytest.raises(ScheduleError, match=r"^problem"):
        make_plan(sched(), 65, 64, 32, sm_count=4)
    with pytest.raises(ShapeError, match="reduce_scatter needs M divisible by the world size 2, got M=63"):
        make_plan(
            sched(
                problem=Problem(m_min=1, m_max=99, n=64, k=32), collective="reduce_scatter", signal_tiles=2
            ),
            63,
            64,
            32,
            sm_count=4,
        )


def _tile_positions(plan):
    """Map every (shard, local tile) to its element offsets the way the kernel addresses them."""
    seen = {}
    for t in range(plan.num_tiles):
        s, l = t % plan.shards, t // plan.shards
        g = plan.unit_group()[t // plan.unit_tiles]
        l0, l1 = plan.group_local[g]
        assert l0 <= l < l1, "a tile outside its group's local range"
        seen[(s, l)] = g
    return seen


@pytest.mark.parametrize(
    "collective, world, m, n, layout, unit_mult",
    list(
        itertools.product(
            ["all_reduce", "reduce_scatter"],
            [2, 3],
            [6, 96, 130],
            [7, 64, 100],
            ["tile_major", "row_band"],
            [1, 3],
        )
    ),
)
def test_plan_covers_every_tile_once(collective, world, m, n, layout, unit_mult):
    shards = world if collective == "reduce_scatter" else 1
    m = m - m % world if collective == "reduce_scatter" else m
    mt, nt = cdiv(m // shards, TILE.block_m), cdiv(n, TILE.block_n)
    unit = shards * (TILE.group_m * nt if layout == "row_band" else 1) * unit_mult
    units = cdiv(shards * mt * nt, unit)
    groups = split_decreasing(units, 3)
    s = sched(
        collective=collective,
        world_size=world,
        problem=Problem(m=m, n=n, k=8),
        layout=layout,
        signal_tiles=unit,
        groups=groups,
    )
    plan = make_plan(s, m, n, 8, sm_count=5)
    assert sum(plan.group_tiles(g) for g in range(plan.num_groups)) == plan.num_tiles
    assert len(_tile_positions(plan)) == plan.num_tiles
    # chunks tile the buffer exactly, in order; parts tile one rank's output exactly, in order
    chunks = [plan.chunk_range(g) for g in range(plan.num_groups)]
    parts = [plan.part_range(g) for g in range(plan.num_groups)]
    assert chunks[0][0] == 0 and chunks[-1][1] == plan.buffer_numel()
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    per_rank = plan.buffer_numel() // plan.shards
    assert parts[0][0] == 0 and parts[-1][1] == per_rank
    assert all((c1 - c0) == shards * (p1 - p0) for (c0, c1), (p0, p1) in zip(chunks, parts, strict=True))
    if layout == "row_band":
        assert plan.group_rows[-1][1] == m // shards


def test_all_gather_rules():
    """An all_gather row's M is the gathered M (divisible by the world size); its Triton settings
    group whole bands of every shard (row_band, units a multiple of the world size); its plan has
    one shard per rank, as reduce_scatter's."""
    with pytest.raises(ScheduleError, match=r"problem\.m: all_gather needs M divisible by world_size 3"):
        sched(collective="all_gather", world_size=3, problem=Problem(m=64, n=64, k=32), layout="row_band")
    with pytest.raises(ScheduleError, match="signal_tiles: all_gather needs a multiple of world_size 2"):
        sched(collective="all_gather", signal_tiles=3, layout="row_band")
    with pytest.raises(ScheduleError, match="layout: all_gather gathers whole bands"):
        sched(collective="all_gather", signal_tiles=2, layout="tile_major")
    # 64 rows over 2 shards of 32: 2 tile rows of 16 per shard, bands of group_m=2 rows -> one band
    s = sched(collective="all_gather", signal_tiles=8, groups=(1,), layout="row_band")
    plan = make_plan(s, 64, 64, 32, sm_count=5)
    assert plan.shards == 2 and plan.rows_per_shard == 32 and plan.group_rows == ((0, 32),)


def _unit_below_band_row(collective: str, world: int) -> tuple[Schedule, int]:
    """(an M-range row_band row over M = shards..200 x shards of N = 20, K = 8 whose signal unit,
    ``shards`` tiles, is not a whole band, with weights (6, 2); the collective's shard count)."""
    shards = 1 if collective == "all_reduce" else world
    row = sched(
        collective=collective,
        world_size=world,
        problem=Problem(m_min=shards, m_max=200 * shards, n=20, k=8),
        layout="row_band",
        signal_tiles=shards,
        groups=(6, 2),
    )
    return row, shards


@pytest.mark.parametrize("collective, world", [("all_reduce", 2), ("reduce_scatter", 2), ("all_gather", 3)])
def test_range_row_band_row_plans_every_m_of_its_range(collective, world):
    """An M-range row_band row whose signal unit is not a whole band (a wave unit, as the tuner
    offers) plans at every M of its range, its groups starting where bands start: scaled unit by
    unit, its weights (6, 2) cut inside a band at M = 50 (a ScheduleError at run time for an M
    the row covers)."""
    row, shards = _unit_below_band_row(collective, world)
    band = TILE.group_m  # N = 20 is one tile column
    for m in range(shards, 200 * shards + 1, shards):
        plan = make_plan(row, m, 20, 8, sm_count=4)
        assert sum(plan.group_units) == plan.num_units, m
        assert all(l0 % band == 0 for l0, _ in plan.group_local), (m, plan.group_local)
        assert plan.group_rows[-1][1] == m // shards
        assert all(a[1] == b[0] for a, b in itertools.pairwise(plan.group_rows)), m
    assert make_plan(row, 100 * shards, 20, 8, sm_count=4).num_groups == 2


@pytest.mark.parametrize("collective, world", [("all_reduce", 2), ("reduce_scatter", 2), ("all_gather", 3)])
def test_a_row_band_row_taken_to_another_m_plans_there(collective, world):
    """The tuner's warm start takes the nearest exact row to the searched M (``regroup``): a
    row_band row whose unit is not a whole band keeps its groups on band starts at every M."""
    from fo_tune.search.study import regroup

    ranged, shards = _unit_below_band_row(collective, world)
    m0 = 100 * shards
    exact = dataclasses.replace(
        ranged,
        problem=Problem(m=m0, n=20, k=8),
        settings=dataclasses.replace(
            ranged.settings, groups=make_plan(ranged, m0, 20, 8, sm_count=4).group_units
        ),
    )
    for m in range(shards, 200 * shards + 1, shards):
        moved = regroup(dataclasses.replace(exact, problem=Problem(m=m, n=20, k=8)))
        plan = make_plan(moved, m, 20, 8, sm_count=4)  # (a ScheduleError when a group starts mid-band)
        assert sum(plan.group_units) == plan.num_units, m


def test_resolve_groups_for_ranges():
    assert resolve_groups((2, 1, 1), 4, exact=True) == (2, 1, 1)
    assert sum(resolve_groups((3, 2, 1), 40, exact=False)) == 40
    scaled = resolve_groups((3, 2, 1), 40, exact=False)
    assert scaled[0] > scaled[1] > scaled[2] >= 1
    assert resolve_groups((5, 5, 5, 5), 2, exact=False) == (1, 1)
    # cut only every 3rd unit: the weights scaled over 4 spans, the last span partial
    assert resolve_groups((3, 1), 11, exact=False, step=3) == (9, 2)
    assert resolve_groups((3, 1), 2, exact=False, step=3) == (2,)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize(
    "m, n, k", [(1, 1, 1), (2, 7, 5), (130, 257, 70), (4096, 8192, 4096), (16384, 8192, 4096)]
)
@pytest.mark.parametrize("on_gpu", [False, True])
def test_default_schedule_is_valid_for_any_shape(collective, m, n, k, on_gpu):
    world = 2
    if collective != "all_reduce":
        m *= world
    s = default_schedule(collective, m, n, k, dtype="bfloat16", world_size=world, sm_count=132, on_gpu=on_gpu)
    if s.overlap:
        plan = make_plan(s, m, n, k, sm_count=132)
        assert plan.num_groups >= 1
        assert plan.grid <= 132 - s.settings.sms_free
    else:  # the bytes the collective moves: an AllGather's gathered A, the others' output
        assert on_gpu and m * (k if collective == "all_gather" else n) * 2 < MIN_OVERLAP_BYTES


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_fp8_default_schedule_takes_the_deep_k_tile_and_counts_fp8_bytes(collective):
    world, n = 2, 8192
    m = 8192 * (1 if collective == "all_reduce" else world)
    s = default_schedule(
        collective, m, n, 4096, dtype="float8_e4m3fn", world_size=world, sm_count=132, on_gpu=True
    )
    assert s.overlap and s.settings.tile.block_k == 128 and s.settings.tile.block_n == 256
    bf16 = default_schedule(
        collective, m, n, 4096, dtype="bfloat16", world_size=world, sm_count=132, on_gpu=True
    )
    assert bf16.settings.tile.block_k == 64
    # An AllGather of fp8 A moves 1 byte an element: 4096 x 4096 rows at 2 ranks is 32 MiB of fp8,
    # under the overlap threshold, where 64 MiB of bf16 is not.
    small = default_schedule(
        collective,
        4096 * world,
        4096,
        4096,
        dtype="float8_e4m3fn",
        world_size=world,
        sm_count=132,
        on_gpu=True,
    )
    moved = 4096 * world * 4096 * (1 if collective == "all_gather" else 2)
    assert small.overlap == (moved >= MIN_OVERLAP_BYTES)


def test_copy_engine_settings_agree_with_the_engines_modes():
    """The schedule's copy-engine rules (kept light: reading a table defines no kernel) say what the
    engine's own mode registry says: the same mode names, and the same feasibility per collective
    and world size."""
    from fo_kernels.engines.copy_engine import MODE_NAMES, mode_blocker
    from fo_kernels.engines.copy_engine.settings import COPY_ENGINE_MODES
    from fo_kernels.schedule import COLLECTIVES

    assert COPY_ENGINE_MODES == MODE_NAMES
    for mode, collective, world in itertools.product(MODE_NAMES, COLLECTIVES, range(1, 9)):
        tile = TILE if mode == "tiled" else None
        engine_says = mode_blocker(mode, collective, world, tile)
        try:
            Schedule(
                collective=collective,
                dtype="float32",
                world_size=world,
                problem=Problem(m_min=world, m_max=4096, n=16, k=16),
                settings=CopyEngineSettings(mode=mode, weights=(1, 1), tile=tile),
            )
            schedule_says = ""
        except ScheduleError as exc:
            schedule_says = str(exc)
        assert bool(engine_says) == bool(schedule_says), (mode, collective, world, engine_says, schedule_says)


def test_op_text_is_the_schedule_json_without_provenance_whatever_the_engine():
    # op_text is assembled from parts for speed: it must read as the whole dict's sorted JSON
    tiled = CopyEngineSettings(
        mode="tiled", weights=(2, 1), tile=dataclasses.replace(TILE, warp_specialize=True)
    )
    schedules = [
        sched(provenance={"source": "test", "measured_ms": 0.1}),
        sched(problem=Problem(m_min=8, m_max=4096, n=64, k=32), groups=(3, 1)),
        Schedule(
            collective="all_gather", dtype="float8_e4m3fn", world_size=3, problem=Problem(m=96, n=16, k=16)
        ),
        Schedule(
            collective="reduce_scatter",
            dtype="bfloat16",
            world_size=2,
            problem=Problem(m_min=8, m_max=64, n=16, k=16),
            settings=tiled,
            basis="extrapolated from world size 2",
        ),
        Schedule(
            collective="all_reduce",
            dtype="float16",
            world_size=8,
            problem=Problem(m=5, n=16, k=16),
            settings=CopyEngineSettings(weights=(1, 1, 1)),
        ),
    ]
    for s in schedules:
        data = s.to_dict()
        data.pop("provenance", None)
        data.pop("basis", None)
        assert s.op_text == json.dumps(data, sort_keys=True, separators=(",", ":")), s
        assert Schedule.from_dict(json.loads(s.op_text)) == dataclasses.replace(s, provenance={}, basis="")


def test_rows_with_equal_settings_of_other_types_are_each_checked():
    # rows share settings built before; a field equal in value but not in type (1 for true, 1.0
    # for 1) is still refused, whichever row comes first
    good = sched().to_dict()
    for field, value in (("warp_specialize", 1), ("num_stages", 1.0)):
        bad = json.loads(json.dumps(good))
        bad["settings"]["tile"][field] = value
        if field == "warp_specialize":
            good_ws = json.loads(json.dumps(good))
            good_ws["settings"]["tile"][field] = True
            Schedule.from_dict(good_ws)
        else:
            Schedule.from_dict(good)
        with pytest.raises(ScheduleError, match=rf"^tile\.{field}: expected"):
            Schedule.from_dict(bad)
    row = sched().to_dict()
    first = Schedule.from_dict(row)
    again = Schedule.from_dict(json.loads(json.dumps(row)))
    assert again == first and again.settings is first.settings
