"""``fo-tune demo --engine copy_engine``: the copy engine's protocol on thread-ranks of its CPU
executor, as a user runs it on a machine without GPUs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli import app
from cli_checks import assert_one_line_error
from fo_tune.bench.demo import COPY_ENGINE_COLLECTIVES, run_copy_engine_demo


@pytest.mark.parametrize("world", [3, 4])
def test_demo_runs_every_collective_through_the_cpu_executor(world: int):
    """The default CPU shapes: every collective passes, or is skipped where M is not divisible by
    the world size; the summary line counts the checked rows."""
    result = CliRunner().invoke(
        app, ["demo", "--engine", "copy_engine", "--world-size", str(world), "--reps", "2"]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert len(rows) == 2 * len(COPY_ENGINE_COLLECTIVES), result.stdout
    assert all(line.startswith(("PASS", "SKIP")) for line in rows), result.stdout
    skipped = sum(line.startswith("SKIP") for line in rows)
    checked = len(rows) - skipped
    assert f"passed: {checked} of {checked} checked rows" in result.stdout
    assert "copy engine's CPU executor" in result.stdout


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
    ],
)
def test_bad_options_are_one_line_exit_2(args: list[str], what: str):
    line = assert_one_line_error(CliRunner().invoke(app, ["demo", *args]))
    assert what in line, line
