"""The ``fo-tune`` CLI: help, the demo on spawned gloo ranks, and one-line errors with exit codes."""

from __future__ import annotations

import math

import pytest
import torch
import typer
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error, isolate_tables
from fo_kernels.errors import ShapeError, TableNotFoundError
from fo_tune.cli.common import parse_shape, run_cli
from fo_tune.demo import run_demo
from fo_tune.launch import LaunchError

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(autouse=True)
def _isolated_tables(tmp_path, monkeypatch):
    isolate_tables(monkeypatch, tmp_path)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_help_describes_the_product(runner):
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    for word in ("calibrate", "search", "table", "runtime", "demo"):
        assert word in result.output


def test_demo_help_says_what_it_checks(runner):
    result = runner.invoke(app, ["demo", "--help"])
    assert result.exit_code == 0, result.output
    for word in (
        "matmul + collective",
        "gloo",
        "NCCL",
        "interpreter",
        "--world-size",
        "--shape",
        "--dtype",
        "--backend",
        "--reps",
        "--timeout",
    ):
        assert word in result.output, word


def test_demo_two_ranks_passes_both_collectives(runner):
    result = runner.invoke(app, ["demo", "--world-size", "2", "--shape", "34x20x9", "--reps", "1"])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = [line for line in result.stdout.splitlines() if "34x20x9" in line and "PASS" in line]
    assert len(rows) == 2, result.stdout
    assert any("all_reduce" in r for r in rows) and any("reduce_scatter" in r for r in rows)
    assert "passed: 2 of 2" in result.stdout


@pytest.mark.parametrize("shape", ["12x0x5", "abc", "12x5", "-1x2x3"])
def test_demo_bad_shape_is_one_line_exit_2(runner, shape):
    line = assert_one_line_error(runner.invoke(app, ["demo", "--shape", shape]))
    assert "--shape" in line


@pytest.mark.skipif(GPUS >= 2, reason="two GPUs are visible, so NCCL with 2 ranks is valid here")
def test_demo_nccl_without_gpus_is_one_line_exit_2(runner):
    line = assert_one_line_error(runner.invoke(app, ["demo", "--world-size", "2", "--backend", "nccl"]))
    assert "NCCL" in line and "GPU" in line


@pytest.mark.parametrize(
    "args", [["--dtype", "int8"], ["--backend", "mpi"], ["--reps", "0"], ["--world-size", "0"]]
)
def test_demo_bad_options_are_one_line_exit_2(runner, args):
    line = assert_one_line_error(runner.invoke(app, ["demo", *args]))
    assert args[0] in line


def test_debug_variable_shows_the_traceback(runner, monkeypatch):
    monkeypatch.setenv("FO_TUNE_DEBUG", "1")
    result = runner.invoke(app, ["demo", "--shape", "abc"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr


def _raise(exc: BaseException):
    def fn():
        raise exc

    return fn


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ShapeError("bad shape"), 2),
        (TableNotFoundError("no table"), 2),
        (LaunchError("rank 1 failed:\nTraceback (most recent call last):\n  ...\nValueError: boom"), 1),
        (KeyError("oops"), 1),
    ],
)
def test_run_cli_maps_errors_to_one_line(capsys, exc, code):
    with pytest.raises(typer.Exit) as info:
        run_cli(_raise(exc))
    assert info.value.exit_code == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and "Traceback" not in err
    if isinstance(exc, LaunchError):
        assert "rank 1 failed" in err and "ValueError: boom" in err


def test_parse_shape():
    assert parse_shape("4096x8192x4096") == (4096, 8192, 4096)
    assert parse_shape(" 3X4x5 ") == (3, 4, 5)
    for bad in ("", "1x2", "1x2x3x4", "0x1x1", "axbxc", "1.5x2x3"):
        with pytest.raises(typer.BadParameter):
            parse_shape(bad)


def test_run_demo_three_ranks():
    rows = run_demo(
        world_size=3,
        shapes=[(36, 20, 9), (35, 12, 7)],
        dtype="float32",
        backend="gloo",
        reps=1,
        timeout_s=300,
    )
    assert [(r.collective, r.m) for r in rows] == [
        ("all_reduce", 36),
        ("reduce_scatter", 36),
        ("all_reduce", 35),
        ("reduce_scatter", 35),
    ]
    for row in rows[:3]:
        assert row.passed and not row.skipped and not row.has_nan, row
        assert row.rel_err < 1e-5 and row.world_size == 3 and row.backend == "gloo"
        assert row.schedule_source == "heuristic"  # no table in the isolated folders
        assert row.overlapped_ms > 0 and row.sequential_ms > 0 and row.speedup > 0
    skipped = rows[3]
    assert skipped.skipped and skipped.status == "SKIP" and "divisible" in skipped.reason
    assert math.isnan(skipped.rel_err)


def test_run_demo_rejects_bad_input_before_spawning():
    with pytest.raises(ShapeError, match="int8"):
        run_demo(world_size=2, shapes=[(8, 8, 8)], dtype="int8", backend="gloo")
    with pytest.raises(ShapeError):
        run_demo(world_size=2, shapes=[(8, 0, 8)], dtype="float32", backend="gloo")
