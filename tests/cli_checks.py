"""Helpers shared by the CLI tests: the one-line error assertion, the isolated table paths, the
stand-in all_gather curve of the shipped calibration, a Ctrl-C at a function's second call or
as a function starts, and the examples: a script's run on two gloo ranks with its RESULT line read,
and a script loaded as a module."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# The device key of the packaged H200 x2 tables and calibration (results/).
H200_KEY = "nvidia-h200-cc90-132sm-w2-nvlink18"


# How long an example on two gloo ranks may run before its test fails: far above what a small
# transformers model takes on a loaded 2-core CPU.
EXAMPLE_TIMEOUT_S = 600


def run_example_on_gloo(example: Path, tmp_path: Path) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    """Run an example script on 2 gloo ranks with no table (the heuristic schedules) and return its
    one ``RESULT {json}`` line, checked to say ok at world size 2, with the finished process."""
    env = {
        **os.environ,
        "FO_TUNE_TABLE_DIR": str(tmp_path / "tables"),
        "XDG_DATA_HOME": str(tmp_path / "xdg"),
        "TRITON_INTERPRET": "1",
    }
    done = subprocess.run(
        [sys.executable, str(example), "--world-size", "2", "--backend", "gloo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["ok"] and result["world_size"] == 2, result
    return result, done


def load_example(path: Path, name: str | None = None) -> ModuleType:
    """The example script at ``path`` as a module named ``name`` (the file's stem unless given;
    examples/ is no package), not entered in ``sys.modules``. The script's folder is first on
    ``sys.path`` while it loads, as when Python runs the script, so its ``import launch`` finds
    the examples' shared module beside it."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def assert_one_line_error(result, code: int = 2) -> str:
    """The command failed with ``code`` and exactly one ``error: ...`` line on stderr, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    return lines[0]


def run_reports(folder: Path) -> list[Path]:
    """The run folders of one search report name (``<collective>-w<W>-<dtype>-<mode>``), oldest
    first (a run's folder name starts with its UTC time)."""
    return sorted(p for p in folder.iterdir() if p.is_dir())


def run_report(folder: Path) -> Path:
    """The one run folder under ``folder`` (a report name's), asserting there is exactly one."""
    runs = run_reports(folder)
    assert len(runs) == 1, runs
    return runs[0]


def isolate_tables(mp: pytest.MonkeyPatch, root: Path) -> None:
    """No user or shared table interferes (the spawned ranks inherit the environment)."""
    mp.setenv("FO_TUNE_TABLE_DIR", str(root / "tables"))
    mp.setenv("XDG_DATA_HOME", str(root / "xdg"))
    mp.delenv("FO_TUNE_DEBUG", raising=False)


def with_all_gather_standin(cal: Any) -> Any:
    """``cal`` (a ``Calibration``) with its reduce_scatter bandwidth points and fits relabelled as
    all_gather's: a stand-in, not a measurement. The shipped H200 calibration has no all_gather
    curve, and a predicted all_gather search needs one; the tests that use this check the search's
    plumbing, never the numbers."""
    bandwidth = [
        dataclasses.replace(b, collective="all_gather")
        for b in cal.bandwidth
        if b.collective == "reduce_scatter"
    ]
    fits = [
        dataclasses.replace(f, collective="all_gather") for f in cal.fits if f.collective == "reduce_scatter"
    ]
    assert bandwidth, "the calibration has no reduce_scatter curve to stand in for all_gather's"
    return dataclasses.replace(cal, bandwidth=[*cal.bandwidth, *bandwidth], fits=[*cal.fits, *fits])


def tp2_only(cal: Any) -> Any:
    """``cal`` (a ``Calibration``) without its N-peer copy-engine points and its other dtypes' GEMM
    profiles (the packaged calibration holds both, measured on a sibling GPU): its TP=2 section as
    measured on its own GPU, what a first merge starts from."""
    tp2 = [p for p in cal.copy_engine.library_gemm if not p.measured_on]
    return dataclasses.replace(
        cal,
        copy_engine=dataclasses.replace(cal.copy_engine, library_gemm=tp2, host=[]),
        gemm_dtypes={},
    )


def interrupted_at_second_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, but its second call raises ``KeyboardInterrupt`` (a Ctrl-C after the first case)."""
    calls = 0

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def ctrl_c_as_it_starts(mp: pytest.MonkeyPatch, module: Any, name: str) -> Iterator[None]:
    """``module.name`` patched so that a terminal's Ctrl-C (a real SIGINT to the main thread) comes
    as it starts, with time for it to land there unless the caller holds it; SIGINT raises
    ``KeyboardInterrupt`` inside the block, as in a terminal."""
    fn = getattr(module, name)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.05)  # (where it lands without a hold: the call never runs)
        return fn(*args, **kwargs)

    mp.setattr(module, name, interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
