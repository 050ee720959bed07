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
from cli_checks import assert_one_line_error, isolate_tables
from fo_kernels.table import load_table, row_kind
from fo_tune.calibration import load_calibration, save_calibration
from fo_tune.cli.search import packaged_calibration
from fo_tune.model import CostModel
from fo_tune.model.check import check_files, mape, measured_in
from fo_tune.model.copy_engine import chunk_rows, eager_ops
from fo_tune.model.fit import fit_free
from fo_tune.search import SearchRequest, run_search

ROOT = Path(__file__).resolve().parents[1]
H200_KEY = "nvidia-h200-cc90-132sm-w2-nvlink18"
TABLES = sorted((ROOT / "results" / "tables" / H200_KEY).glob("*.yaml"))
CALIBRATION_DIR = ROOT / "results" / "calibration" / H200_KEY / "tp2"
REPORTS = sorted((ROOT / "results" / "search" / H200_KEY).glob("**/trials.csv"))
SUITE = [(2048, 4096, 4096), (4096, 8192, 4096), (4096, 8192, 14336), (8192, 8192, 8192), (16384, 8192, 4096)]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path / "env")
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def h200():
    return load_calibration(packaged_calibration(H200_KEY, 2))


@pytest.fixture(scope="module")
def model(h200):
    return CostModel(h200)


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


def test_the_triton_model_against_the_shipped_trials(model):
    rows = [c for c in check_files(REPORTS, model) if c.engine == "triton"]
    assert len(rows) > 300
    assert mape(rows)[0] <= 0.15


def test_a_ring_timeline_is_ordered(model, h200):
    from fo_kernels.schedule import CopyEngineSettings, Problem, Schedule

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


def test_the_offline_plan_of_the_suite_runs_what_the_measured_rows_run(h200):
    """The issue's bar: on >= 9 of the 10 suite cases predict picks the same engine and overlap
    decision as the shipped measured rows."""
    agree = []
    for collective in ("all_reduce", "reduce_scatter"):
        table = next(load_table(t) for t in TABLES if t.name.startswith(collective))
        result = run_search(
            SearchRequest(shapes=tuple(SUITE), collective=collective, mode="predict", calibration=h200)
        )
        for r in result.shapes:
            measured = table.find_exact(*r.shape)
            agree.append((r.row.engine, r.row.overlap) == (measured.engine, measured.overlap))
    assert sum(agree) >= 9, agree


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


def test_model_check_bad_input(tmp_path, h200):
    assert "nope.yaml" in assert_one_line_error(model_check(str(tmp_path / "nope.yaml")))
    (tmp_path / "x.txt").write_text("hello")
    assert "expected a table" in assert_one_line_error(model_check(str(tmp_path / "x.txt")))
    (tmp_path / "empty.csv").write_text("a,b\n1,2\n")
    assert "trials.csv" in assert_one_line_error(model_check(str(tmp_path / "empty.csv")))
    bare = tmp_path / "cal.yaml"
    save_calibration(dataclasses.replace(h200, copy_engine=None), bare)
    line = assert_one_line_error(model_check("--calibration", str(bare)))
    assert "copy_engine section" in line and "fo-tune calibrate" in line


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
    summary = yaml.safe_load((tmp_path / "o.yaml").read_text())
    assert summary["schema_version"] == 2


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
