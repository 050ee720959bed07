"""``fo-tune calibrate`` and ``fo-tune profile`` end to end on gloo ranks, and the report files."""

from __future__ import annotations

import contextlib
import csv
import math
import os
import signal
import threading
import time
import types
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error, isolate_tables
from fo_kernels.fingerprint import current_fingerprint
from fo_kernels.tile import Tile
from fo_tune.calibrate import files as report
from fo_tune.calibrate.calibration import (
    CALIBRATED_COLLECTIVES,
    CALIBRATION_SCHEMA_VERSION,
    BandwidthPoint,
    Calibration,
    CalibrationError,
    CurveFit,
    GemmPoint,
    InterferencePoint,
    MoeHost,
    fit_all,
    load_calibration,
    save_calibration,
)
from fo_tune.calibrate.files import check_calibration_out, write_calibration_dir, write_profile_csv
from fo_tune.cli.calibrate import CALIBRATED_NAMES
from fo_tune.output import OutputError
from fo_tune.space import packaged_spaces_dir

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
FILES = {
    "bandwidth.csv",
    "interference.csv",
    "gemm_profile.csv",
    "fits.csv",
    "calibration.yaml",
    "bandwidth.png",
    "interference.png",
}
BANDWIDTH_HEADER = [
    "collective",
    "nccl_max_ctas",
    "size_bytes",
    "time_ms",
    "spread_ms",
    "algbw_GBs",
    "busbw_GBs",
    "device_key",
]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def calibrate(*args: str):
    return CliRunner().invoke(app, ["calibrate", "--backend", "gloo", *args])


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``calibrate --world-size 2 --quick`` run that several tests read."""
    root = tmp_path_factory.mktemp("quick")
    with pytest.MonkeyPatch.context() as mp:
        isolate_tables(mp, root)
        out = root / "cal"
        result = calibrate("--world-size", "2", "--quick", "--out", str(out))
    return result, out


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]


# ------------------------------------------------------------------------------ calibrate, end to end
def test_quick_calibration_writes_every_file(quick_run):
    result, out = quick_run
    assert result.exit_code == 0, (result.output, result.exception)
    assert {p.name for p in out.iterdir()} == FILES
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary leftovers
    for name in ("bandwidth.png", "interference.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for word in ("bandwidth", "interference", "GEMM", "busbw", "slowdown", "cuBLAS", "wrote 7 files"):
        assert word in result.stdout, word


def test_quick_calibration_progress_goes_to_stderr(quick_run):
    """Piped, stdout holds the summary and the files written; the progress lines are on stderr."""
    result, _ = quick_run
    assert "s] start 2 ranks" in result.stderr, result.stderr
    assert "s] " not in result.stdout and "start 2 ranks" not in result.stdout, result.stdout


def test_quick_calibration_csv_columns(quick_run):
    _, out = quick_run
    key = current_fingerprint("cpu", 2).device_key
    header, rows = read_csv(out / "bandwidth.csv")
    assert header == BANDWIDTH_HEADER
    assert {r["collective"] for r in rows} == set(CALIBRATED_COLLECTIVES)
    for collective in CALIBRATED_COLLECTIVES:
        assert max(float(r["busbw_GBs"]) for r in rows if r["collective"] == collective) > 0
    assert {r["device_key"] for r in rows} == {key}
    for name, kind in (
        ("interference.csv", InterferencePoint),
        ("gemm_profile.csv", GemmPoint),
        ("fits.csv", CurveFit),
    ):
        header, rows = read_csv(out / name)
        # (a point's measured_on stays out: the device_key column says where rows were measured)
        assert header == [f.name for f in fields(kind) if f.name != "measured_on"] + ["device_key"], name
        assert rows and {r["device_key"] for r in rows} == {key}, name
    _, gemm = read_csv(out / "gemm_profile.csv")
    times = [float(r["time_ms"]) for r in gemm if r["status"] == "ok"]
    assert times and times == sorted(times)


def test_quick_calibration_yaml(quick_run):
    _, out = quick_run
    cal = load_calibration(out / "calibration.yaml")
    assert cal.schema_version == CALIBRATION_SCHEMA_VERSION
    assert cal.fingerprint == current_fingerprint("cpu", 2)
    assert cal.world_size == 2 and cal.quick and cal.dtype == "bfloat16" and cal.space == "default"
    assert {p.collective for p in cal.bandwidth} == set(CALIBRATED_COLLECTIVES)
    assert {(f.collective, f.nccl_max_ctas) for f in cal.fits} == {(c, 0) for c in CALIBRATED_COLLECTIVES}
    assert cal.interference
    for p in cal.interference:
        assert p.comm_slowdown > 0 and p.gemm_slowdown > 0
        assert not p.concurrent  # the CPU runs the two one after the other
    assert cal.gemm and all(p.status == "ok" and p.cublas_ms > 0 for p in cal.gemm)
    # moe_host: measured by rank 0 on a group of its own (the other rank made it with it), the
    # CPU's tiny experts; the summary shows it
    host = cal.moe_host
    assert host is not None and host.shapes == "cpu EP 1 at 8 tokens" and not host.measured_on
    assert 0 < host.phase1_ms < host.call_ms and 0 < host.phase2_ms < host.call_ms
    assert "MoE host times on one rank: phase 1 " in quick_run[0].stdout, quick_run[0].stdout


def test_a_calibration_folder_stands_for_its_yaml_and_another_folder_is_refused(quick_run, tmp_path):
    _, out = quick_run
    assert load_calibration(out) == load_calibration(out / "calibration.yaml")
    with pytest.raises(CalibrationError, match=r"is a folder, not a YAML file; name the file in it$"):
        load_calibration(tmp_path)


def test_three_ranks_two_collectives(tmp_path):
    out = tmp_path / "tp3"
    result = calibrate(
        "--world-size", "3", "--quick", "--only", "bandwidth", "--collectives", "all_reduce,reduce_scatter",
        "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    assert "bandwidth: 3 ranks, gloo on the CPU" in result.stdout, result.stdout
    assert "interference: not measured (not in --only)" in result.stdout, result.stdout
    assert "GEMM: best tile" not in result.stdout, result.stdout
    cal = load_calibration(out / "calibration.yaml")
    assert cal.world_size == 3 and cal.fingerprint.world_size == 3
    assert {p.collective for p in cal.bandwidth} == {"all_reduce", "reduce_scatter"}
    _, rows = read_csv(out / "bandwidth.csv")
    assert {r["collective"] for r in rows} == {"all_reduce", "reduce_scatter"}
    for r in rows:  # nccl-tests: busbw = algbw * 2(n-1)/n for all_reduce, (n-1)/n otherwise
        factor = 4 / 3 if r["collective"] == "all_reduce" else 2 / 3
        assert math.isclose(float(r["busbw_GBs"]), float(r["algbw_GBs"]) * factor, rel_tol=1e-4)


def test_default_out_then_a_rerun_replaces_the_folder(tmp_path, monkeypatch):
    """--only bandwidth wrote every part's files, the unmeasured ones empty, and a rerun into a
    folder holding a fuller calibration replaced its measured interference with nothing."""
    monkeypatch.chdir(tmp_path)
    args = ("--world-size", "2", "--quick", "--only", "bandwidth", "--collectives", "all_reduce")
    assert calibrate(*args).exit_code == 0
    out = Path("results/calibration") / current_fingerprint("cpu", 2).device_key / "tp2"
    bandwidth = {"bandwidth.csv", "fits.csv", "bandwidth.png", "calibration.yaml"}
    assert {p.name for p in out.iterdir()} == bandwidth  # only what it measured
    # an earlier calibration there with its interference measured: a rerun of the bandwidth keeps it
    write_calibration_dir(replace(_calibration(), dtype="bfloat16"), out)
    kept = {
        name: (out / name).read_bytes()
        for name in ("interference.csv", "interference.png", "gemm_profile.csv")
    }
    first = out.stat().st_ino
    (out / "fits.csv").unlink()  # the measured part's files all come anew
    second = calibrate(*args, "--out", str(out))
    assert second.exit_code == 0, (second.output, second.exception)
    assert out.stat().st_ino != first
    assert {p.name for p in out.iterdir()} == FILES
    assert {name: (out / name).read_bytes() for name in kept} == kept
    assert (
        "kept the earlier calibration's gemm_profile.csv, interference.csv, interference.png" in second.stdout
    )
    merged = load_calibration(out / "calibration.yaml")
    assert merged.interference == _calibration().interference
    assert {p.collective for p in merged.bandwidth} == {"all_reduce"}  # the new measurement's
    assert [p.name for p in out.parent.iterdir()] == ["tp2"]  # no .tmp- or .old- folder left
    # one in another dtype would lose its interference (one YAML, one dtype): refused before any rank
    line = assert_one_line_error(calibrate(*args, "--dtype", "float16", "--out", str(out)))
    assert "in bfloat16 whose interference this float16 run does not measure" in line


def test_a_rerun_merges_only_into_a_calibration_holding_more_than_it_measures(tmp_path):
    """A full rerun replaces a calibration of the same parts whole (a fresh one); what no such run
    measures (another dtype's GEMM profile, copy_engine_n's host times, model fit's triton
    section) makes it merge instead, and in another dtype be refused rather than dropped."""
    out, key = tmp_path / "cal", current_fingerprint("cpu", 2).device_key
    every = ("bandwidth", "interference", "gemm", "copy_engine")
    write_calibration_dir(_calibration(), out)
    assert report.earlier_calibration(out, key, "float32", ["bandwidth", "interference"]) is None
    assert report.earlier_calibration(out, key, "float32", ["bandwidth"]) == _calibration()
    fp8 = replace(_calibration(), gemm_dtypes={"float8_e4m3fn": [_gemm_point(1.0)]})
    write_calibration_dir(fp8, out)
    assert report.held(fp8) == ["bandwidth", "interference", "gemm_dtypes"]
    assert report.earlier_calibration(out, key, "float32", every) == fp8
    with pytest.raises(OutputError, match="whose gemm_dtypes this bfloat16 run does not measure"):
        report.earlier_calibration(out, key, "bfloat16", every)


# ------------------------------------------------------------------------------------- bad input
def test_unknown_collective_is_exit_2_naming_the_valid_ones(tmp_path):
    out = tmp_path / "never"
    line = assert_one_line_error(calibrate("--collectives", "all_reduce,all_sum", "--out", str(out)))
    assert "all_sum" in line and all(name in line for name in CALIBRATED_COLLECTIVES)
    assert not out.exists()


def test_cli_collective_names_match_the_library():
    assert CALIBRATED_NAMES == CALIBRATED_COLLECTIVES


@pytest.mark.skipif(GPUS >= 2, reason="two GPUs are visible, so NCCL with 2 ranks is valid here")
def test_nccl_without_enough_gpus_is_exit_2(runner, tmp_path):
    out = tmp_path / "never"
    args = ["calibrate", "--backend", "nccl", "--world-size", "2", "--out", str(out)]
    line = assert_one_line_error(runner.invoke(app, args))
    assert f"world size 2 needs 2 GPU(s), {GPUS} visible" in line and "--backend gloo" in line
    assert not out.exists()


def test_out_under_a_read_only_folder_is_exit_2(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anyway: make the check see what any other user would
        real = os.access
        monkeypatch.setattr(
            os,
            "access",
            lambda p, mode, **kw: False if Path(p) == locked and mode & os.W_OK else real(p, mode, **kw),
        )
    try:
        line = assert_one_line_error(calibrate("--out", str(locked / "a" / "cal")))
        assert "not writable" in line and str(locked) in line
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_out_that_is_a_file_is_exit_2(tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    line = assert_one_line_error(calibrate("--out", str(target)))
    assert "is a file" in line
    assert target.read_text() == "keep me" and [p.name for p in tmp_path.iterdir()] == ["file"]


def test_out_with_foreign_files_is_never_replaced(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = assert_one_line_error(calibrate("--out", str(out)))
    assert "notes.txt" in line
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_out_with_another_machines_calibration_is_never_replaced(tmp_path, h200):
    out = tmp_path / "h200"
    save_calibration(h200, out / "calibration.yaml")
    before = (out / "calibration.yaml").read_bytes()
    line = assert_one_line_error(calibrate("--quick", "--out", str(out)))
    assert f"holds the calibration of {h200.fingerprint.device_key}" in line
    assert (out / "calibration.yaml").read_bytes() == before
    with pytest.raises(OutputError, match="holds the calibration of"):  # the library's writer too
        write_calibration_dir(replace(h200, fingerprint=current_fingerprint("cpu", 2)), out)


def test_malformed_space_is_exit_2_naming_the_key(tmp_path):
    text = (packaged_spaces_dir() / "default.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("sms_free: [0, 8, 16, 24]", "sms_free: [0, -8]"))
    line = assert_one_line_error(calibrate("--space", str(bad), "--out", str(tmp_path / "never")))
    assert "sms_free[1]" in line and "bad.yaml" in line
    missing = assert_one_line_error(calibrate("--space", str(tmp_path / "nope.yaml")))
    assert "nope.yaml" in missing
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    "args", [["--dtype", "int8"], ["--backend", "mpi"], ["--world-size", "0"], ["--collectives", ","]]
)
def test_bad_options_are_exit_2(args):
    line = assert_one_line_error(calibrate(*args))  # a later --backend overrides calibrate()'s gloo
    assert args[0] in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--only", "gemm", "--collectives", "all_to_all"],
            "--only gemm measures neither: drop --collectives",
        ),
        (["--world-size", "1", "-c", "all_reduce"], "--world-size 1 measures neither: drop --collectives"),
        (["--only", "gemm", "--into", "{cal}", "--out", "{out}"], "so --out is not read: drop one of them"),
        (
            [
                "--only",
                "gemm",
                "--dtype",
                "float8_e4m3fn",
                "--into",
                "{cal}",
                "--from-profiles",
                "{out}",
                "--quick",
            ],
            "--from-profiles measures nothing and writes --into: drop --quick",
        ),
    ],
)
def test_an_option_the_run_would_not_read_is_exit_2(tmp_path, args, says):
    """--collectives where no part measures a collective, --out beside --into, and a measuring
    option beside --from-profiles are refused before any rank starts, not silently dropped."""
    cal = tmp_path / "calibration.yaml"
    cal.write_text("not read: the refusal comes first\n")
    values = {"cal": str(cal), "out": str(tmp_path / "out")}
    line = assert_one_line_error(calibrate(*[a.format(**values) for a in args]))
    assert says in line, line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------- profile
def test_profile_writes_a_csv_sorted_by_time(runner, tmp_path):
    out = tmp_path / "p" / "profile.csv"
    result = runner.invoke(app, ["profile", "--shape", "32x48x40", "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    header, rows = read_csv(out)
    # a point's measured_on stays out of the CSV: its device_key column says where rows were measured
    assert header == [f.name for f in fields(GemmPoint) if f.name != "measured_on"] + ["device_key", "timing"]
    assert "cublas_ms" in header and rows
    assert {r["timing"] for r in rows} == {"eager"}  # --timing auto: the CPU has no CUDA graphs
    assert {(r["m"], r["n"], r["k"]) for r in rows} == {("32", "48", "40")}
    assert {int(r["sms_free"]) for r in rows} == {0, 2}  # 0 and the cpu section's sms_free
    times = [float(r["time_ms"]) for r in rows if r["status"] == "ok"]
    assert len(times) == len(rows) and times == sorted(times)
    assert all(float(r["cublas_ms"]) > 0 for r in rows)
    assert {r["device_key"] for r in rows} == {current_fingerprint("cpu", 1).device_key}
    points, keys = report.read_profile_csv(out)  # read back as --from-profiles reads it
    assert keys == [current_fingerprint("cpu", 1).device_key] and len(points) == len(rows)
    assert [p.time_ms for p in points] == times and {p.measured_on for p in points} == {""}
    assert "cuBLAS" in result.stdout and str(out) in result.stdout.replace("\n", "")
    # progress off a terminal: each stage as a stderr line (the spinner alone printed nothing)
    assert "profiling 32x48x40: " in result.stderr and "timing the best of each grid" in result.stderr
    # each grid's fastest of its three best, re-timed side by side, next to the profile
    header, grids = read_csv(tmp_path / "p" / "profile-grids.csv")
    assert header[:6] == ["m", "n", "k", "sms_free", "grid", "tile"] and header[-1] == "device_key"
    assert [int(g["sms_free"]) for g in grids] == [0, 2] and {g["timing"] for g in grids} == {"eager"}
    for g in grids:
        ranked = sorted(
            (r for r in rows if r["sms_free"] == g["sms_free"]), key=lambda r: float(r["time_ms"])
        )
        assert int(g["candidates"]) == min(3, len(ranked)) and g["grid"] == ranked[0]["grid"]
        assert g["tile"] in [r["tile"] for r in ranked[:3]]
        assert float(g["time_ms"]) > 0 and float(g["cublas_ms"]) > 0 and float(g["rel_err"]) < 1e-2  # bf16
    full, reduced = grids
    assert float(full["over_share"]) == 1.0
    share = float(reduced["time_ms"]) / float(full["time_ms"]) / (int(full["grid"]) / int(reduced["grid"]))
    assert float(reduced["over_share"]) == pytest.approx(share, rel=1e-4)  # (the CSV keeps 6 digits)
    assert str(tmp_path / "p" / "profile-grids.csv") in result.stdout.replace("\n", "")
    # a profile of the full grid alone replaces this one: the grids CSV beside it is removed
    one_grid = tmp_path / "one-grid.yaml"
    default = (packaged_spaces_dir() / "default.yaml").read_text()
    one_grid.write_text(default.replace("  sms_free: [0, 2]\n", "  sms_free: [0]\n"))
    args = ["profile", "--shape", "32x48x40", "--out", str(out), "--space", str(one_grid)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert {r["sms_free"] for r in read_csv(out)[1]} == {"0"}
    assert not (tmp_path / "p" / "profile-grids.csv").exists() and "removed" in result.stdout


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        (
            "calibration.yaml",
            "kind: fo-tune-calibration\n",
            "a profile is a CSV; give a file name ending in .csv",
        ),
        (
            "bench.csv",
            "device_key,world_size,dtype,m,n,k\n",
            "exists and is not a profile `fo-tune profile` wrote",
        ),
        ("p-grids.csv", "something else\n", "the grids file beside it"),
    ],
)
def test_profile_out_never_replaces_a_file_it_did_not_write(runner, tmp_path, name, content, says):
    """--out naming another command's file (a calibration, a bench CSV), or a profile whose grids
    name is taken by another file, is exit 2 before any rank starts, the file left as it was."""
    (tmp_path / name).write_text(content)
    out = tmp_path / ("p.csv" if name == "p-grids.csv" else name)
    result = runner.invoke(app, ["profile", "--shape", "32x48x40", "--out", str(out)])
    line = assert_one_line_error(result)
    assert says in line, line
    assert (tmp_path / name).read_text() == content


@pytest.mark.parametrize("shape", ["0x1x1", "32x48", "axbxc"])
def test_profile_bad_shape_is_exit_2(runner, shape):
    line = assert_one_line_error(runner.invoke(app, ["profile", "--shape", shape]))
    assert "--shape" in line


def test_profile_of_a_gpu_sized_shape_without_gpus_is_exit_2_at_once(runner, tmp_path):
    """Hours in Triton's interpreter: refused before any rank starts, naming --allow-slow."""
    out = tmp_path / "p.csv"
    args = ["profile", "--backend", "gloo", "--shape", "1024x1024x1025", "--out", str(out)]
    line = assert_one_line_error(runner.invoke(app, args))
    assert "1024x1024x1025" in line and "--allow-slow" in line
    assert not out.exists()


@pytest.mark.parametrize("timing, says", [("graphs", "needs GPUs"), ("cudagraph", "is not one of")])
def test_profile_bad_timing_is_exit_2_before_any_work(runner, tmp_path, timing, says):
    """CUDA graphs on the CPU (gloo ranks), or an unknown --timing: one line, nothing written."""
    out = tmp_path / "p.csv"
    args = ["profile", "--shape", "32x48x40", "--timing", timing, "--out", str(out)]
    line = assert_one_line_error(runner.invoke(app, args))
    assert "--timing" in line and says in line, line
    assert not out.exists()


# ---------------------------------------------------------------------------------- report module
def _calibration() -> Calibration:
    fp = current_fingerprint("cpu", 2)
    cal = Calibration(fingerprint=fp, world_size=2, dtype="float32", space="t", quick=True, created="now")
    cal.bandwidth = [
        BandwidthPoint.measured(c, cap, size, 0.1 + size / 1e7, 0.01, 2)
        for c in ("all_reduce", "all_to_all")
        for cap in (0, 8)
        for size in (1 << 12, 1 << 16, 1 << 20)
    ]
    cal.fits = fit_all(cal.bandwidth)
    cal.interference = [
        InterferencePoint(
            collective="all_reduce",
            sms_free=r,
            nccl_max_ctas=cap,
            size_bytes=1 << 20,
            gemm_m=64,
            gemm_n=64,
            gemm_k=64,
            gemm_alone_ms=1.0,
            gemm_contended_ms=1.2,
            comm_alone_ms=0.2,
            comm_contended_ms=0.5,
            gemm_slowdown=1.2,
            comm_slowdown=2.5,
            comm_during_gemm=r > cap,
            concurrent=True,
        )
        for r, cap in ((8, 0), (16, 8), (16, 16))
    ]
    return cal


def _gemm_point(time_ms: float, status: str = "ok") -> GemmPoint:
    return GemmPoint(
        m=64,
        n=64,
        k=64,
        tile="t",
        block_m=32,
        block_n=32,
        block_k=32,
        group_m=2,
        num_warps=4,
        num_stages=1,
        warp_specialize=False,
        sms_free=0,
        grid=4,
        time_ms=time_ms,
        spread_ms=0.0,
        cublas_ms=0.5,
        rel_err=0.0,
        status=status,
    )


def test_a_failed_write_leaves_the_old_folder_untouched(tmp_path, monkeypatch):
    out = tmp_path / "cal"
    write_calibration_dir(_calibration(), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(cal, path):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "plot_interference", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_calibration_dir(_calibration(), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["cal"]
    # a new folder, and the folders made for it, disappear
    with pytest.raises(RuntimeError, match="disk full"):
        write_calibration_dir(_calibration(), tmp_path / "new" / "deeper" / "cal")
    assert [p.name for p in tmp_path.iterdir()] == ["cal"]


def test_default_out_dir_and_summaries():
    cal = _calibration()
    assert report.default_out_dir(cal) == Path("results/calibration") / cal.fingerprint.device_key / "tp2"
    rows = report.bandwidth_summary(cal)
    assert [(r.collective, r.nccl_max_ctas, r.size_bytes) for r in rows] == [
        (c, cap, 1 << 20) for c in ("all_reduce", "all_to_all") for cap in (0, 8)
    ]
    # _calibration's points take 0.1 ms + size / (10 GB/s): the fit recovers both, and the busbw
    # at 1 MiB is its algbw times the bus factor (1 for all_reduce, 1/2 for all_to_all, 2 ranks)
    algbw = (1 << 20) / (0.1e-3 + (1 << 20) / 1e10) / 1e9
    assert [(r.latency_ms, r.bandwidth_gbs, r.busbw_gbs) for r in rows] == [
        (pytest.approx(0.1), pytest.approx(10.0), pytest.approx(algbw * factor))
        for factor in (1.0, 1.0, 0.5, 0.5)
    ]
    assert [(r.sms_free, r.nccl_max_ctas, r.comm_during_gemm) for r in report.interference_summary(cal)] == [
        (8, 0, True),
        (16, 8, True),
        (16, 16, False),
    ]
    best = report.gemm_summary([_gemm_point(2.0), _gemm_point(math.nan, "skipped: x"), _gemm_point(1.0)])
    assert best[0].best.time_ms == 1.0 and (best[0].measured, best[0].total) == (2, 3)


def test_write_profile_csv_sorts_skipped_last(tmp_path):
    points = [
        _gemm_point(math.nan, "skipped: OutOfResources: shared memory"),
        _gemm_point(3.0),
        _gemm_point(1.0),
    ]
    path = write_profile_csv(points, tmp_path / "a" / "p.csv", "key", "graphs")
    _, rows = read_csv(path)
    assert {r["timing"] for r in rows} == {"graphs"}
    assert [r["status"] for r in rows] == ["ok", "ok", "skipped: OutOfResources: shared memory"]
    assert [r["time_ms"] for r in rows] == ["1", "3", "nan"]
    assert [p.name for p in path.parent.iterdir()] == ["p.csv"]


def test_grids_are_confirmed_only_beside_a_measured_full_grid():
    """``confirm_grids`` times nothing (no pool needed) unless the full grid and another grid both
    have a measured config: skipped or NaN points do not count."""
    from fo_tune.calibrate.profile import confirm_grids

    reduced = replace(_gemm_point(1.0), sms_free=2, grid=2)
    assert confirm_grids(None, [_gemm_point(1.0)], "float32") == []  # one grid
    assert confirm_grids(None, [reduced], "float32") == []  # no full grid
    skipped = _gemm_point(math.nan, "skipped: OutOfResources: shared memory")
    assert confirm_grids(None, [skipped, reduced], "float32") == []
    assert _gemm_point(1.0).tile_config() == Tile(
        block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1
    )


def test_each_grid_keeps_the_fastest_of_its_candidates_timed_side_by_side():
    """The profile only nominates: each grid's three fastest profiled configs (no more) and cuBLAS
    are timed again in one run, and each grid keeps the fastest of its own in that run, whatever the
    profile ranked first; the SM share compares the reduced grid's pick with the full grid's."""
    from fo_tune.calibrate.profile import CONFIRM_CANDIDATES, CONFIRM_ROUNDS, confirm_grids
    from fo_tune.ranks.timing import Timing

    def point(group_m: int, sms_free: int, profiled: float) -> GemmPoint:
        return replace(_gemm_point(profiled), tile=f"gm{group_m}", group_m=group_m, sms_free=sms_free)

    # (group_m, sms_free) -> (profiled ms, re-timed ms): the profile's order is not the run's
    times = {(2, 0): (1.0, 1.3), (3, 0): (1.1, 1.0), (4, 0): (1.2, 1.2), (5, 0): (1.3, 0.1),
             (6, 2): (2.0, 2.4), (7, 2): (2.5, 2.1)}  # fmt: skip
    points = [point(gm, r, prof) for (gm, r), (prof, _) in times.items()]
    points.append(replace(point(8, 2, 0.5), status="skipped: OutOfResources"))

    class Pool:  # the pool's interface: run(task) -> one result per rank
        def __init__(self) -> None:
            self.tasks: list = []

        def run(self, task):
            self.tasks.append(task)
            rows = [
                dict(grid=4 - r, rel_err=0.001 * t.group_m, timing=Timing(times[(t.group_m, r)][1], 0.0, 3))
                for t, r in task.configs
            ]
            return [{"rows": rows, "cublas": Timing(0.9, 0.0, 3)}]

    pool = Pool()
    rows = confirm_grids(pool, points, "float32")
    (task,) = pool.tasks
    assert CONFIRM_CANDIDATES == 3 and task.reps == CONFIRM_ROUNDS
    assert [(t.group_m, r) for t, r in task.configs] == [(2, 0), (3, 0), (4, 0), (6, 2), (7, 2)]
    assert [(g.sms_free, g.tile, g.candidates) for g in rows] == [(0, "gm3", 3), (2, "gm7", 2)]
    assert [g.time_ms for g in rows] == [1.0, 2.1] and {g.cublas_ms for g in rows} == {0.9}
    assert rows[0].over_share == 1.0 and rows[1].over_share == pytest.approx(2.1 / 1.0 / (4 / 2))
    assert [g.rel_err for g in rows] == [0.003, 0.007]
    assert [g.tile for g in confirm_grids(Pool(), points, "float32", candidates=1)] == ["gm2", "gm6"]
    with pytest.raises(ValueError, match="candidates must be >= 1"):
        confirm_grids(Pool(), points, "float32", candidates=0)


@pytest.mark.parametrize("task", ["grids", "profile"])
def test_graphed_samples_are_checked_after_the_timed_calls(monkeypatch, task):
    """The output the timed calls wrote is checked again, poisoned before them: a replay that
    writes nothing (here a stand-in for ``capture_calls`` that issues no call; the CPU has no CUDA
    graphs) fails the grids' check and skips the profile's row, where replays that run the calls
    pass both."""
    import fo_tune.ranks.timing as timing
    from fo_tune.ranks.gemm import GemmGridsTask, GemmProfileTask
    from fo_tune.ranks.pool import RankContext

    tile = Tile(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
    ctx = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")

    def run(replays_call: bool):
        def capture(fn, calls, device):
            return (lambda: [fn() for _ in range(calls)]) if replays_call else (lambda: None)

        monkeypatch.setattr(timing, "capture_calls", capture)
        if task == "grids":
            return GemmGridsTask(32, 48, 40, ((tile, 0),), "float32", warmup=1, reps=2, graphs=True).run(ctx)
        return GemmProfileTask(32, 48, 40, (tile,), (0,), "float32", warmup=1, reps=2, graphs=True).run(ctx)

    good = run(replays_call=True)
    assert good["rows"][0]["rel_err"] < 1e-5 and good["rows"][0]["timing"].samples == 2
    if task == "grids":
        with pytest.raises(ValueError, match="after the timed calls: wrong result"):
            run(replays_call=False)
    else:
        row = run(replays_call=False)["rows"][0]
        assert row["status"].startswith("skipped: ValueError: wrong result"), row["status"]


def test_check_calibration_out(tmp_path):
    check_calibration_out(tmp_path / "new" / "deeper")  # created later
    check_calibration_out(tmp_path)  # empty: may be replaced
    (tmp_path / "bandwidth.csv").write_text("")
    check_calibration_out(tmp_path)  # an earlier calibration: may be replaced
    (tmp_path / "file").write_text("")
    for bad, why in (
        (tmp_path, r"holds files fo-tune did not write \(file\)"),
        (tmp_path / "file", "file is a file; give a folder"),
        (tmp_path / "file" / "below", "file is a file, not a folder"),
        (Path("."), r"--out \. is the current folder or above it"),
        (Path.cwd().parent, "is the current folder or above it"),
    ):
        with pytest.raises(OutputError, match=why):
            check_calibration_out(bad)


# --------------------------------------------------------------------------- the copy engine's section
def test_quick_calibration_measures_the_copy_engine_section(quick_run):
    """On the CPU: the library GEMM of the chunk shapes (paced and sustained) and the host times
    of the baselines; peer copies and flags need CUDA and are left out with why."""
    _, out = quick_run
    section = load_calibration(out / "calibration.yaml").copy_engine
    assert section is not None and section.library_gemm and not section.copies
    assert {p.beta for p in section.library_gemm} == {0, 1}
    assert all(p.paced_ms > 0 and p.sustained_ms > 0 for p in section.library_gemm)
    for name in ("library_wave_ms", "library_beta1_factor", "sequential_host_ms", "fallback_host_ms"):
        assert section.params[name].value > 0 and "fo-tune calibrate" in section.params[name].source, name
    assert "flag_ms" not in section.params and "peer_copy_gbs" not in section.params


def test_one_gpu_parts_merge_into_a_calibration(quick_run, tmp_path):
    _, out = quick_run
    target = tmp_path / "cal.yaml"
    target.write_bytes((out / "calibration.yaml").read_bytes())
    before = load_calibration(target)
    only = "copy_engine,moe_host"
    result = calibrate("--world-size", "1", "--quick", "--only", only, "--into", str(target))
    assert result.exit_code == 0, result.output
    assert "MoE host times on one rank: phase 1 " in result.stdout, result.stdout
    assert "merged copy_engine, moe_host into" in result.stdout, result.stdout
    after = load_calibration(target)
    # only the section and the MoE host times changed
    assert after.bandwidth == before.bandwidth and after.gemm == before.gemm
    assert after.interference == before.interference and after.fits == before.fits
    assert after.moe_host is not None and after.moe_host.shapes == "cpu EP 1 at 8 tokens"
    assert (
        after.copy_engine.params["library_wave_ms"].source
        != before.copy_engine.params["library_wave_ms"].source
    )
    assert "w1" in after.copy_engine.params["library_wave_ms"].source
    assert after.copy_engine.params["fallback_host_ms"] == before.copy_engine.params["fallback_host_ms"]


def test_collectives_of_another_world_size_are_not_merged_into_a_calibration(quick_run, tmp_path):
    """Bandwidth curves and interference describe the world size they were timed at: --into a
    calibration of another is exit 2 before any rank starts, the file left as it was. One-GPU
    parts (the default at world size 1) still merge into it."""
    _, out = quick_run
    target = tmp_path / "cal.yaml"
    target.write_bytes((out / "calibration.yaml").read_bytes())
    before = target.read_bytes()
    for only in (["--only", "bandwidth"], ["--only", "interference,gemm"], []):
        t0 = time.monotonic()
        line = assert_one_line_error(calibrate("--world-size", "3", "--quick", *only, "--into", str(target)))
        assert time.monotonic() - t0 < 10, "refused before the ranks start"
        assert "the calibration is for world size 2" in line and "measured at world size 3" in line, line
        assert "--world-size 2" in line, line
    assert target.read_bytes() == before
    result = calibrate("--world-size", "1", "--quick", "--into", str(target))
    assert result.exit_code == 0, result.output
    assert "merged gemm, copy_engine, moe_host into" in result.stdout, result.stdout
    assert load_calibration(target).bandwidth == load_calibration(out / "calibration.yaml").bandwidth


def test_the_moe_host_record_is_merged_where_measured_and_kept_where_not():
    """``--only moe_host --into``: the record replaces the target's, everything else kept; a merge
    of other parts keeps the target's record."""
    from fo_tune.calibrate.run import merge_into

    cal = _calibration()
    record = MoeHost(phase1_ms=0.2, phase2_ms=0.1, call_ms=0.9, shapes="cpu EP 1 at 8 tokens", reps=3)
    measured = replace(cal, bandwidth=[], interference=[], fits=[], moe_host=record)
    done = merge_into(_calibration(), measured, ("moe_host",))
    assert done == replace(_calibration(), moe_host=record)
    again = merge_into(done, replace(measured, moe_host=replace(record, call_ms=1.5)), ("moe_host",))
    assert again.moe_host.call_ms == 1.5
    kept = merge_into(again, replace(measured, moe_host=None), ("bandwidth", "moe_host"))
    assert kept.moe_host.call_ms == 1.5 and kept.bandwidth == []  # nothing measured: the record stays
    assert merge_into(kept, measured, ("bandwidth",)).moe_host.call_ms == 1.5
    assert report.held(kept) == ["interference", "moe_host"]


def test_the_moe_host_record_round_trips_and_a_malformed_one_is_refused(tmp_path):
    record = MoeHost(phase1_ms=0.2, phase2_ms=0.1, call_ms=0.9, shapes="cpu EP 1 at 8 tokens", reps=3)
    cal = replace(_calibration(), moe_host=record)
    save_calibration(cal, tmp_path / "c.yaml")
    assert load_calibration(tmp_path / "c.yaml").moe_host == record
    data = cal.to_dict()
    # (measured_on written only where set: a sibling's device key)
    assert data["moe_host"] == dict(phase1_ms=0.2, phase2_ms=0.1, call_ms=0.9, shapes=record.shapes, reps=3)
    older = {k: v for k, v in data.items() if k != "moe_host"}
    assert Calibration.from_dict(older).moe_host is None
    row = data["moe_host"]
    for bad, needle in (
        ({**row, "call_ms": "0.9"}, r"moe_host\.call_ms: expected float, got '0\.9'"),
        ({**row, "phase1_ms": -0.1}, r"moe_host\.phase1_ms: expected a positive time in ms, got -0\.1"),
        ({**row, "phase2_ms": math.nan}, r"moe_host\.phase2_ms: expected a positive time in ms"),
        ({**row, "reps": 0}, r"moe_host\.reps: expected a count >= 1"),
        ({**row, "extra": 1}, r"moe_host: missing \[\], unknown \['extra'\]"),
        ({k: v for k, v in row.items() if k != "call_ms"}, r"moe_host: missing \['call_ms'\]"),
        ([0.2, 0.1], r"moe_host: expected a mapping"),
    ):
        with pytest.raises(CalibrationError, match=needle):
            Calibration.from_dict({**data, "moe_host": bad}, source="c.yaml")
    # a misspelt top-level key is refused by name, not read as a part the file lacks
    misspelt = {("moe_hots" if k == "moe_host" else k): v for k, v in data.items()}
    with pytest.raises(CalibrationError, match=r"c\.yaml: unknown key\(s\) 'moe_hots'; .* moe_host"):
        Calibration.from_dict(misspelt, source="c.yaml")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--only", "bogus"], "--only 'bogus'"),
        (["--only", ","], "--only"),
        (["--world-size", "1", "--only", "bandwidth"], "world size 1 has none"),
        (["--into", "missing.yaml"], "missing.yaml"),
    ],
)
def test_copy_engine_options_bad_input(tmp_path, args, needle):
    assert needle in assert_one_line_error(calibrate(*args, "--out", str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


def test_merge_into_refuses_another_gpu():
    import dataclasses

    from fo_tune.calibrate.run import CalibrationRequestError, merge_into

    cal = _calibration()
    other = dataclasses.replace(cal, fingerprint=dataclasses.replace(cal.fingerprint, gpu_name="H100"))
    with pytest.raises(CalibrationRequestError, match="gpu_name differs"):
        merge_into(cal, other, ("copy_engine",))


def test_into_a_calibration_of_another_gpu_is_refused_before_any_rank_starts(tmp_path):
    """The shipped H200 calibration on this CPU: refused in seconds, from the local fingerprint, not
    after the measurement; the file is left as it was."""
    import time

    shipped = (
        Path(__file__).resolve().parents[1] / "results/calibration/nvidia-h200-cc90-132sm-w2-nvlink18/tp2"
    )
    shipped = shipped / "calibration.yaml"
    target = tmp_path / "cal.yaml"
    target.write_bytes(shipped.read_bytes())
    t0 = time.monotonic()
    line = assert_one_line_error(
        calibrate("--world-size", "1", "--only", "copy_engine", "--into", str(target))
    )
    assert "gpu_name differs" in line and "same GPU model" in line
    assert time.monotonic() - t0 < 30 and target.read_bytes() == shipped.read_bytes()


def test_chunk_shapes_and_library_fit():
    from fo_tune.calibrate.calibration import LibraryGemmPoint
    from fo_tune.engines.copy_engine.calibrate import chunk_shapes, fit_library_params

    shapes = chunk_shapes([(4096, 8192, 16384)], [1, 4], 2)
    assert shapes == [
        (4096, 8192, 16384, 0),
        (2048, 8192, 16384, 0),
        (2048, 8192, 16384, 1),
        (512, 8192, 16384, 0),
        (512, 8192, 16384, 1),
    ]
    # times of a wave model with 0.011 ms per 128x256 wave per 1024 K on 132 SMs (5 % more for beta 1)
    waves = {4096: 8, 2048: 4, 512: 1}
    points = [
        LibraryGemmPoint(
            m=m,
            n=n,
            k=k,
            beta=b,
            paced_ms=0.011 * waves[m] * 16 * (1.05 if b else 1.0),
            sustained_ms=0.011 * waves[m] * 16 * 1.2,
        )
        for m, n, k, b in shapes
    ]
    params = fit_library_params(points, 132, "a test")
    assert params["library_wave_ms"].value == pytest.approx(0.011, rel=1e-6)
    assert params["library_beta1_factor"].value == pytest.approx(1.05, rel=1e-6)
    assert params["clock_sustained_factor"].value == pytest.approx(1.2, rel=1e-6)


def test_all_to_all_is_calibrated_with_uneven_splits():
    """Every rank sends its whole buffer in 1 : 2 : ... : w shares; what rank s sends rank r is
    what r expects from s; the shares differ between pairs."""
    from fo_tune.ranks.collectives import uneven_splits

    for world in (2, 3, 8):
        splits = [uneven_splits(4096, world, r) for r in range(world)]
        for r, (send, recv) in enumerate(splits):
            assert sum(send) == 4096 and recv == [splits[s][0][r] for s in range(world)]
            assert len(set(send)) == world


def test_a_ctrl_c_while_a_finished_calibration_is_written_keeps_it(tmp_path, monkeypatch):
    """A Ctrl-C while the files of a finished calibration are written (its plots take a second or
    two) is held until they are: the calibration is kept, said on stderr, and the exit is 130."""
    from fo_tune.calibrate import files as cal_files
    from fo_tune.calibrate import run as cal_run

    plot = cal_files.plot_bandwidth

    def interrupted_plot(cal, path):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # a terminal's Ctrl-C
        time.sleep(0.05)  # (where it lands without the hold: the write is given up)
        plot(cal, path)

    monkeypatch.setattr(cal_run, "run_calibration", lambda request, reporter=None: _calibration())
    monkeypatch.setattr(cal_files, "plot_bandwidth", interrupted_plot)
    out = tmp_path / "cal"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = calibrate("--quick", "--dtype", "float32", "--out", str(out))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-2:] == [f"kept the calibration in {out}", "error: interrupted"]
    assert load_calibration(out / "calibration.yaml").bandwidth == _calibration().bandwidth


def test_a_ctrl_c_while_the_grids_are_timed_keeps_the_profile(runner, tmp_path, monkeypatch):
    """A Ctrl-C after the profile is written (while its grids are timed side by side): the profile
    stays, the line before ``error: interrupted`` says so, no grids CSV is left beside it."""
    from fo_tune.calibrate import profile as cal_profile
    from fo_tune.ranks import launch

    @contextlib.contextmanager
    def no_ranks(world_size, *, backend=None, purpose):  # (the profile itself is not the point)
        yield types.SimpleNamespace(backend="gloo"), current_fingerprint("cpu", 1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "fingerprinted_pool", no_ranks)
    monkeypatch.setattr(cal_profile, "profile_shape", lambda *args, **kwargs: [_gemm_point(1.0)])
    monkeypatch.setattr(cal_profile, "confirm_grids", interrupted)
    out = tmp_path / "p.csv"
    result = runner.invoke(app, ["profile", "--shape", "32x48x40", "--out", str(out)])
    assert result.exit_code == 130, result.output
    lines = [line for line in result.stderr.splitlines() if not line.startswith(("timing", "profiling"))]
    assert lines[-2:] == [f"kept the profile in {out}; its grids were not timed", "error: interrupted"]
    assert [float(r["time_ms"]) for r in read_csv(out)[1]] == [1.0]
    assert not (tmp_path / "p-grids.csv").exists()
