"""The ``fo-tune`` CLI: help, the demo on spawned gloo ranks, one-line errors with exit codes (bad
input refused in seconds, before any work), and output that keeps every number when it is not a
terminal."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error, isolate_tables
from fo_kernels.errors import ArgumentError, EnvironmentMismatchError, ShapeError, TableNotFoundError
from fo_kernels.schedule import COLLECTIVES, DTYPES, SHARDED_COLLECTIVES
from fo_kernels.table import MISS_SOURCE
from fo_tune.bench.demo import (
    COPY_ENGINE_BACKEND,
    DEFAULT_WORLD_SIZE,
    demo_inputs,
    plan_demo,
    run_copy_engine_demo,
    run_demo,
)
from fo_tune.cli.common import (
    COLLECTIVE_NAMES,
    CPU_WORLD_SIZE_LIMIT,
    DTYPE_NAMES,
    FILE_WIDTH,
    RUNTIME_COLLECTIVE_NAMES,
    SCALING_NAMES,
    SHARDED_COLLECTIVE_NAMES,
    _Console,
    fmt,
    parse_shape,
    summary_table,
)
from fo_tune.cli.errors import run_cli
from fo_tune.ranks.backend import MAX_CPU_WORLD_SIZE
from fo_tune.ranks.limits import INT32_MAX
from fo_tune.ranks.pool import LaunchError
from fo_tune.ranks.scaled import SCALINGS, TUNE_SCALING

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ROOT = Path(__file__).resolve().parents[1]
# Bad input ends within this long, start-up included (nothing is spawned or measured).
BAD_INPUT_S = 30.0


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


def test_search_help_keeps_the_postgres_extra(runner):
    """Typer renders the help with Rich markup, where an unescaped "[postgres]" reads as a style tag
    and vanishes: the help names the package that installs the driver (wherever the help wraps)."""
    result = runner.invoke(app, ["search", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "pip install 'psycopg[binary]'" in " ".join(result.output.split()), result.output


def test_search_help_puts_tables_and_reports_under_xdg_data_home(runner):
    """The search writes its tables and reports under $XDG_DATA_HOME when it is set, as it does its
    studies (kernels/table/paths.py, fo_tune/output.py); the help says so for each of them."""
    result = runner.invoke(app, ["search", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "else $XDG_DATA_HOME/fo-tune/tables, by default ~/.local/share/fo-tune/tables" in text
    assert "<pid>/ (under $XDG_DATA_HOME when set;" in text


def test_table_pull_help_puts_tables_under_xdg_data_home(runner):
    """table pull writes its tables under $XDG_DATA_HOME when it is set; its help says so."""
    result = runner.invoke(app, ["table", "pull", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.count("else $XDG_DATA_HOME/fo-tune/tables (by default ~/.local/share/fo-tune/tables)") == 2


@pytest.mark.parametrize(
    ("args", "says", "command"),
    [
        (["search", "--world-size", "abc"], "Invalid value for '--world-size'", "fo-tune search"),
        (["search", "--no-such-option"], "No such option: --no-such-option", "fo-tune search"),
        (["table", "validate"], "Missing argument 'PATH'", "fo-tune table validate"),
        (["table", "diff", "a.yaml"], "Missing argument 'B'", "fo-tune table diff"),
        (["no-such-command"], "No such command 'no-such-command'", "fo-tune"),
        (["search", "--shape"], "Option '--shape' requires an argument", "fo-tune search"),
        (["table", "lookup", "-s"], "Option '-s' requires an argument", "fo-tune table lookup"),
    ],
)
def test_usage_errors_are_one_line(runner, args, says, command):
    """An error click finds while parsing is one line on stderr naming the --help of its command
    that explains, exit 2, as every other user error (not typer's usage line, hint and framed
    panel); an option missing its value named `fo-tune COMMAND --help`."""
    line = assert_one_line_error(runner.invoke(app, args))
    assert says in line and f"(`{command} --help` explains the options)" in line, line


def test_a_group_without_a_command_prints_its_help(runner):
    result = runner.invoke(app, ["table"])
    assert result.exit_code == 2 and "fo-tune table" in result.output and "lookup" in result.output


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


def test_demo_two_ranks_passes_every_collective(runner):
    result = runner.invoke(app, ["demo", "--world-size", "2", "--shape", "34x20x9", "--reps", "1"])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = [line for line in result.stdout.splitlines() if "34x20x9" in line and "PASS" in line]
    assert len(rows) == 3, result.stdout
    for collective in COLLECTIVES:
        assert sum(f" {collective} " in r for r in rows) == 1, (collective, rows)
    assert "passed: 3 of 3" in result.stdout
    if GPUS == 0:  # the first line says where the ranks ran, and why
        assert result.stdout.startswith(
            "fo-tune demo: 2 ranks on the CPU (gloo, Triton's interpreter: no GPU"
        )
        # gloo ranks' own rows come from a measured search (without --mode it plans an H200)
        assert "tune the shape with `fo-tune search --mode measure`" in result.stdout


def test_demo_one_rank_names_no_search(runner):
    """At world size 1 every call is the GEMM alone and `fo-tune search` refuses --world-size 1,
    so the demo's schedules line names no search to run."""
    result = runner.invoke(app, ["demo", "--world-size", "1", "--shape", "8x8x8", "--reps", "1"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "passed: 3 of 3" in result.stdout, result.stdout
    assert "the GEMM alone: nothing to tune" in result.stdout and "fo-tune search" not in result.stdout


@pytest.mark.parametrize("where", [["--backend", "gloo"], ["--engine", "copy_engine"]])
def test_demo_fp8_passes_every_collective(runner, where):
    """``--dtype float8_e4m3fn``: the three ops with rowwise-scaled fp8 operands on 2 ranks (gloo,
    or the copy engine's protocol) within 2e-2 of the dequantized operands' float64 reference."""
    args = ["demo", "--world-size", "2", "--shape", "34x32x48", "--reps", "1", "--dtype", "float8_e4m3fn"]
    result = runner.invoke(app, [*args, *where])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = [line for line in result.stdout.splitlines() if "34x32x48" in line and "PASS" in line]
    assert len(rows) == 3 and "passed: 3 of 3" in result.stdout, result.stdout
    assert "float8_e4m3fn" in result.stdout


@pytest.mark.parametrize("engine, shape", [("auto", "32x24x32"), ("copy_engine", "32x32x24")])
def test_demo_fp8_shape_off_16_is_one_line_exit_2(runner, engine, shape):
    """fp8 N and K must be multiples of 16: refused before the first line, no rank started."""
    args = ["demo", "--dtype", "float8_e4m3fn", "--shape", shape, "--engine", engine]
    result = runner.invoke(app, args)
    line = assert_one_line_error(result)
    assert f"shape {shape}" in line and "multiples of 16" in line, line
    assert result.stdout == "", result.stdout


def test_an_echoed_argument_is_printed_as_given_not_as_an_emoji(runner):
    """A refused --m-range of 100:100 is echoed as typed: Rich printed its ":100:" as an emoji."""
    args = ["search", "--mode", "predict", "-w", "8", "--shape", "8192x8192x3584", "-c", "reduce_scatter"]
    line = assert_one_line_error(runner.invoke(app, [*args, "--m-range", "100:100"]))
    assert "--m-range 100:100: reduce_scatter needs LO and HI divisible by the world size 8" in line, line


def test_paths_with_brackets_are_printed_as_they_are(runner, tmp_path):
    """An --out folder whose name holds Rich's markup ("[red]", "[/]") is printed as it is: "[red]"
    was dropped from the table and report paths, and "[/]" ended the search in an internal error
    (exit 1) after its tables were written."""
    for name in ("x[red]y", "q[/]z"):
        out = tmp_path / name
        args = ["search", "--mode", "predict", "-w", "8", "--shape", "8192x8192x3584", "-c", "reduce_scatter"]
        result = runner.invoke(app, [*args, "--out", str(out)])
        assert result.exit_code == 0, result.output
        lines = [line for line in result.stdout.splitlines() if line.startswith(("table ", "report "))]
        assert len(lines) == 2 and all(f"{out}/" in line for line in lines), result.stdout


@pytest.mark.parametrize("shape", ["12x0x5", "abc", "12x5", "-1x2x3"])
def test_demo_bad_shape_is_one_line_exit_2(runner, shape):
    line = assert_one_line_error(runner.invoke(app, ["demo", "--shape", shape]))
    assert "--shape" in line


@pytest.mark.skipif(GPUS >= 2, reason="two GPUs are visible, so NCCL with 2 ranks is valid here")
def test_demo_nccl_without_gpus_is_one_line_exit_2(runner):
    line = assert_one_line_error(runner.invoke(app, ["demo", "--world-size", "2", "--backend", "nccl"]))
    assert "NCCL" in line and "GPU" in line


@pytest.mark.parametrize(
    "args",
    [
        ["--dtype", "int8"],
        ["--backend", "mpi"],
        ["--reps", "0"],
        ["--world-size", "0"],
    ],
)
def test_demo_bad_options_are_one_line_exit_2(runner, args):
    result = runner.invoke(app, ["demo", *args])
    line = assert_one_line_error(result)
    assert args[-2] in line
    assert result.stdout == "", result.stdout


def test_demo_shape_beyond_the_ranks_memory_is_refused_before_its_first_line(runner):
    result = _timed(runner, ["demo", "--backend", "gloo", "--shape", "100000x100000x100000"])
    line = assert_one_line_error(result)
    assert "shape 100000x100000x100000" in line and "give a smaller shape" in line, line
    assert result.stdout == "", result.stdout


def test_demo_shape_too_large_for_the_interpreter_is_refused_before_any_rank(runner):
    """A GPU-sized shape on gloo ranks would run for hours in Triton's interpreter: exit 2 at once
    (as bench and profile), naming --allow-slow; the copy engine, which needs no interpreter,
    refuses --allow-slow as an option it does not read."""
    result = _timed(runner, ["demo", "--backend", "gloo", "--shape", "32x48x40", "--shape", "2048x1024x1024"])
    line = assert_one_line_error(result)
    assert "--shape 2048x1024x1024 without GPUs" in line and "--allow-slow" in line, line
    assert result.stdout == "", result.stdout
    line = assert_one_line_error(runner.invoke(app, ["demo", "--engine", "copy_engine", "--allow-slow"]))
    assert "drop --allow-slow" in line, line


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


def test_run_cli_stops_quietly_when_stdout_is_a_closed_pipe(capsys, monkeypatch):
    """``fo-tune table list --json | head -1``: a write to stdout after its reader has gone is the
    end of the command (exit 1, nothing on stderr, stdout pointed at /dev/null for the last flush),
    not an internal error; a BrokenPipeError while stdout's reader is there (another pipe's) still
    is one."""
    read, write = os.pipe()
    with os.fdopen(write, "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        with pytest.raises(typer.Exit) as info:
            run_cli(_raise(BrokenPipeError(32, "Broken pipe")))
        assert info.value.exit_code == 1 and "internal error" in capsys.readouterr().err
        os.close(read)
        with pytest.raises(typer.Exit) as info:
            run_cli(_raise(BrokenPipeError(32, "Broken pipe")))
        assert info.value.exit_code == 1 and capsys.readouterr().err == ""
        out.write("more output\n")
        out.flush()  # (to /dev/null now: no second BrokenPipeError)


def test_parse_shape():
    assert parse_shape("4096x8192x4096") == (4096, 8192, 4096)
    assert parse_shape(" 3X4x5 ") == (3, 4, 5)
    for bad in ("", "1x2", "1x2x3x4", "0x1x1", "axbxc", "1.5x2x3", "\u0664x8x8"):  # (an Arabic-Indic 4)
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
        ("all_gather", 36),  # M is the gathered M: 12 rows a rank
        ("all_reduce", 35),
        ("reduce_scatter", 35),
        ("all_gather", 35),
    ]
    for row in rows[:4]:
        assert row.passed and not row.skipped and not row.has_nan, row
        assert row.rel_err < 1e-5 and row.world_size == 3 and row.backend == "gloo"
        assert row.schedule_source == MISS_SOURCE  # no table in the isolated folders: overlap: false
        assert row.overlapped_ms > 0 and row.sequential_ms > 0
        assert math.isnan(row.speedup)  # the same GEMM then collective as the baseline: no speedup
    for skipped in rows[4:]:
        assert skipped.skipped and skipped.status == "SKIP", skipped
        assert skipped.reason == "M=35 is not divisible by the world size 3"
        assert math.isnan(skipped.rel_err)


@pytest.mark.gpu
def test_run_demo_on_one_gpu_checks_every_collective():
    """World size 1 on one GPU: the three ops (all_gather a copy, then the GEMM) against float64."""
    rows = run_demo(world_size=1, shapes=[(4096, 8192, 4096), (130, 257, 70)], backend="nccl", reps=3)
    assert [(r.collective, r.m) for r in rows] == [(c, m) for m in (4096, 130) for c in COLLECTIVES]
    for row in rows:
        assert row.passed and not row.has_nan and row.dtype == "bfloat16" and row.backend == "nccl", row
        assert row.overlapped_ms > 0 and row.sequential_ms > 0, row


def test_run_demo_rejects_bad_input_before_spawning():
    with pytest.raises(ShapeError, match="int8"):
        run_demo(world_size=2, shapes=[(8, 8, 8)], dtype="int8", backend="gloo")
    with pytest.raises(ShapeError, match=r"shape \(8, 0, 8\): expected \(M, N, K\), integers >= 1"):
        run_demo(world_size=2, shapes=[(8, 0, 8)], dtype="float32", backend="gloo")
    # the library's own checks raise fo-tune's error types, which the CLI maps to exit 2
    with pytest.raises(ArgumentError, match="reps must be an integer >= 1, got 0"):
        run_demo(world_size=2, shapes=[(8, 8, 8)], dtype="float32", backend="gloo", reps=0)
    with pytest.raises(ArgumentError, match="timeout_s must be a number > 0"):
        run_demo(world_size=2, shapes=[(8, 8, 8)], dtype="float32", backend="gloo", timeout_s=0.0)
    with pytest.raises(ArgumentError, match="reps must be an integer >= 1"):
        run_copy_engine_demo(2, [(8, 8, 8)], "float32", reps=0, backend=COPY_ENGINE_BACKEND)
    with pytest.raises(ArgumentError, match=f"at most {MAX_CPU_WORLD_SIZE} ranks"):
        run_copy_engine_demo(MAX_CPU_WORLD_SIZE + 1, [(64, 8, 8)], "float32", backend=COPY_ENGINE_BACKEND)


def test_cli_names_match_the_runtime():
    """The help texts' names (written in fo_tune.cli.common to keep --help light) are the runtime's
    and the tuner's; search and table take every collective the runtime runs (the search tunes all
    three)."""
    assert set(DTYPE_NAMES) == set(DTYPES) and RUNTIME_COLLECTIVE_NAMES == COLLECTIVES
    assert SCALING_NAMES == SCALINGS and SCALING_NAMES[0] == TUNE_SCALING
    assert COLLECTIVE_NAMES == COLLECTIVES and SHARDED_COLLECTIVE_NAMES == SHARDED_COLLECTIVES
    assert CPU_WORLD_SIZE_LIMIT == MAX_CPU_WORLD_SIZE


def test_search_takes_all_gather_and_refuses_another_name(runner, tmp_path):
    """--collective all_gather is searched (the packaged calibration cannot price it: one line
    naming the command that measures its curve); an unknown name lists the three."""
    out = tmp_path / "never"
    args = ["search", "--shape", "64x64x64", "-c", "all_gather", "--mode", "predict", "--out", str(out)]
    line = assert_one_line_error(_timed(runner, args))
    assert "no bandwidth curve for all_gather" in line, line
    assert "--collectives all_reduce,reduce_scatter,all_gather" in line, line
    args[4] = "all_to_all"
    line = assert_one_line_error(_timed(runner, args))
    assert "'all_to_all'" in line and "all_reduce, reduce_scatter, all_gather" in line, line
    assert not out.exists()


# ------------------------------------------------------------------------------ where the demo runs
@pytest.mark.parametrize(
    ("world", "backend", "gpus", "want", "says"),
    [
        (None, None, 0, (2, "gloo"), "no GPU visible"),
        (None, "auto", 2, (2, "nccl"), "one GPU each (NCCL)"),
        (None, None, 1, (1, "nccl"), "1 GPU visible: 1 rank, one GPU each (NCCL), instead of 2"),
        (None, None, 3, (2, "nccl"), "2 ranks, one GPU each"),
        (1, None, 1, (1, "nccl"), "1 rank, one GPU each"),
        (None, "gloo", 1, (2, "gloo"), "asked for with --backend gloo"),
        (3, "gloo", 0, (3, "gloo"), "3 ranks on the CPU"),
        (None, "nccl", 1, (1, "nccl"), "1 GPU visible"),
    ],
)
def test_plan_demo_says_where_it_runs(world, backend, gpus, want, says):
    """A one-GPU machine runs world size 1 on its GPU, never the GPU and the interpreter mixed."""
    plan = plan_demo(world, backend, gpus)
    assert (plan.world_size, plan.backend) == want and says in plan.note, plan


@pytest.mark.parametrize(
    ("world", "backend", "gpus"), [(2, None, 1), (2, "nccl", 1), (None, "nccl", 0), (4, "auto", 2)]
)
def test_plan_demo_refuses_too_few_gpus(world, backend, gpus):
    asked = world or DEFAULT_WORLD_SIZE
    with pytest.raises(
        EnvironmentMismatchError, match=rf"world size {asked} needs {asked} GPU\(s\), {gpus} visible \(NCCL"
    ) as info:
        plan_demo(world, backend, gpus)
    # the fix named fits: without a GPU, no --world-size (or leaving it out) makes NCCL run
    fix = f"lower --world-size to {gpus}" if gpus else "; use --backend gloo"
    assert fix in str(info.value) and (gpus or "world-size" not in str(info.value).split(";")[1]), info.value


@pytest.mark.parametrize(
    ("world", "backend", "match"),
    [
        (0, None, "--world-size: expected an integer >= 1, got 0"),
        ("2", None, "--world-size: expected an integer >= 1, got '2'"),
        (2, "mpi", "--backend 'mpi' is not one of auto, gloo, nccl"),
    ],
)
def test_plan_demo_refuses_bad_arguments_as_input_errors(world, backend, match):
    with pytest.raises(ArgumentError, match=match):
        plan_demo(world, backend, 0)


def test_demo_inputs_refuse_a_timeout_that_is_not_a_number():
    with pytest.raises(ArgumentError, match="timeout_s must be a number > 0, got '5'"):
        demo_inputs(plan_demo(2, "gloo", 0), None, None, 1, "5")


def test_demo_on_one_gpu_runs_world_size_1_on_it(runner, monkeypatch):
    """``fo-tune demo`` on a (faked) one-GPU machine: one NCCL rank on the GPU, said first."""
    from fo_tune.bench import demo as demo_lib
    from fo_tune.ranks import backend as rank_backend

    calls = []

    def fake_run_demo(world_size, shapes, dtype, backend, reps, timeout_s, **kwargs):
        calls.append((world_size, backend))
        return []

    monkeypatch.setattr(rank_backend, "visible_gpus", lambda: 1)
    monkeypatch.setattr(demo_lib, "run_demo", fake_run_demo)
    # (its checks of the GPU's memory need the GPU: the faked machine has none to ask)
    monkeypatch.setattr(demo_lib, "demo_inputs", lambda plan, *args, **kwargs: ([], demo_lib.GPU_DTYPE))
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert calls == [(1, "nccl")]
    assert result.stdout.startswith("fo-tune demo: 1 GPU visible: 1 rank, one GPU each (NCCL)")


def test_demo_spinner_is_on_stderr_and_stdout_holds_the_results(runner, monkeypatch):
    """The demo's "running N ranks" spinner is drawn on stderr (a terminal there), never on
    stdout, which a pipe or a file takes whole."""
    from rich.console import Console

    from fo_tune.bench import demo as demo_lib
    from fo_tune.cli import progress

    spun = io.StringIO()
    monkeypatch.setattr(progress, "err_console", Console(file=spun, force_terminal=True, width=100))
    monkeypatch.setattr(demo_lib, "run_demo", lambda *args, **kwargs: [])
    result = runner.invoke(app, ["demo", "--backend", "gloo", "--shape", "32x48x40"])
    assert result.exit_code == 0, result.output
    assert "running 2 ranks" in spun.getvalue(), spun.getvalue()
    assert "running" not in result.stdout, result.stdout


# ------------------------------------------------------------------------------ bad input, in seconds
@pytest.mark.parametrize("content", [b"x: [\n", b"\xff\xfe"])
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["profile", "--shape", "32x48x40", "--space", "{f}"], "; fix it, or give one of "),
        (["bench", "--suite", "{f}"], "; fix it, or give the shipped "),
        (["model", "check", "--calibration", "{f}"], "; give a calibration.yaml `fo-tune calibrate` wrote"),
        (
            ["calibrate", "--only", "gemm", "--into", "{f}"],
            "; give a calibration.yaml `fo-tune calibrate` wrote",
        ),
    ],
)
def test_a_malformed_or_binary_input_file_says_what_to_give(runner, tmp_path, content, args, says):
    """A search space, suite or calibration that is not valid YAML, or not text at all, is one line
    naming the file, why, and what to give instead."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    line = assert_one_line_error(_timed(runner, [a.format(f=bad) for a in args]))
    assert str(bad) in line and says in line, line


def _timed(runner, args):
    start = time.monotonic()
    result = runner.invoke(app, args)
    assert time.monotonic() - start < BAD_INPUT_S, args
    return result


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--backend", "gloo"],
        pytest.param(
            ["demo", "--engine", "copy_engine"],
            marks=pytest.mark.skipif(GPUS > 0, reason="a GPU runs virtual ranks, not thread-ranks"),
        ),
        ["bench", "--backend", "gloo", "--shape", "64x64x64"],
        ["profile", "--backend", "gloo", "--shape", "64x64x64"],
        ["calibrate", "--backend", "gloo", "--quick"],
        ["search", "--backend", "gloo", "--mode", "measure", "--shape", "64x64x64"],
    ],
)
def test_a_cpu_world_beyond_the_bound_is_refused_before_anything_starts(runner, tmp_path, args):
    """A mistyped --world-size on the CPU (gloo processes, thread-ranks) is one line and exit 2,
    nothing printed on stdout, instead of starting that many ranks; the bound is in the help."""
    out = tmp_path / "never"
    extra = [] if args[0] == "demo" else ["--out", str(out)]
    result = _timed(runner, [*args, "--world-size", str(MAX_CPU_WORLD_SIZE + 1), *extra])
    line = assert_one_line_error(result)
    assert f"--world-size {MAX_CPU_WORLD_SIZE + 1}: at most {MAX_CPU_WORLD_SIZE} ranks" in line, line
    assert result.stdout == "" and not out.exists()
    help_text = runner.invoke(app, [args[0], "--help"], env={"COLUMNS": "400"}).output
    assert f"at most {MAX_CPU_WORLD_SIZE} on the CPU" in help_text


def test_a_shape_that_cannot_exist_is_refused_at_once(runner, tmp_path):
    """The int32 bound of every size, and the target's memory (offline: the calibration's GPU)."""
    out = str(tmp_path / "out")
    args = ["search", "--shape", "99999999999x1x1", "-c", "all_reduce", "--world-size", "2", "--out", out]
    line = assert_one_line_error(_timed(runner, [*args, "--mode", "predict"]))
    assert "99999999999" in line and str(INT32_MAX) in line
    args = ["search", "--shape", "400000x400000x400000", "--mode", "predict", "--out", out]
    line = assert_one_line_error(_timed(runner, args))
    assert "960.0 GB in bfloat16" in line and "NVIDIA H200" in line
    for command in (
        ["bench", "--backend", "gloo"],
        ["demo", "--backend", "gloo"],
        ["profile", "--backend", "gloo"],
    ):
        line = assert_one_line_error(_timed(runner, [*command, "--shape", "99999999999x1x1"]))
        assert str(INT32_MAX) in line, (command, line)
    # a lookup of such a call: no call of that shape runs (it answered overlap: false, exit 0)
    line = assert_one_line_error(runner.invoke(app, ["table", "lookup", "--shape", "99999999999x8x8"]))
    assert str(INT32_MAX) in line, line
    line = assert_one_line_error(
        runner.invoke(app, ["table", "lookup", "-s", "64x24x32", "-d", "float8_e4m3fn"])
    )
    assert "multiples of 16" in line, line
    assert not Path(out).exists()


@pytest.mark.skipif(GPUS > 0, reason="the GPU suite runs on GPUs here")
def test_the_gpu_suite_on_the_cpu_is_refused_at_once(runner, tmp_path):
    out = tmp_path / "never"
    args = ["bench", "--suite", str(ROOT / "suites" / "h200_tp.yaml"), "--world-size", "2", "--out", str(out)]
    line = assert_one_line_error(_timed(runner, args))
    assert "h200_tp" in line and "interpreter" in line and "--allow-slow" in line and "64x96x64" in line
    line = assert_one_line_error(_timed(runner, ["bench", "--shape", "4096x8192x4096", "--out", str(out)]))
    assert "4096x8192x4096" in line and "--allow-slow" in line
    assert not out.exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux)")
@pytest.mark.parametrize(
    "args",
    [
        ["calibrate", "--backend", "gloo"],
        ["bench", "--backend", "gloo", "--shape", "8x8x8"],
        ["search", "--shape", "64x64x64", "--mode", "predict"],
        ["profile", "--backend", "gloo", "--shape", "32x48x40", "--out", "/proc/x/profile.csv"],
        ["search", "--shape", "64x64x64", "--mode", "predict", "--table-dir", "/proc/x"],
        # a journal storage's file, refused as a SQLite one's is (exit 2, not an internal error)
        ["search", "--shape", "64x64x64", "--mode", "measure", "--storage", "journal:/proc/x.log"],
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_any_work(runner, args):
    """Every --out (and search's --table-dir, a storage file) is checked with a real write: /proc
    passes root's permission checks but takes no new folder."""
    if not {"--out", "--table-dir", "--storage"} & set(args):
        args = [*args, "--out", "/proc/x"]
    line = assert_one_line_error(_timed(runner, args))
    assert "cannot write /proc/x" in line and "choose another path" in line


# ------------------------------------------------------------------------------ output to a file
def test_a_table_not_going_to_a_terminal_keeps_every_number():
    buf = io.StringIO()
    out = _Console(file=buf)
    assert not out.is_terminal and out.width == FILE_WIDTH
    columns = [f"column {i}" for i in range(12)]
    table = summary_table("wide", columns, 1)
    numbers = [f"{0.123456789 * (i + 1):.9f}" for i in range(12)]
    table.add_row(*numbers)
    out.print(table)
    text = buf.getvalue()
    assert "…" not in text and all(n in text for n in numbers), text
    assert len(max(text.splitlines(), key=len)) > 80  # one line, wider than Rich's default for files


def test_numbers_keep_their_significant_digits():
    """A column of times reads 0.500, 0.657, 2.60, 1.00 (the search's baseline and best columns
    had read 0.5 beside 0.657 and a best time of 1): trailing zeros stay, a bare point does not."""
    assert [fmt(x) for x in (0.5, 0.657, 2.6, 1.0, 292.3, 0.0505)] == [
        "0.500",
        "0.657",
        "2.60",
        "1.00",
        "292",
        "0.0505",
    ]
    assert fmt(0.308, ".4g") == "0.3080" and fmt(1.25, ".2f") == "1.25" and fmt(math.nan) == "-"


def test_table_list_left_aligns_text_and_right_aligns_numbers(runner):
    """`fo-tune table list` (the packaged tables): the folder and dtype columns start under their
    header, the world size and row count end under theirs."""
    result = runner.invoke(app, ["table", "list"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("device key"))
    rows = [line for line in lines if line.startswith("nvidia-")]
    assert rows, result.stdout
    for row in rows:
        cells = row.split()
        for name, cell in (("folder", cells[-1]), ("dtype", cells[3])):
            assert row.index(cell, header.index(name) - 1) == header.index(name), (name, row)
        for name, cell in (("world", cells[2]), ("rows", cells[4])):
            end = header.index(name) + len(name)
            assert row[end - len(cell) : end] == cell and row[end] == " ", (name, row)


@pytest.mark.parametrize(
    "command, usage",
    [
        (["model", "fit"], "[TABLE_OR_REPORT]..."),
        (["model", "check"], "[TABLE_OR_REPORT]..."),
        (["table", "validate"], "{PATH}..."),
    ],
)
def test_a_list_argument_shows_its_metavar_once(runner, command: list[str], usage: str):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    line = next(line for line in result.output.splitlines() if "Usage:" in line)
    assert line.split()[-1] == usage, line


def test_every_command_help_says_its_exit_codes(runner):
    """Each command's --help says what its exit codes mean (model fit's said nothing of them)."""
    commands = [["search"], ["calibrate"], ["bench"], ["profile"], ["demo"], ["model", "check"]]
    commands += [
        ["model", "fit"],
        *(["table", sub] for sub in ("list", "show", "lookup", "validate", "diff", "pull")),
    ]
    for command in commands:
        result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "400"})
        assert "Exit code 0 " in " ".join(result.output.split()), command


def test_every_help_keeps_its_words_whole_at_80_columns(runner):
    """An option's help folds a word longer than its column (a default output path) onto the next
    line at 80 columns; it was cut with "…", losing where the output goes."""
    commands = [[], ["search"], ["calibrate"], ["bench"], ["profile"], ["demo"], ["model", "check"]]
    commands += [
        ["model", "fit"],
        *(["table", sub] for sub in ("list", "show", "lookup", "validate", "pull")),
    ]
    for command in commands:
        result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, (command, result.output)
        assert "…" not in result.output, (command, result.output)
    out = runner.invoke(app, ["calibrate", "--help"], env={"COLUMNS": "80"}).output
    assert "calibration.yaml" in "".join(line.strip(" │") for line in out.splitlines()), out


def test_cli_output_through_a_pipe_keeps_every_number():
    """The real console, its stdout a pipe (COLUMNS=80 as CI systems set it): nothing is cut."""
    code = (
        "from fo_tune.cli.common import console, summary_table\n"
        "t = summary_table('wide', [f'column {i}' for i in range(12)], 1)\n"
        "t.add_row(*[f'{0.123456789 * (i + 1):.9f}' for i in range(12)])\n"
        "console.print(t)\n"
        "n = summary_table('a title much wider than its narrow table', ['a'], 1)\n"
        "n.caption = 'a caption much wider than its narrow table'\n"
        "n.add_row('1')\n"
        "console.print(n)\n"
    )
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout and "1.234567890" in done.stdout and "0.123456789" in done.stdout
    lines = done.stdout.splitlines()  # a narrow table's title and caption each stay on one line
    assert "a title much wider than its narrow table" in lines, done.stdout
    assert "a caption much wider than its narrow table" in lines, done.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--suite"],
        ["bench", "--out"],
        ["calibrate", "--out"],
        ["calibrate", "--into"],
        ["calibrate", "--from-profiles"],
        ["calibrate", "--space"],
        ["model", "fit", "--calibration"],
        ["model", "fit", "--out"],
        ["model", "check", "--calibration"],
        ["profile", "--out"],
        ["search", "--shapes"],
        ["search", "--calibration"],
        ["search", "--table-dir"],
        ["search", "--out"],
        ["search", "--space"],
        ["table", "pull", "--table-dir"],
    ],
    ids=" ".join,
)
def test_an_empty_path_option_is_refused_not_taken_for_the_working_folder(tmp_path, monkeypatch, args):
    """``--out ""`` (an unset shell variable) is exit 2 and one line, nothing written; "." still
    names the working folder."""
    monkeypatch.chdir(tmp_path)
    line = assert_one_line_error(CliRunner().invoke(app, [*args, ""]))
    assert f"'{args[-1]}'" in line and "is empty" in line, line
    assert not list(tmp_path.iterdir())
    # a named pipe (or a device, /dev/zero) is refused as it is parsed: its read waited forever
    os.mkfifo(tmp_path / "pipe")
    line = assert_one_line_error(CliRunner().invoke(app, [*args, "pipe"]))
    assert "pipe is a device, a pipe or a socket; give a file or a folder" in line, line
