"""What a search needs before it starts, read and checked from the command's options: its mode on
this machine (the default, and a measuring one this machine's GPUs cannot hold refused), the shapes
file, where the tables and the studies go, and each request's report folder, one per run (every
file the search will write is checked writable before anything runs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fo_kernels.fingerprint import current_fingerprint
from fo_kernels.table import table_path
from fo_tune.output import check_writable_file
from fo_tune.search.report import check_report_dir, new_run, report_name, report_root

if TYPE_CHECKING:
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.search.request import SearchRequest


def default_mode(gpus: int, world_size: int, torchrun: bool) -> str:
    """The mode of a search without --mode: ``predict`` where this machine cannot start the ranks
    (no GPU, or fewer GPUs than the world size outside torchrun), else "" (hybrid with a
    calibration of this machine, else measure: ``fo_tune.calibrate.find.choose_calibration``)."""
    return "predict" if gpus == 0 or (gpus < world_size and not torchrun) else ""


def check_measuring_machine(mode: str, world_size: int, backend: str, gpus: int, torchrun: bool) -> None:
    """Refuse (``SearchError``, before any work) a measuring search (measure, hybrid) whose ranks
    this machine's GPUs cannot hold, saying what it needs; gloo ranks (``--backend gloo``, or no GPU
    at all) run on the CPU and are let through."""
    from fo_tune.search import SearchError

    if mode == "predict" or backend == "gloo" or gpus == 0 or torchrun or gpus >= world_size:
        return
    raise SearchError(
        f"--mode {mode} at world size {world_size} times the ranks on {world_size} GPUs, one a rank, "
        f"and this machine has {gpus}: run it on a {world_size}-GPU machine (after `fo-tune calibrate "
        f"--world-size {world_size}` there), or plan offline with --mode predict"
    )


def check_cpu_sized(
    mode: str,
    backend: str,
    shapes: list[tuple[int, int, int]],
    m_range: tuple[int, int] | None,
    allow_slow: bool,
) -> None:
    """Refuse (``SearchError``, before any rank starts) a measuring search on gloo ranks (the CPU:
    every trial in Triton's interpreter) of shapes above ``limits.CPU_MAX_MACS``, as ``fo-tune bench``
    refuses them, unless ``allow_slow``: a GPU suite would take hours a shape there. An M range's
    shapes count at its HI."""
    from fo_tune.ranks.limits import CPU_MAX_SIDE, largest_for_the_interpreter
    from fo_tune.search import SearchError

    if mode == "predict" or backend == "nccl" or allow_slow:
        return
    largest = largest_for_the_interpreter((m_range[1] if m_range else m, n, k) for m, n, k in shapes)
    if largest is None:
        return
    m, n, k = largest
    side = CPU_MAX_SIDE
    raise SearchError(
        f"--mode {mode or 'measure'} on the CPU (gloo ranks, no GPU) times every trial in Triton's CPU "
        f"interpreter, hours per GPU-sized shape (up to {m}x{n}x{k}): plan offline with --mode predict, "
        f"give shapes up to {side}x{side}x{side}, or pass --allow-slow to run them anyway"
    )


def read_shapes_file(path: Path) -> list[tuple[int, int, int]]:
    """The [M, N, K] shapes of the YAML file at ``path`` (its ``shapes:`` list); ``SearchError`` naming the
    file otherwise, and for a key no suite has (a misspelt ``dtype:`` would search another dtype)."""
    from fo_kernels.files import read_yaml
    from fo_tune.bench.suite import suite_keys_refusal
    from fo_tune.search import SearchError

    data = read_yaml(path, error=SearchError, missing=SearchError, missing_hint="no such shapes file")
    if (refusal := suite_keys_refusal(data, str(path))) is not None:
        raise SearchError(refusal)
    shapes = data.get("shapes") if isinstance(data, dict) else None
    if not isinstance(shapes, list) or not shapes:
        raise SearchError(f"{path}: expected a non-empty `shapes:` list of [M, N, K]")
    out = []
    for i, s in enumerate(shapes):
        if (
            not isinstance(s, list)
            or len(s) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in s)
        ):
            raise SearchError(f"{path}: shapes[{i}]: expected [M, N, K] with integers >= 1, got {s!r}")
        out.append((s[0], s[1], s[2]))
    return out


def shapes_file_dtype(path: Path) -> str | None:
    """The ``dtype:`` of the shapes file at ``path`` (a suite's, as ``fo-tune bench --suite`` reads
    it), None where it has none or does not read (``read_shapes_file`` names that); ``SearchError``
    naming the file for a dtype that is not one."""
    from fo_kernels.files import read_yaml
    from fo_kernels.schedule import DTYPES
    from fo_tune.search import SearchError

    try:
        data = read_yaml(path, error=SearchError, missing=SearchError, missing_hint="no such shapes file")
    except SearchError:
        return None
    dtype = data.get("dtype") if isinstance(data, dict) else None
    if dtype is not None and dtype not in DTYPES:
        raise SearchError(
            f"{path}: dtype: {dtype!r} is not one of {', '.join(DTYPES)}; fix the file, or give --dtype"
        )
    return dtype


def default_table_dir() -> Path:
    """Where tables go without --table-dir or --out: ``$FO_TUNE_TABLE_DIR`` (``~`` expanded, as the
    runtime reads it), else the user folder. ``SearchError`` where the variable names a file."""
    from fo_kernels.table import TABLE_DIR_ENV, table_dir_env_not_a_folder, user_table_dir
    from fo_tune.search import SearchError

    if (env := table_dir_env_not_a_folder()) is not None:
        raise SearchError(
            f"{TABLE_DIR_ENV}={env} is a file, not a folder of tables; point {TABLE_DIR_ENV} at a "
            "folder, unset it, or give --table-dir"
        )
    env = os.environ.get(TABLE_DIR_ENV)
    return Path(env).expanduser() if env else user_table_dir()


def output_places(out: Path | None, table_dir: Path | None, storage: str | None) -> tuple[Path, str]:
    """(the tables' root, the studies' storage URL) of --out, --table-dir and --storage: without
    --storage, SQLite at ``DIR/studies/fo-tune.db`` under --out, else ``default_storage_file()``."""
    from fo_tune.search.storage import storage_url

    if out is not None:
        return table_dir or out / "tables", storage or f"sqlite:///{out / 'studies' / 'fo-tune.db'}"
    return table_dir or default_table_dir(), storage_url(storage or "")


def report_dirs(
    requests: list[SearchRequest],
    cal: Calibration | None,
    device: torch.device,
    out: Path | None,
    tables_root: Path,
    storage_url: str,
) -> list[Path]:
    """Each request's report folder, a new one for this run (``fo_tune.search.report``); every file
    the search writes (its report folders, table files and SQLite study file) is checked writable
    before anything runs."""
    from fo_tune.search.storage import journal_path, sqlite_path

    first = requests[0]
    if first.mode == "predict":
        assert cal is not None
        device_key = cal.fingerprint.device_key
    else:
        device_key = current_fingerprint(device, first.world_size).device_key
    root = out / "report" if out is not None else report_root() / device_key
    names = [
        report_name(r.collective, r.world_size, r.dtype, r.mode, m_range=r.m_range is not None)
        for r in requests
    ]
    run = new_run(root, names)
    dirs = []
    for r, name in zip(requests, names, strict=True):
        dirs.append(root / name / run)
        check_report_dir(dirs[-1])
        check_writable_file(
            table_path(tables_root, device_key, r.collective, r.world_size, r.dtype), what="table file"
        )
    file = sqlite_path(storage_url) or journal_path(storage_url)  # (the storages that are files)
    if file is not None:
        check_writable_file(file, what=f"--storage {storage_url}:")
    return dirs
