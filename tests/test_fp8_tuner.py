"""The tuner in fp8 (``--dtype float8_e4m3fn``) on the CPU: another dtype's GEMM profile kept beside a
calibration (``gemm_dtypes``) and read through ``Calibration.for_dtype``; what the model moves (fp8
gathers, bfloat16 sums); the calibration request's and merge's rules; an offline predict search
writing an fp8 table the runtime returns; the refusal that names the command where a calibration has
no fp8 profile; the shipped calibration's fp8 plan, resting on a sibling GPU's profile."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from cli_checks import H200_KEY, assert_one_line_error, isolate_tables
from fo_kernels.table import load_table
from fo_tune.calibrate.calibration import CalibrationError, load_calibration, save_calibration
from fo_tune.calibrate.run import CalibrationRequest, CalibrationRequestError, check_mergeable, merge_into
from fo_tune.engines import cost_model

FP8 = "float8_e4m3fn"
# The synthetic fp8 profile of these tests: the shipped bf16 profile's times times this. A stand-in
# to exercise the plumbing, not a measurement (the H200 table puts torch._scaled_mm at
# 0.52-0.60 of bf16 cuBLAS); the tests never check the numbers it gives.
STANDIN_RATIO = 0.55


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path / "env")
    monkeypatch.chdir(tmp_path)


def with_fp8_standin(cal):
    """``cal`` with a stand-in fp8 GEMM profile (``STANDIN_RATIO``) in ``gemm_dtypes``."""
    points = [
        dataclasses.replace(p, time_ms=p.time_ms * STANDIN_RATIO, cublas_ms=p.cublas_ms * STANDIN_RATIO)
        for p in cal.gemm
    ]
    return dataclasses.replace(cal, gemm_dtypes={FP8: points})


@pytest.fixture
def fp8_calibration(tmp_path, h200) -> Path:
    path = tmp_path / "cal-fp8" / "calibration.yaml"
    path.parent.mkdir()
    save_calibration(with_fp8_standin(h200), path)
    return path


def test_for_dtype_reads_the_other_profile_with_the_same_communication(fp8_calibration, h200):
    cal = load_calibration(fp8_calibration)
    assert set(cal.gemm_dtypes) == {FP8} and cal.for_dtype("bfloat16") is cal
    fp8 = cal.for_dtype(FP8)
    assert fp8.dtype == FP8 and fp8.base_dtype == "bfloat16" and fp8.gemm_dtypes == {}
    assert math.isclose(fp8.library_ratio, STANDIN_RATIO, rel_tol=1e-9)
    assert fp8.bandwidth == cal.bandwidth and fp8.interference == cal.interference
    bf16, f8 = cost_model(h200), cost_model(fp8)
    # the library GEMM scales with the profiles' ratio; an AllReduce sums bfloat16 outputs (the
    # tables' out_dtype), so its collective moves what bf16's does
    base, base8 = (
        bf16.baseline("all_reduce", 4096, 8192, 4096, "bfloat16"),
        f8.baseline("all_reduce", 4096, 8192, 4096, FP8),
    )
    assert math.isclose(base8.comm_ms, base.comm_ms) and base8.gemm_ms < 0.7 * base.gemm_ms
    # the refusal names the file the calibration was read from, or for one read from no file the
    # command that writes one, never a placeholder
    with pytest.raises(CalibrationError, match=r"--only gemm --dtype float16 --into") as read:
        cal.for_dtype("float16")
    assert f"--into {fp8_calibration}" in str(read.value)
    with pytest.raises(CalibrationError) as unread:
        dataclasses.replace(cal, file=None).for_dtype("float16")
    folder = f"calibration-{h200.fingerprint.device_key}"
    assert f"`fo-tune calibrate --world-size 2 --out {folder}`" in str(unread.value)
    assert f"--dtype float16 --into {folder}/calibration.yaml" in str(unread.value)
    assert "CALIBRATION.yaml" not in str(read.value) + str(unread.value)


def test_fp8_calibrates_its_gemm_only_and_merges_beside(h200):
    with pytest.raises(CalibrationRequestError, match="measures the GEMM profile only") as refused:
        CalibrationRequest(world_size=2, dtype=FP8)
    # without a calibration to merge into, the commands that write one and merge into it
    assert (
        "`fo-tune calibrate --world-size 2 --out calibration-w2`, then `fo-tune calibrate --world-size 1 "
        f"--only gemm --dtype {FP8} --into calibration-w2/calibration.yaml`"
    ) in str(refused.value)
    CalibrationRequest(world_size=1, dtype=FP8, parts=("gemm",))
    with pytest.raises(CalibrationRequestError, match="--only gemm"):
        check_mergeable(h200, h200.fingerprint, FP8, ("gemm", "copy_engine"))
    check_mergeable(h200, h200.fingerprint, FP8, ("gemm",))
    measured = dataclasses.replace(h200, dtype=FP8, gemm=h200.gemm[:3], bandwidth=[])
    target = dataclasses.replace(h200, gemm_dtypes={})
    merged = merge_into(target, measured, ("gemm",))
    assert merged.gemm == h200.gemm and merged.bandwidth == h200.bandwidth  # its own untouched
    assert merged.gemm_dtypes == {FP8: h200.gemm[:3]}


def test_offline_fp8_search_writes_an_fp8_table(tmp_path, fp8_calibration):
    out = tmp_path / "o"
    for collective in ("all_reduce", "reduce_scatter"):
        r = CliRunner().invoke(
            app,
            ["search", "--dtype", FP8, "--shape", "4096x8192x4096", "-c", collective,
             "--calibration", str(fp8_calibration), "--out", str(out)],
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        table = load_table(out / "tables" / H200_KEY / f"{collective}-w2-{FP8}.yaml")
        row = table.find(4096, 8192, 4096)
        assert table.dtype == FP8 and row is not None and row.provenance["mode"] == "predict"
        assert row.dtype == FP8


def test_a_calibration_without_the_profile_names_the_fp8_profile_to_measure(tmp_path, h200):
    bare = tmp_path / "bare.yaml"
    save_calibration(dataclasses.replace(h200, gemm_dtypes={}), bare)
    r = CliRunner().invoke(
        app,
        ["search", "--dtype", FP8, "--shape", "4096x8192x4096", "--calibration", str(bare),
         "--out", str(tmp_path / "o")],
    )  # fmt: skip
    line = assert_one_line_error(r)
    assert f"fo-tune calibrate --world-size 1 --only gemm --dtype {FP8} --into" in line
    assert not (tmp_path / "o").exists()


def test_the_shipped_calibration_plans_fp8_offline_on_a_sibling_profile(tmp_path):
    """The packaged H200 calibration holds an fp8 GEMM profile measured on an H100 (merged with
    --from-profiles --into-sibling): a predicted fp8 plan runs without a GPU, and every row, at
    TP=2 and extrapolated to TP=4, says it rests on that sibling's profile."""
    sibling = f"{FP8} GEMM profile measured on nvidia-h100-80gb-hbm3-cc90-132sm-w1-single, a sibling GPU"
    for world in (2, 4):
        out = tmp_path / f"o{world}"
        r = CliRunner().invoke(
            app,
            ["search", "--mode", "predict", "--dtype", FP8, "--shape", "4096x8192x4096",
             "-c", "all_reduce", "--world-size", str(world), "--out", str(out)],
        )  # fmt: skip
        assert r.exit_code == 0, r.output
        assert sibling in " ".join(r.output.split())  # the printed basis line
        key = H200_KEY.replace("-w2-", f"-w{world}-")
        table = load_table(out / "tables" / key / f"all_reduce-w{world}-{FP8}.yaml")
        assert table.dtype == FP8 and table.rows
        assert all(row.basis.endswith(sibling) for row in table.rows), [r.basis for r in table.rows]
        assert all(
            row.basis.startswith("extrapolated from world size 2") == (world == 4) for row in table.rows
        )


@pytest.mark.parametrize(
    "args",
    [
        ["search", "--mode", "predict", "--shape", "16x8x8"],
        ["search", "--mode", "predict", "--shape", "4096x8192x4100", "--m-range", "1:64"],
        ["bench", "--world-size", "2", "-c", "all_reduce", "--shape", "64x60x64"],
        ["profile", "--shape", "64x64x40"],
    ],
)
def test_fp8_commands_refuse_n_or_k_the_fp8_ops_refuse(tmp_path, monkeypatch, args):
    """N and K not multiples of 16: the fp8 ops raise ShapeError for such a call, so search, bench
    and profile refuse the shape (exit 2, one line) before any rank starts or a row is written
    (bench and profile ran it and reported each variant's ShapeError as a failure, exit 1)."""
    isolate_tables(monkeypatch, tmp_path)
    out = tmp_path / "o" / ("p.csv" if args[0] == "profile" else "")
    line = assert_one_line_error(CliRunner().invoke(app, [*args, "--dtype", FP8, "--out", str(out)]))
    assert "needs N and K multiples of 16" in line, line
    assert not (tmp_path / "o").exists()


def test_fp8_profile_times_the_signalled_gemm_beside_scaled_mm(tmp_path):
    """``fo-tune profile --dtype float8_e4m3fn``: every config checked (rowwise-scaled fp8 operands
    against their dequantized float32 product) and timed beside torch._scaled_mm."""
    import csv

    out = tmp_path / "p" / "profile.csv"
    r = CliRunner().invoke(app, ["profile", "--dtype", FP8, "--shape", "32x48x64", "--out", str(out)])
    assert r.exit_code == 0, (r.output, r.exception)
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert rows and all(row["status"] == "ok" for row in rows)
    assert all(float(row["rel_err"]) < 1e-2 and float(row["cublas_ms"]) > 0 for row in rows)


def test_fp8_profile_measures_tensorwise_scales(tmp_path):
    """``--scaling tensorwise``: every config checked with 0-dim scales (the signalled GEMM and
    torch._scaled_mm given the same ones) and timed; the ranking's title names the scaling."""
    import csv

    out = tmp_path / "p" / "profile.csv"
    r = CliRunner().invoke(
        app,
        ["profile", "--dtype", FP8, "--scaling", "tensorwise", "--shape", "32x48x64", "--out", str(out)],
    )
    assert r.exit_code == 0, (r.output, r.exception)
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert rows and all(row["status"] == "ok" for row in rows)
    assert all(float(row["rel_err"]) < 1e-2 and float(row["cublas_ms"]) > 0 for row in rows)
    assert f"32x48x64 {FP8} tensorwise" in r.output


def test_tensorwise_scales_are_two_numbers_a_dropped_one_fails_the_check():
    """The tensorwise scales are 0-dim float32, not 1 and not equal, so the signalled GEMM given
    other scales than the reference's (the tuner's rowwise ones, or none) fails the profile's check."""
    import torch

    from fo_kernels.tile import Tile
    from fo_tune.ranks.gemm import GEMM_TOL, gemm_operands, gemm_runner, rel_err
    from fo_tune.ranks.scaled import SCALINGS, dequantized, scale_kwargs

    a, b = gemm_operands(32, 48, 64, FP8, torch.device("cpu"), seed=1)
    kw = scale_kwargs(a, b, "tensorwise")
    sa, sb = kw["scale_a"], kw["scale_b"]
    assert sa.dim() == sb.dim() == 0 and sa.dtype == sb.dtype == torch.float32
    assert sa.item() != 1 and sb.item() != 1 and sa.item() != sb.item()
    a32, b32 = dequantized(a, b, kw)
    ref = a32 @ b32
    tol = GEMM_TOL[FP8]
    assert rel_err(a32 @ b.float(), ref) > tol and rel_err(a.float() @ b32, ref) > tol  # a scale dropped
    tile = Tile(block_m=16, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1)
    run, _grid = gemm_runner(a, b, tile, 0, 4, kw)
    assert rel_err(run(), ref) < tol
    run_rowwise, _grid = gemm_runner(a, b, tile, 0, 4)  # the tuner's default scales, not the task's
    assert rel_err(run_rowwise(), ref) > tol
    with pytest.raises(ValueError, match="rowwise, tensorwise"):
        scale_kwargs(a, b, "columnwise")
    bf = a.to(torch.bfloat16), b.to(torch.bfloat16)
    assert all(scale_kwargs(*bf, scaling) == {} for scaling in SCALINGS)


def test_tensorwise_profiles_get_their_own_default_file():
    from fo_tune.calibrate.files import default_profile_path, grids_path

    rowwise = default_profile_path("dev", (32, 48, 64), FP8)
    tensorwise = default_profile_path("dev", (32, 48, 64), FP8, scaling="tensorwise")
    assert rowwise.name == f"32x48x64-{FP8}.csv" and rowwise.parent == tensorwise.parent
    assert tensorwise.name == f"32x48x64-{FP8}-tensorwise.csv"
    assert grids_path(tensorwise).name == f"32x48x64-{FP8}-tensorwise-grids.csv"


@pytest.mark.parametrize(
    ("dtype", "scaling", "named"),
    [("bfloat16", "tensorwise", "--dtype float8_e4m3fn"), (FP8, "columnwise", "rowwise, tensorwise")],
)
def test_profile_refuses_a_scaling_its_operands_cannot_take(tmp_path, dtype, scaling, named):
    out = tmp_path / "p" / "profile.csv"
    r = CliRunner().invoke(
        app, ["profile", "--dtype", dtype, "--scaling", scaling, "--shape", "32x48x64", "--out", str(out)]
    )
    line = assert_one_line_error(r)
    assert "--scaling" in line and named in line
    assert not out.parent.exists()
