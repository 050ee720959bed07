"""``fo-tune calibrate --only gemm --dtype float8_e4m3fn --from-profiles DIR --into FILE`` on the CPU:
committed one-GPU fp8 profiles of an H100 merged into a copy of the packaged H200 calibration,
refused without --into-sibling and for another die, recorded (``measured_on``) and named in the
basis of what reads them (``Calibration.for_dtype``) with it."""

from __future__ import annotations

import csv
import dataclasses
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error, isolate_tables
from fo_tune.calibrate.calibration import load_calibration, save_calibration

FP8 = "float8_e4m3fn"
H100_KEY = "nvidia-h100-80gb-hbm3-cc90-132sm-w1-single"
H100_PROFILES = Path(__file__).resolve().parents[1] / "results" / "profiles" / H100_KEY
# Two of the committed fp8 profiles (the smallest shapes), and files beside them that are not
# profiles of the tuner's fp8 scaling: a grids file, a tensorwise-scaled copy, a bf16 profile.
SHAPES = ("2048x4096x4096", "8192x4096x2048")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path / "env")


@pytest.fixture
def profiles(tmp_path) -> Path:
    folder = tmp_path / "profiles"
    folder.mkdir()
    for shape in SHAPES:
        shutil.copy(H100_PROFILES / f"{shape}-{FP8}.csv", folder)
    shutil.copy(H100_PROFILES / f"{SHAPES[0]}-{FP8}-grids.csv", folder)
    shutil.copy(H100_PROFILES / f"{SHAPES[0]}-{FP8}.csv", folder / f"16x16x16-{FP8}-tensorwise.csv")
    shutil.copy(H100_PROFILES / "4096x8192x3584-bfloat16.csv", folder)
    return folder


@pytest.fixture
def target(tmp_path, h200) -> Path:
    """A copy of the packaged H200 TP=2 calibration without any other dtype's GEMM profile."""
    path = tmp_path / "cal" / "calibration.yaml"
    path.parent.mkdir()
    save_calibration(dataclasses.replace(h200, gemm_dtypes={}), path)
    return path


def _rekey(path: Path, key: str) -> None:
    """``path``'s rows claimed for the GPU of device key ``key``."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "device_key": key} for r in rows)


def _merge(profiles: Path, target: Path, *extra: str):
    args = ["calibrate", "--world-size", "1", "--only", "gemm", "--dtype", FP8]
    return CliRunner().invoke(app, [*args, "--from-profiles", str(profiles), "--into", str(target), *extra])


def _rows(profiles: Path) -> int:
    return sum(len((profiles / f"{s}-{FP8}.csv").read_text().splitlines()) - 1 for s in SHAPES)


def test_a_sibling_profile_needs_the_flag_and_then_records_where(profiles, target, tmp_path, h200):
    before = target.read_bytes()
    line = assert_one_line_error(_merge(profiles, target))
    assert "gpu_name differs" in line and "pass --into-sibling" in line and H100_KEY in line, line
    assert target.read_bytes() == before
    result = _merge(profiles, target, "--into-sibling")
    assert result.exit_code == 0, result.output
    cal = load_calibration(target)
    points = cal.gemm_dtypes[FP8]
    assert {f"{p.m}x{p.n}x{p.k}" for p in points} == set(SHAPES) and len(points) == _rows(profiles)
    assert {p.measured_on for p in points} == {H100_KEY}
    assert cal.gemm == h200.gemm and cal.bandwidth == h200.bandwidth  # its own untouched
    again = tmp_path / "again.yaml"
    save_calibration(cal, again)
    assert again.read_bytes() == target.read_bytes()  # the file round-trips
    fp8 = cal.for_dtype(FP8)
    assert fp8.basis == f"{FP8} GEMM profile measured on {H100_KEY}, a sibling GPU"
    assert cal.for_dtype("bfloat16").basis == ""


def test_a_profile_of_the_calibrations_own_gpu_merges_without_a_basis(profiles, target):
    for shape in SHAPES:
        _rekey(profiles / f"{shape}-{FP8}.csv", "nvidia-h200-cc90-132sm-w1-single")
    result = _merge(profiles, target)
    assert result.exit_code == 0, result.output
    cal = load_calibration(target)
    assert {p.measured_on for p in cal.gemm_dtypes[FP8]} == {""}
    assert "measured_on" not in target.read_text().split("gemm_dtypes:")[1]  # written only where set
    assert cal.for_dtype(FP8).basis == ""


def test_another_die_is_refused_even_as_a_sibling(profiles, target):
    for shape in SHAPES:
        _rekey(profiles / f"{shape}-{FP8}.csv", "nvidia-h100-pcie-cc90-114sm-w1-single")
    before = target.read_bytes()
    line = assert_one_line_error(_merge(profiles, target, "--into-sibling"))
    assert line.startswith("error: --into-sibling: the calibration is for nvidia-h200"), line
    assert "(sm_count differs)" in line and target.read_bytes() == before


def test_profiles_of_two_gpus_are_refused_naming_both(profiles, target):
    _rekey(profiles / f"{SHAPES[1]}-{FP8}.csv", "nvidia-h200-cc90-132sm-w1-single")
    line = assert_one_line_error(_merge(profiles, target, "--into-sibling"))
    assert H100_KEY in line and "nvidia-h200-cc90-132sm-w1-single" in line, line


# --from-profiles with the rest of a valid merge (FP8_GEMM), one option changed or left out
FP8_GEMM = ["--dtype", FP8, "--only", "gemm"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*FP8_GEMM, "--from-profiles", "{empty}", "--into", "{cal}"], "no <M>x<N>x<K>"),
        ([*FP8_GEMM, "--from-profiles", "{missing}", "--into", "{cal}"], "no such folder"),
        ([*FP8_GEMM, "--from-profiles", "{cal}", "--into", "{cal}"], "a file, not a folder; pass the folder"),
        ([*FP8_GEMM, "--from-profiles", "{dir}", "--into", "{missing}"],
         "no such calibration file to merge into"),
        ([*FP8_GEMM, "--from-profiles", "{dir}", "--into", "{dir}"],
         "a folder, not a calibration file to merge into"),
        ([*FP8_GEMM, "--from-profiles", "{dir}"], "pass --into CALIBRATION.yaml"),
        (["--dtype", FP8, "--from-profiles", "{dir}", "--into", "{cal}"], "pass --only gemm"),
        ([*FP8_GEMM, "--only", "copy_engine", "--from-profiles", "{dir}", "--into", "{cal}"],
         "pass --only gemm"),
        (["--only", "gemm", "--from-profiles", "{dir}", "--into", "{cal}"], "another dtype than the"),
    ],
)  # fmt: skip
def test_misuse_is_one_line_and_leaves_the_file(profiles, target, tmp_path, args, needle):
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(profiles / "4096x8192x3584-bfloat16.csv", empty)  # a profile, of another dtype
    values = {"empty": empty, "missing": tmp_path / "nope", "dir": profiles, "cal": target}
    before = target.read_bytes()
    line = assert_one_line_error(
        CliRunner().invoke(app, ["calibrate", "--world-size", "1", *[a.format(**values) for a in args]])
    )
    assert needle in line, line
    assert target.read_bytes() == before


def test_help_explains_the_option():
    result = CliRunner().invoke(app, ["calibrate", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--from-profiles" in result.output
