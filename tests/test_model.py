"""The cost model against recorded measurements (the shipped tables, search reports and copy-engine
probes of H200 x2), the offline plan of the benchmark suite, ``fo-tune model check`` and
``fo-tune model fit``."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from cli_checks import H200_KEY, assert_one_line_error, isolate_tables, with_all_gather_standin
from fo_kernels.table import load_table, row_kind
from fo_tune.calibrate.calibration import load_calibration, save_calibration
from fo_tune.calibrate.find import packaged_calibration
from fo_tune.engines import cost_model
from fo_tune.engines.copy_engine.fit import fit_free
from fo_tune.engines.copy_engine.model import chunk_rows, eager_ops
from fo_tune.model.check import check_files, mape, measured_in
from fo_tune.search import SearchRequest, run_search
from fo_tune.tables.merge import lock_path

ROOT = Path(__file__).resolve().parents[1]
TABLES = sorted((ROOT / "results" / "tables" / H200_KEY).glob("*.yaml"))
CALIBRATION_DIR = ROOT / "results" / "calibration" / H200_KEY / "tp2"
REPORTS = sorted((ROOT / "results" / "search" / H200_KEY).glob("**/trials.csv"))
SUITE = [(2048, 4096, 4096), (4096, 8192, 4096), (4096, 8192, 14336), (8192, 8192, 8192), (16384, 8192, 4096)]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path / "env")
    monkeypatch.chdir(tmp_path)


def model_check(*args: str):
    return CliRunner().invoke(app, ["model", "check", *args])


# ------------------------------------------------------------------------------------ recorded
def test_every_copy_engine_parameter_has_a_source(h200):
    section = h200.copy_engine
    assert section is not None and section.library_gemm and section.copies
    for name, q in section.params.items():
        assert math.isfinite(q.value) and q.source, name
        assert q.source.startswith(("measured", "fitted")), (name, q.source)
    fitted = {name for name, q in section.params.items() if q.source.startswith("fitted to")}
    assert "clock_context" in fitted and "peer_copy_gbs" not in fitted


def test_the_model_against_the_shipped_measured_rows(model):
    """The issue's bar: MAPE <= 10% over the shipped measured rows (the fit held out N, K = 8192,
    8192, and those rows stay within it too)."""
    rows = check_files(TABLES, model)
    assert len(rows) == sum(row_kind(r) == "measured" for t in TABLES for r in load_table(t).rows)
    mean, worst = mape(rows)
    assert mean <= 0.10 and worst <= 0.25, (mean, worst)
    held = [c for c in rows if "x8192x8192" in c.item]
    assert len(held) == 14 and mape(held)[0] <= 0.10


@pytest.mark.parametrize(
    ("name", "bar"), [("copy_engine_streams_probe.csv", 0.10), ("copy_engine_tiled_probe.csv", 0.08)]
)
def test_the_copy_engine_model_against_recorded_probes(model, name, bar):
    """Recorded copy-engine timings of every suite shape over chunk counts (both collectives, ring
    and tiled modes); the streams probe was kept out of every fit."""
    rows = check_files([CALIBRATION_DIR / name], model)
    assert len(rows) >= 30 and {c.engine for c in rows} == {"copy_engine"}
    mean, _worst = mape(rows)
    assert mean <= bar, mean


def test_the_wave_count_follows_the_kernels_tail():
    """A last, partial wave the kernel splits into pieces counts as the pieces' share of a wave,
    one it shares out by stream-K as its programs' share of K blocks plus the tail's measured
    overhead; one it runs whole (too short a call, a tail of more than half the grid that stream-K
    would not save enough of, or ``rows_gemm``, which never splits) as a wave."""
    from fo_kernels.tile import Tile
    from fo_tune.model.profiles import SPLIT_WAVE_SHARE, STREAM_K_OVERHEAD_BLOCKS, waves

    big = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4)
    assert waves(4096, 8192, 4096, big, 124) == 8 + SPLIT_WAVE_SHARE[2]  # 32 tail tiles in halves
    assert waves(4096, 8192, 4096, big, 124, split=False) == 9  # rows_gemm: whole waves
    assert waves(16384, 8192, 4096, big, 132) == 31 + SPLIT_WAVE_SHARE[4]  # 4 tail tiles in quarters
    assert waves(2048, 4096, 4096, big, 124) == 2 + SPLIT_WAVE_SHARE[4]  # 2^35 multiply-adds: split
    assert waves(1024, 4096, 4096, big, 124) == 2  # 2^34: too short a call to split
    assert waves(4096, 8192, 4096, big, 132) == 8  # a tail of 100 on 132: whole
    assert waves(4096, 8192, 4096, big, 128) == 8 and waves(128, 256, 64, big, 132) == 1
    # stream-K: 64 tail tiles of 224 K blocks on 120 programs (120 blocks each), more than half the
    # grid; 16 of 108 on 116 programs are split first (quarters)
    assert waves(4096, 8192, 14336, big, 120) == 8 + (120 + STREAM_K_OVERHEAD_BLOCKS) / 224
    assert waves(3000, 5120, 6912, big, 116) == 4 + SPLIT_WAVE_SHARE[4]
    pingpong = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4, pingpong=True)
    # 2048 tiles on 132 programs leave a tail of 68, more than half the grid: the plain tile shares
    # it out by stream-K, the ping-pong kernel runs it as a wave
    assert waves(4096, 8192, 14336, pingpong, 132) == 16
    assert waves(4096, 8192, 14336, dataclasses.replace(pingpong, pingpong=False), 132) < 16
    assert waves(4096, 8192, 14336, big, 132) == 8  # a tail of 100 on 132 saves too little


def test_units_are_ready_when_the_kernel_signals_them():
    """A tile is signalled at its program's next tile's epilogue in the whole waves' loop. Where the
    last partial wave runs apart from it (split tail, stream-K), the last whole wave's tiles have no
    next tile, so they are ready when that wave ends, and the split wave lasts its share."""
    from fo_kernels.engines.triton.settings import TritonSettings
    from fo_kernels.plan import make_plan
    from fo_kernels.schedule import Problem, Schedule
    from fo_kernels.tile import Tile
    from fo_tune.engines.triton.model import unit_ready_fractions
    from fo_tune.model.profiles import SPLIT_WAVE_SHARE

    big = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4)

    def fractions(m: int, n: int, k: int, sms_free: int) -> list[float]:
        units = -(-m // 128) * -(-n // 256)
        st = TritonSettings(
            tile=big, sms_free=sms_free, nccl_max_ctas=0, signal_tiles=1, groups=(units,), layout="tile_major"
        )
        problem = Problem(m=m, n=n, k=k)
        s = Schedule(collective="all_reduce", dtype="bfloat16", world_size=2, problem=problem, settings=st)
        return unit_ready_fractions(make_plan(s, m, n, k, sm_count=132), big)

    # 1024 tiles on 124 programs: 8 whole waves, 32 tail tiles split in halves (after the loop)
    split = fractions(4096, 8192, 4096, 8)
    length = 8 + SPLIT_WAVE_SHARE[2]
    assert split[0] == pytest.approx(2 / length)  # wave 0's tile, signalled at wave 1's epilogue
    assert split[7 * 124 - 1] == pytest.approx(8 / length)  # wave 6, signalled in wave 7
    assert split[7 * 124] == pytest.approx(8 / length)  # wave 7: its programs' last in that launch
    assert split[-1] == 1.0 and split == sorted(split)
    # 2^34 multiply-adds: neither split nor stream-K, so the tail tiles are the next tiles of wave 1
    whole = fractions(1024, 8192, 2048, 8)  # 256 tiles: 2 waves and 8 tail tiles
    assert whole[124] == 1.0 and whole[124 - 1] == pytest.approx(2 / 3)  # wave 0, in wave 1
    assert whole[124 + 8] == pytest.approx(2 / 3)  # program 8 of wave 1 has no tail tile


def test_the_pingpong_kernels_units_are_ready_at_their_own_epilogue_and_its_k_split_tail_first():
    """The ping-pong kernel signals each tile when its wave ends (no deferral). Its K-split tail
    runs first: the tail tiles are ready after their part's share, and the whole tiles of the
    programs that ran a part end that share later; the GEMM ends with them."""
    from fo_kernels.engines.triton.settings import TritonSettings
    from fo_kernels.plan import make_plan, tail_plan
    from fo_kernels.schedule import Problem, Schedule
    from fo_kernels.tile import Tile
    from fo_tune.engines.triton.model import unit_ready_fractions
    from fo_tune.model.profiles import last_wave_share

    pp = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5, pingpong=True)

    def plan(m: int, n: int, k: int):
        units = -(-m // 128) * -(-n // 128)
        st = TritonSettings(tile=pp, sms_free=8, signal_tiles=1, groups=(units,), layout="row_band")
        s = Schedule(
            collective="all_reduce",
            dtype="bfloat16",
            world_size=1,
            problem=Problem(m=m, n=n, k=k),
            settings=st,
        )
        return make_plan(s, m, n, k, sm_count=132)

    # 512 tiles on 124 programs: 4 whole waves, 16 tail tiles in 4 parts on programs 0-63
    p = plan(2048, 4096, 4096)
    tail = tail_plan(p.num_tiles, p.grid, pp, p.k, p.m * p.n * p.k)
    assert (tail.main_tiles, tail.parts) == (496, 4)
    share = last_wave_share(tail, 64)
    length = 4 + share
    got = unit_ready_fractions(p, pp)
    assert got[500] == pytest.approx(share / length)  # a tail tile: after its parts
    assert got[0] == pytest.approx((1 + share) / length)  # program 0 ran a part first
    assert got[100] == pytest.approx(1 / length)  # program 100 did not
    assert got[3 * 124] == 1.0 and got[3 * 124 + 123] == pytest.approx(4 / length)
    # 2^34 multiply-adds: whole waves (no tail of its own), each tile ready when its wave ends
    whole = unit_ready_fractions(plan(1024, 8192, 2048), pp)
    assert whole[0] == pytest.approx(1 / 5) and whole[123] == pytest.approx(1 / 5) and whole[-1] == 1.0


def test_the_triton_model_against_the_shipped_trials(model):
    rows = [c for c in check_files(REPORTS, model) if c.engine == "triton"]
    assert len(rows) > 300
    assert mape(rows)[0] <= 0.15


def test_a_ring_timeline_is_ordered(model, h200):
    from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
    from fo_kernels.schedule import Problem, Schedule

    for collective in ("all_reduce", "reduce_scatter"):
        s = Schedule(
            collective=collective,
            dtype="bfloat16",
            world_size=2,
            problem=Problem(m=8192, n=8192, k=8192),
            settings=CopyEngineSettings(weights=(2, 2, 1)),
        )
        p = model.predict(s, 8192, 8192, 8192)
        assert p.engine == "copy_engine" and p.total_ms >= max(p.device_ms, p.host_ms) - 1e-12
        assert all(e >= r for e, r in zip(p.group_end_ms, p.group_ready_ms, strict=True))
        assert p.gemm_ms >= p.gemm_alone_ms  # beside copies a GEMM is slower
    assert chunk_rows(4096, (1, 1, 1, 1)) == [1024] * 4 and sum(chunk_rows(1000, (2, 1))) == 1000
    assert eager_ops("all_reduce", 2, 2) > eager_ops("reduce_scatter", 2, 2) > 0


def test_the_tiled_prediction_pulls_the_chunks_the_runtime_cuts(model):
    """The tiled mode's pulls are of the rows the runtime's plan cuts (``tile_row_bounds``), at a
    half of more than ROW_ALIGN tile rows per chunk, where whole-row rounding and tile-row cuts part."""
    import itertools

    from fo_kernels.engines.copy_engine import tile_row_bounds
    from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
    from fo_kernels.schedule import Problem, Schedule
    from fo_kernels.tile import Tile

    tile = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)  # (profiled)
    m, n, k, weights = 262144, 1024, 1024, (2, 1)
    s = Schedule(
        collective="reduce_scatter",
        dtype="bfloat16",
        world_size=2,
        problem=Problem(m=m, n=n, k=k),
        settings=CopyEngineSettings(mode="tiled", weights=weights, tile=tile),
    )
    p = model.predict(s, m, n, k)
    rows = [b - a for a, b in itertools.pairwise(tile_row_bounds(m // 2, weights, tile.block_m))]
    assert rows == [87424, 43648]  # (683 and 341 tile rows)
    term = model.term("copy_engine")
    want = [term.copy_ms(r * n * 2) for r in rows]
    assert p.group_comm_ms == pytest.approx(want, rel=1e-9)


def test_all_gather_terms_follow_their_pipelines(h200):
    """The all_gather terms (unvalidated: no all_gather was measured on GPUs) on a stand-in curve:
    the baseline gathers M x K bytes first; the copy engine's own rows go first and each pulled
    chunk's GEMM waits for its pull at the calibration's peer-copy rate; the Triton engine's first
    gather is exposed and every later one waits for the one before."""
    from fo_kernels.engines.copy_engine import plan_call
    from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
    from fo_kernels.engines.triton.settings import TritonSettings
    from fo_kernels.schedule import Problem, Schedule
    from fo_kernels.tile import Tile

    model = cost_model(with_all_gather_standin(h200))
    m, n, k = 8192, 8192, 8192
    base = model.baseline("all_gather", m, n, k, "bfloat16")
    assert base.comm_ms == model.curves.time(
        "all_gather", 0, m * k * 2
    ) and base.gemm_ms == model.library.time(m, n, k)
    head = dict(collective="all_gather", dtype="bfloat16", world_size=2, problem=Problem(m=m, n=n, k=k))
    term = model.term("copy_engine")
    p = h200.copy_engine.values()
    for weights in ((1,), (2, 2, 1)):
        s = Schedule(**head, settings=CopyEngineSettings(weights=weights))
        got = model.predict(s, m, n, k)
        rows = chunk_rows(m // 2, weights)
        assert len(got.group_comm_ms) == len(rows)  # one pull per chunk of the peer's shard
        for r, copy in zip(rows, got.group_comm_ms, strict=True):
            assert copy == pytest.approx(p["peer_copy_latency_ms"] + r * k * 2 / (p["peer_copy_gbs"] * 1e6))
        assert list(got.group_end_ms) == sorted(got.group_end_ms)
        # the own rows' GEMM, then every chunk's after its pull: no faster than the GEMM alone
        assert got.device_ms >= got.group_end_ms[-1] + model.library.time(rows[-1], n, k, fill=True)
        assert (
            got.device_ms >= model.library.time(m // 2, n, k, fill=True) and got.gemm_ms >= got.gemm_alone_ms
        )
        eager = term.predict(s, m, n, k, graphed=False).host_ms
        assert eager == pytest.approx(
            p["host_eager_op_ms"] * len(plan_call("ring", "all_gather", 2, 0, m, n, k, weights).ops)
        )
    tile = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
    st = TritonSettings(
        tile=tile, sms_free=24, nccl_max_ctas=16, signal_tiles=2 * 8 * 32, groups=(1, 3), layout="row_band"
    )
    got = model.predict(Schedule(**head, settings=st), m, n, k)
    assert got.engine == "triton" and len(got.group_end_ms) == 2
    assert got.exposed_comm_ms >= got.group_end_ms[0] >= got.group_comm_ms[0]  # nothing hides the first
    assert got.group_start_ms[1] >= got.group_end_ms[0]  # one gather after the other
    assert got.device_ms >= got.group_end_ms[0] + got.gemm_alone_ms


def test_the_offline_plan_of_the_suite_runs_what_the_measured_rows_run(h200):
    """The issue's bar: on >= 9 of the 10 suite cases predict picks the same engine and overlap
    decision as the shipped measured rows. The README's "Two commands" says more: the offline
    search picks the copy engine for all 10, as the measured rows run."""
    agree, engines = [], []
    for collective in ("all_reduce", "reduce_scatter"):
        table = next(load_table(t) for t in TABLES if t.name.startswith(collective))
        result = run_search(
            SearchRequest(shapes=tuple(SUITE), collective=collective, mode="predict", calibration=h200)
        )
        for r in result.shapes:
            measured = table.find_exact(*r.shape)
            agree.append((r.row.engine, r.row.overlap) == (measured.engine, measured.overlap))
            engines.append(r.row.engine)
    assert sum(agree) >= 9, agree
    assert engines == ["copy_engine"] * 10, engines


# ------------------------------------------------------------------------------------ model check
def test_model_check_defaults_and_reports(tmp_path):
    r = model_check()
    assert r.exit_code == 0, r.output
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("MAPE ") and last.endswith("over 58 measured rows"), last
    r = model_check(str(CALIBRATION_DIR / "copy_engine_tiled_probe.csv"), str(REPORTS[0].parent))
    assert r.exit_code == 0, r.output
    n = len(measured_in([CALIBRATION_DIR / "copy_engine_tiled_probe.csv", REPORTS[0]]))
    assert r.stdout.strip().splitlines()[-1].endswith(f"over {n} measured rows")
    # TABLES/*/* after a search: each table's lock file (empty) beside it is passed over
    table = shutil.copy(TABLES[0], tmp_path / TABLES[0].name)
    lock = lock_path(table)
    lock.touch()
    r = model_check(str(table), str(lock))
    assert r.exit_code == 0 and r.stdout.strip().splitlines()[-1].startswith("MAPE "), r.output
    assert "lock file" in assert_one_line_error(model_check(str(lock)))


def test_model_check_counts_only_the_rows_it_priced_and_says_why_the_others_are_not(tmp_path):
    """A trial the model cannot price (here a tile no calibration profiled) is left out of the MAPE
    and of its row count alike, and counted apart with the reason; the MAPE is the priced rows'."""
    import csv

    report = tmp_path / "report"
    shutil.copytree(REPORTS[0].parent, report)
    trials = report / "trials.csv"
    rows = list(csv.DictReader(trials.open()))
    old_tile = rows[0]["tile"].split()[0]
    rows[0] = {**rows[0], "tile": rows[0]["tile"].replace(old_tile, "16x16x16")}
    rows[0]["schedule"] = rows[0]["schedule"].replace(old_tile, "16x16x16")
    with trials.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    r = model_check(str(report))
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    total = len(measured_in([trials]))
    checked = check_files([trials], cost_model(load_calibration(CALIBRATION_DIR / "calibration.yaml")))
    mean, worst = mape(checked)
    assert lines[-1] == (
        f"MAPE {mean:.1%} (worst {worst:.1%}) over {total - 1} measured rows; "
        "1 more the model could not price (why: above)"
    ), lines[-1]
    assert lines[-2].startswith("not priced: 1 row(s) (e.g. trials.csv trial 0 "), lines[-2]


def test_model_check_bad_input(tmp_path, h200):
    assert "nope.yaml" in assert_one_line_error(model_check(str(tmp_path / "nope.yaml")))
    (tmp_path / "x.txt").write_text("hello")
    assert "expected a table" in assert_one_line_error(model_check(str(tmp_path / "x.txt")))
    (tmp_path / "empty.csv").write_text("a,b\n1,2\n")
    assert "trials.csv" in assert_one_line_error(model_check(str(tmp_path / "empty.csv")))
    (tmp_path / "empty").mkdir()  # a folder that is no report: said so, not an OS error
    line = assert_one_line_error(model_check(str(tmp_path / "empty")))
    assert "a folder without a trials.csv" in line and "Errno" not in line, line
    runs = tmp_path / "runs"  # a report name's folder: its run folders are named
    shutil.copytree(REPORTS[0].parent, runs / "20260101T000000-host-1")
    line = assert_one_line_error(model_check(str(runs)))
    assert f"give one of them, e.g. {runs / '20260101T000000-host-1'}" in line, line
    moe = tmp_path / "moe-report"  # an MoE search's report folder: its table is named
    moe.mkdir()
    (moe / "summary.yaml").write_text("kind: fo-tune-moe-search-summary\ntable: /t/moe-w2-bfloat16.yaml\n")
    line = assert_one_line_error(model_check(str(moe)))
    assert "is an MoE search's report, which lists no trials; pass its table /t/moe-w2-bfloat16.yaml" in line
    cal = CALIBRATION_DIR / "calibration.yaml"
    assert f"is a calibration, not a table or report; pass it as --calibration {cal}" in (
        assert_one_line_error(model_check(str(cal)))
    )
    bare = tmp_path / "cal.yaml"
    save_calibration(dataclasses.replace(h200, copy_engine=None), bare)
    line = assert_one_line_error(model_check("--calibration", str(bare)))
    assert "copy_engine section" in line and "fo-tune calibrate" in line


def test_model_check_refuses_files_measured_on_another_machine(tmp_path):
    """A table or a search report measured on another machine than the calibration's (here a
    CPU's gloo ranks against the packaged H200 calibration) is one line naming both machines and
    the --calibration to pass; it printed -99.7% errors for a table and 'MAPE nan%' for a report."""
    from fo_kernels.table import save_table

    cpu = "cpu-x86_64-cccpu-8sm-w2-gloo"
    packaged = load_table(ROOT / "results" / "tables" / H200_KEY / "all_reduce-w2-bfloat16.yaml")
    table = tmp_path / cpu / "all_reduce-w2-bfloat16.yaml"
    save_table(
        dataclasses.replace(packaged, fingerprint=dataclasses.replace(packaged.fingerprint, device_key=cpu)),
        table,
    )
    report = tmp_path / "report"
    report.mkdir()
    shutil.copy(REPORTS[0], report / "trials.csv")
    summary = yaml.safe_load((REPORTS[0].parent / "summary.yaml").read_text())
    summary["fingerprint"]["device_key"] = cpu
    (report / "summary.yaml").write_text(yaml.safe_dump(summary))
    for path in (table, report):
        line = assert_one_line_error(model_check(str(path)))
        assert f"was measured on {cpu}" in line and f"is {H200_KEY}'s" in line, line
        assert f"pass --calibration of {cpu}" in line, line


def test_fit_free_recovers_a_parameter():
    from fo_tune.model.check import Checked

    truth = 0.37

    def evaluate(params):
        return [
            Checked("s", str(x), "", "", 1.0 + truth * x, 1.0 + params["clock_context"] * x)
            for x in range(1, 6)
        ]

    params, err = fit_free(evaluate, {"clock_context": 0.9}, ["clock_context"])
    assert params["clock_context"] == pytest.approx(truth, abs=0.01) and err < 0.01


def test_model_fit_writes_fitted_values_with_sources(tmp_path, h200):
    cal = tmp_path / "cal.yaml"
    shutil.copy(packaged_calibration(H200_KEY, 2), cal)
    table = next(t for t in TABLES if t.name.startswith("reduce_scatter"))
    r = CliRunner().invoke(
        app,
        [
            "model",
            "fit",
            "--calibration",
            str(cal),
            str(table),
            "--hold-out",
            "8192x14336",
            "--out",
            str(tmp_path / "o.yaml"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "copy_engine:" in r.stdout and "held out: MAPE" in r.stdout
    fitted = load_calibration(tmp_path / "o.yaml").copy_engine.params
    assert (
        "fo-tune model fit" in fitted["gather_exposed"].source
        and str(table) in fitted["gather_exposed"].source
    )
    assert fitted["peer_copy_gbs"] == h200.copy_engine.params["peer_copy_gbs"]  # measured: left alone
    bad = CliRunner().invoke(app, ["model", "fit", "--calibration", str(cal), "--hold-out", "8192-14336"])
    assert "--hold-out '8192-14336': expected NxK" in assert_one_line_error(bad)
    bad = CliRunner().invoke(app, ["model", "fit", "--calibration", str(cal), "--hold-out", "\u0668x8"])
    assert "expected NxK" in assert_one_line_error(bad)  # (an Arabic-Indic 8: digits are 0-9)
    summary = yaml.safe_load((tmp_path / "o.yaml").read_text())
    assert summary["schema_version"] == 2


def test_model_fit_refuses_what_would_fit_nothing_or_hold_out_nothing(tmp_path, h200):
    """Bad input to ``model fit`` ends with one line and exit 2 before the calibration is written:
    an --out it cannot write, a --hold-out or --hold-out-file that matches no row (a typo would
    silently hold out nothing), every row held out, no file to fit, nothing the calibration's
    sections fit. A --hold-out-file names its file by any path to it."""
    cal = tmp_path / "cal.yaml"
    shutil.copy(packaged_calibration(H200_KEY, 2), cal)
    before = cal.read_bytes()
    table = next(t for t in TABLES if t.name.startswith("reduce_scatter"))
    other = next(t for t in TABLES if t.name.startswith("all_reduce"))

    def fit(*args: str):
        return CliRunner().invoke(app, ["model", "fit", "--calibration", str(cal), *args])

    (tmp_path / "a-file").write_text("")
    line = assert_one_line_error(fit(str(table), "--out", str(tmp_path / "a-file" / "o.yaml")))
    assert "a-file is a file, not a folder" in line
    # an --out that is another kind of file (a table, a CSV) is never replaced by the calibration
    victim = tmp_path / "table.yaml"
    shutil.copy(table, victim)
    line = assert_one_line_error(fit(str(table), "--out", str(victim)))
    assert "exists and is not a calibration, so it is not replaced" in line, line
    assert victim.read_bytes() == table.read_bytes()
    line = assert_one_line_error(fit(str(table), "--out", str(tmp_path / "fit.csv")))
    assert "a calibration is YAML; give a file name ending in .yaml" in line, line
    assert "--hold-out 1x1: no measured row" in assert_one_line_error(fit(str(table), "--hold-out", "1x1"))
    line = assert_one_line_error(fit(str(table), "--hold-out-file", str(other)))
    assert "is not one of the files fitted" in line
    assert "is held out" in assert_one_line_error(fit(str(table), "--hold-out-file", str(table)))
    bare = tmp_path / "bare.yaml"
    save_calibration(dataclasses.replace(h200, copy_engine=None), bare)
    line = assert_one_line_error(
        CliRunner().invoke(app, ["model", "fit", "--calibration", str(bare), str(table)])
    )
    assert line.startswith("error: nothing to fit in")
    assert cal.read_bytes() == before  # nothing written by a refused fit
    # the same file, named relative and absolute, is held out; without a hold-out no held-out line
    rel = table.relative_to(ROOT)
    shutil.copytree(table.parent, tmp_path / rel.parent)  # the working folder is tmp_path
    r = fit(str(rel), str(other), "--hold-out-file", str(tmp_path / rel), "--out", str(tmp_path / "o.yaml"))
    assert r.exit_code == 0, r.output
    assert "held out: MAPE" in r.stdout and "over 0 measured rows" not in r.stdout
    r = fit(str(table), "--out", str(tmp_path / "o.yaml"))
    assert r.exit_code == 0 and "held out" not in r.stdout, r.output


def test_model_fit_without_peer_measurements_fits_triton_and_refuses_another_machine(tmp_path, h200):
    """A calibration whose copy_engine section lacks the peer measurements (a CPU calibration: no
    peers to time) fits the Triton term's host times to Triton trials beside overlap: false rows,
    which the copy engine's parameters would fit through a term it cannot build; a file measured
    on another machine is refused as ``model check`` refuses it, the calibration left alone."""
    from fo_kernels.table import save_table

    section = h200.copy_engine
    params = {k: v for k, v in section.params.items() if k != "peer_copy_gbs"}
    cal = tmp_path / "cal.yaml"
    save_calibration(dataclasses.replace(h200, copy_engine=dataclasses.replace(section, params=params)), cal)
    packaged = load_table(next(t for t in TABLES if t.name.startswith("all_reduce")))
    table = tmp_path / "all_reduce-w2-bfloat16.yaml"
    save_table(dataclasses.replace(packaged, rows=[r for r in packaged.rows if not r.overlap]), table)
    report = next(p.parent for p in REPORTS if p.parent.name == "all_reduce-w2-bfloat16-hybrid")

    def fit(*args: str):
        return CliRunner().invoke(app, ["model", "fit", "--calibration", str(cal), *args])

    r = fit(str(table), str(report), "--out", str(tmp_path / "o.yaml"))
    assert r.exit_code == 0, r.output
    assert "triton: host_launch_ms" in r.stdout and "copy_engine:" not in r.stdout, r.stdout
    line = assert_one_line_error(fit(str(table)))  # overlap: false rows alone: nothing to fit
    assert "nothing to fit in" in line and "cannot price" in line, line
    other = tmp_path / "other.yaml"
    fp = dataclasses.replace(h200.fingerprint, device_key="nvidia-h200-cc90-132sm-w3-nvlink18", world_size=3)
    save_calibration(dataclasses.replace(h200, fingerprint=fp), other)
    before = other.read_bytes()
    r = CliRunner().invoke(app, ["model", "fit", "--calibration", str(other), str(report)])
    line = assert_one_line_error(r)
    assert f"was measured on {H200_KEY}" in line and "nvidia-h200-cc90-132sm-w3-nvlink18's" in line, line
    assert other.read_bytes() == before


def test_a_predict_search_into_the_user_folder_leaves_the_measured_rows_in_charge(tmp_path, monkeypatch):
    """The issue's bar: after the README's main job on a CPU-only machine (predicted rows into the
    default user folder), the runtime's row for a suite shape is still the packaged measured one."""
    monkeypatch.delenv("FO_TUNE_TABLE_DIR")
    r = CliRunner().invoke(app, ["search", "--shape", "4096x8192x4096", "-c", "all_reduce,reduce_scatter"])
    assert r.exit_code == 0, r.output
    user = tmp_path / "env" / "xdg" / "fo-tune" / "tables" / H200_KEY
    assert {p.name for p in user.glob("*.yaml")} == {
        "all_reduce-w2-bfloat16.yaml",
        "reduce_scatter-w2-bfloat16.yaml",
    }
    for collective in ("all_reduce", "reduce_scatter"):
        assert (
            load_table(user / f"{collective}-w2-bfloat16.yaml").find(4096, 8192, 4096).provenance["mode"]
            == "predict"
        )
        got = CliRunner().invoke(
            app, ["table", "lookup", "--shape", "4096x8192x4096", "-c", collective, "-k", H200_KEY]
        )
        assert got.exit_code == 0, got.output
        answer = yaml.safe_load(got.stdout)
        packaged = ROOT / "results" / "tables" / H200_KEY / f"{collective}-w2-bfloat16.yaml"
        assert Path(answer["source"]).resolve() == packaged.resolve() and answer["kind"] == "measured"
        assert answer["row"]["provenance"]["mode"] == "hybrid"
    # the model has nothing to check in its own predictions: the line says which files it can check
    line = assert_one_line_error(model_check(*map(str, sorted(user.glob("*.yaml")))))
    assert "no measured row or trial" in line and "leave the files out" in line, line


def test_model_check_and_fit_price_fp8_trials_on_the_fp8_gemm_profile(tmp_path):
    """An fp8 search's trials are priced on the calibration's fp8 GEMM profile (what the search
    predicted them with), not its bfloat16 one: `model check` of a CPU machine's fp8 hybrid report
    printed 181% where the search's own MAPE was 37%, and `model fit` fitted host times to that."""
    import csv

    cal = load_calibration(CALIBRATION_DIR / "calibration.yaml")
    # an fp8 profile of the same tiles at half the bfloat16 times: fp8 trials priced apart
    cal.gemm_dtypes = {"float8_e4m3fn": [dataclasses.replace(p, time_ms=p.time_ms / 2) for p in cal.gemm]}
    save_calibration(cal, tmp_path / "calibration.yaml")
    rows = list(csv.DictReader(REPORTS[0].open()))
    trials = tmp_path / "report" / "trials.csv"
    trials.parent.mkdir()
    with trials.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "dtype": "float8_e4m3fn"} for r in rows)
    fp8 = check_files([trials], cost_model(cal.for_dtype("float8_e4m3fn")))
    bf16 = check_files([trials], cost_model(cal))
    assert mape(fp8) != mape(bf16)
    r = model_check("--calibration", str(tmp_path / "calibration.yaml"), str(trials.parent))
    assert r.exit_code == 0, r.output
    mean, worst = mape(fp8)
    assert r.stdout.strip().splitlines()[-1].startswith(f"MAPE {mean:.1%} (worst {worst:.1%})"), r.stdout
    r = CliRunner().invoke(
        app,
        ["model", "fit", "--calibration", str(tmp_path / "calibration.yaml"), str(trials), "-o", "fit.yaml"],
    )
    assert r.exit_code == 0, r.output
    fit = [line for line in r.stdout.splitlines() if line.strip().startswith("fit: MAPE")]
    assert fit, r.stdout
    fitted = load_calibration(tmp_path / "fit.yaml")
    host = dict(cost_model(fitted).term("triton").host)
    model = cost_model(fitted.for_dtype("float8_e4m3fn"))
    assert dict(model.term("triton").host) == host
    mean, worst = mape(check_files([trials], model))
    assert fit[0].strip() == f"fit: MAPE {mean:.1%} (worst {worst:.1%}) over {len(fp8)} measured rows", fit


@pytest.mark.parametrize("text", ["", "- 1\n"])
def test_a_calibration_that_is_no_mapping_says_what_to_give(tmp_path, text):
    """An empty calibration file or a list: one line naming what to give, as every other broken
    calibration's does (it said only "expected a mapping at the top level")."""
    bad = tmp_path / "cal.yaml"
    bad.write_text(text)
    line = assert_one_line_error(model_check("--calibration", str(bad)))
    assert "give a calibration.yaml `fo-tune calibrate` wrote" in line, line
