"""``fo-tune demo --engine copy_engine``: the copy engine's protocol on thread-ranks of its CPU
executor, as a user runs it on a machine without GPUs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error
from fo_tune.bench.demo import COPY_ENGINE_COLLECTIVES, run_copy_engine_demo


@pytest.mark.parametrize("world", [3, 4, 5])
def test_demo_runs_every_collective_through_the_cpu_executor(world: int):
    """The default CPU shapes, their M rounded up to a multiple of the world size: every collective
    runs and passes at any world size; the summary line counts the checked rows."""
    result = CliRunner().invoke(
        app, ["demo", "--engine", "copy_engine", "--world-size", str(world), "--reps", "2"]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert len(rows) == 2 * len(COPY_ENGINE_COLLECTIVES), result.stdout
    for line in rows:
        status, shape = line.split()[0], line.split()[2]
        assert status == "PASS" and int(shape.split("x")[0]) % world == 0, (line, result.stdout)
    assert f"passed: {len(rows)} of {len(rows)} checked rows" in result.stdout
    assert "copy engine's CPU executor" in result.stdout
    # the table's title, wider than the table, stays on one line in output that is not a terminal
    title = f"fo-tune demo: {world} ranks, the copy engine's CPU executor, thread-ranks, float32"
    assert title in lines, result.stdout


def test_the_demo_rows_fail_when_a_result_is_wrong(monkeypatch: pytest.MonkeyPatch):
    """A row passes only within the dtype's tolerance: with a result made wrong, the row fails."""
    import fo_kernels.engines.copy_engine as ce

    real = ce.check_on_threads
    monkeypatch.setattr(ce, "check_on_threads", lambda check: _worse(real(check)))
    rows = run_copy_engine_demo(2, [(8, 5, 3)], reps=1)
    assert [r.passed for r in rows] == [False, False, False]


def _worse(result):
    import dataclasses

    return dataclasses.replace(result, rel_err=1.0)


@pytest.mark.parametrize(
    "args, what",
    [
        (["--engine", "nccl_copy"], "--engine"),
        (["--engine", "copy_engine", "--world-size", "1"], "--world-size >= 2"),
        (["--engine", "copy_engine", "--backend", "gloo"], "leave --backend out"),
        # every shape below the world size: nothing would be checked (it said "passed: 0 of 0")
        (["--engine", "copy_engine", "-w", "4", "-s", "2x8x8", "-s", "3x8x8"], "no --shape runs"),
    ],
)
def test_bad_options_are_one_line_exit_2(args: list[str], what: str):
    result = CliRunner().invoke(app, ["demo", *args])
    line = assert_one_line_error(result)
    assert what in line, line
    assert result.stdout == "", result.stdout  # refused before the first line says where it runs


def test_the_demo_takes_the_virtual_ranks_where_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch):
    """With a GPU visible the rows come from the virtual ranks (here a stand-in that runs the same
    check on the CPU executor and records it), the GPU's default shapes and dtype; the first line
    and the table say so. Without one, the CPU executor."""
    import torch

    import fo_kernels.engines.copy_engine as ce
    import fo_tune.bench.demo as demo
    import fo_tune.ranks.backend as rank_backend

    assert demo.copy_engine_backend(0) == demo.COPY_ENGINE_BACKEND
    assert demo.copy_engine_backend(1) == demo.copy_engine_backend(8) == demo.VIRTUAL_BACKEND
    seen: list = []
    monkeypatch.setattr(rank_backend, "visible_gpus", lambda: 1)
    monkeypatch.setattr(demo, "_on_gpu", lambda check: seen.append(check) or ce.check_on_threads(check))
    monkeypatch.setattr(demo, "GPU_SHAPES", [(24, 16, 8)])
    result = CliRunner().invoke(app, ["demo", "--engine", "copy_engine", "--world-size", "4", "--reps", "1"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "4 virtual ranks on one GPU" in result.stdout and "virtual ranks on one GPU" in result.stdout
    assert [(c.collective, c.world, c.m, c.dtype) for c in seen] == [
        (coll, 4, 24, getattr(torch, demo.GPU_DTYPE)) for coll in COPY_ENGINE_COLLECTIVES
    ]


def test_an_unknown_copy_engine_backend_is_refused():
    from fo_kernels.errors import ArgumentError

    with pytest.raises(ArgumentError, match="not one of cpu-threads, virtual-ranks"):
        run_copy_engine_demo(2, [(8, 5, 3)], reps=1, backend="nccl")


@pytest.mark.parametrize("world", ["2", 2.0, 0, True])
def test_a_world_size_that_is_not_a_positive_integer_is_refused(world):
    """(a string or a float reached a comparison: a TypeError, not an error naming it)"""
    from fo_kernels.errors import ArgumentError

    with pytest.raises(ArgumentError, match=rf"--world-size: expected an integer >= 1, got {world!r}"):
        run_copy_engine_demo(world, [(8, 16, 16)], reps=1)


def test_a_shape_below_the_world_size_is_skipped_for_that_reason():
    """all_reduce needs no M divisible by the world size: a skip of M < world size says that M is
    below it (it said 'not divisible'), beside a shape that runs."""
    rows = run_copy_engine_demo(4, [(2, 8, 8), (4, 8, 8)], reps=1)
    reasons = [r.schedule for r in rows if r.skipped]
    assert len(reasons) == len(COPY_ENGINE_COLLECTIVES), rows
    assert all("M=2 is below the world size 4" in why for why in reasons), reasons
    assert [r.passed for r in rows if not r.skipped] == [True] * len(COPY_ENGINE_COLLECTIVES)


def test_each_case_is_reported_as_it_finishes():
    """A GPU-sized shape takes minutes on the CPU executor: off a terminal, stderr names each
    (collective, shape) checked as it finishes, and the count of those that run (the skipped
    ones are not counted)."""
    result = CliRunner().invoke(app, ["demo", "--engine", "copy_engine", "-w", "4", "-s", "6x8x8", "-r", "1"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "check and time: 1 step" in result.stderr, result.stderr
    assert "check and time: all_reduce 6x8x8 done" in result.stderr, result.stderr
    assert "reduce_scatter 6x8x8 done" not in result.stderr, result.stderr
