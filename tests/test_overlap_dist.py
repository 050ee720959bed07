"""Both overlapped ops on real gloo process groups (2, 3 and 4 CPU processes) against the reference."""

from __future__ import annotations

import itertools

import pytest

from dist_cases import TOL, Case, bad_inputs, module_vs_linear, run_cases
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.plan import cdiv
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.tile import Tile
from fo_tune.engines.triton.defaults import split_decreasing
from fo_tune.ranks.launch import run_ranks

TILE = Tile(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)


@pytest.fixture(autouse=True)
def _isolated_tables(tmp_path, monkeypatch):
    """No table anywhere: lookups fall back to the heuristic (ranks inherit the environment)."""
    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "tables"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))


def make_schedule(collective, world, m, n, k, dtype, layout, unit_mult=1, num_groups=3, wait="spin"):
    shards = world if collective == "reduce_scatter" else 1
    mt, nt = cdiv(m // shards, TILE.block_m), cdiv(n, TILE.block_n)
    unit = shards * unit_mult * (TILE.group_m * nt if layout == "row_band" else 1)
    groups = split_decreasing(cdiv(shards * mt * nt, unit), num_groups)
    return Schedule(
        collective=collective,
        dtype=dtype,
        world_size=world,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=TILE, sms_free=1, signal_tiles=unit, groups=groups, layout=layout, wait_mode=wait
        ),
    )


def check(results_per_rank, world):
    assert len(results_per_rank) == world
    for rank, results in enumerate(results_per_rank):
        for r in results:
            c = r["case"]
            where = f"rank {rank}: {c.collective} {c.m}x{c.n}x{c.k} {c.dtype} kmajor={c.kmajor} {c.schedule}"
            assert r["shape"] == r["want_shape"], where
            assert not r["nan"], where
            assert r["dtype_ok"], where
            assert r["err"] < TOL[c.dtype], f"{where}: relative error {r['err']:.2e}"


def test_two_ranks_all_layouts_dtypes_and_b_layouts():
    world, cases, seed = 2, [], 0
    for collective, layout, dtype, kmajor in itertools.product(
        ["all_reduce", "reduce_scatter"],
        ["row_band", "tile_major"],
        ["float32", "float16", "bfloat16"],
        [False, True],
    ):
        for m, n, k in [(66, 66, 40), (6, 7, 5)]:
            seed += 1
            s = make_schedule(collective, world, m, n, k, dtype, layout, unit_mult=1 + seed % 2)
            cases.append(Case(collective, m, n, k, dtype, kmajor, s.to_dict(), seed))
    check(run_ranks(run_cases, world, cases, backend="gloo"), world)


def test_two_ranks_fallbacks_and_heuristic_lookup():
    world = 2
    cases = []
    for i, collective in enumerate(["all_reduce", "reduce_scatter"]):
        no_overlap = Schedule(
            collective=collective,
            dtype="float32",
            world_size=world,
            problem=Problem(m=34, n=20, k=9),
        )
        cases.append(Case(collective, 34, 20, 9, "float32", False, no_overlap.to_dict(), 100 + i))
        cases.append(Case(collective, 258, 130, 70, "float16", True, None, 200 + i))  # heuristic
        one_group = make_schedule(collective, world, 64, 64, 48, "float32", "tile_major", num_groups=1)
        cases.append(Case(collective, 64, 64, 48, "float32", False, one_group.to_dict(), 300 + i))
        stream = make_schedule(collective, world, 96, 40, 24, "float32", "row_band", wait="stream_wait")
        cases.append(Case(collective, 96, 40, 24, "float32", False, stream.to_dict(), 400 + i))
        # an M-range row_band row with one-tile units: its groups cut where bands start at any M
        shards = world if collective == "reduce_scatter" else 1
        ranged = Schedule(
            collective=collective,
            dtype="float32",
            world_size=world,
            problem=Problem(m_min=shards, m_max=200 * shards, n=20, k=9),
            settings=TritonSettings(tile=TILE, signal_tiles=shards, groups=(6, 2), layout="row_band"),
        )
        cases.append(Case(collective, 50 * shards, 20, 9, "float32", True, ranged.to_dict(), 500 + i))
    results = run_ranks(run_cases, world, cases, backend="gloo")
    check(results, world)
    for per_rank in results:
        warned = [r["heuristic_warnings"] for r in per_rank if r["case"].schedule is None]
        assert warned == [1, 1], "the heuristic fallback must warn exactly once per lookup"


@pytest.mark.parametrize("world", [3, 4])
def test_more_ranks(world):
    cases = []
    for i, (collective, layout) in enumerate(
        itertools.product(["all_reduce", "reduce_scatter"], ["row_band", "tile_major"])
    ):
        m = 12 * world + (0 if collective == "reduce_scatter" else 1)
        s = make_schedule(collective, world, m, 45, 19, "float32", layout)
        cases.append(Case(collective, m, 45, 19, "float32", i % 2 == 1, s.to_dict(), 500 + i))
    check(run_ranks(run_cases, world, cases, backend="gloo"), world)


def test_bad_inputs_raise_clear_value_errors():
    msgs = run_ranks(bad_inputs, 2, None, backend="gloo")[0]
    assert all(m != "NO ERROR" for m in msgs.values()), msgs
    assert "K mismatch" in msgs["k_mismatch"]
    assert "not supported" in msgs["dtype_int"]
    assert "same dtype" in msgs["dtype_mixed"]
    assert "divisible by the world size 2" in msgs["m_not_divisible"]
    assert msgs["schedule_other_shape"].startswith("problem:")
    assert msgs["schedule_other_collective"].startswith("collective:")
    assert "row-major" in msgs["b_strided"]


def test_row_parallel_linear_matches_nn_linear():
    errs = run_ranks(module_vs_linear, 2, {"in": 64, "out": 48, "batch": 4, "seq": 5}, backend="gloo")
    for per_rank in errs:
        assert all(e < 1e-5 for e in per_rank), per_rank
