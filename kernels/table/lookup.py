"""The runtime's lookup: the best row for a call across every table found, cached per file and per
call signature; a call without a row gets ``overlap: false`` and a warning that says how to tune."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from fo_kernels.errors import HeuristicScheduleWarning, ShapeError
from fo_kernels.fingerprint import CPU_MAX_MACS, current_fingerprint, resolve_device
from fo_kernels.schedule import COLLECTIVES, SHARDED_COLLECTIVES, Problem, Schedule
from fo_kernels.table.checks import check_fingerprint, check_header_for
from fo_kernels.table.format import StampedFiles
from fo_kernels.table.loaded import LoadedTable, read_table
from fo_kernels.table.paths import (
    TABLE_DIR_ENV,
    check_name,
    check_positive,
    table_dtype,
    table_filename,
    table_path,
    table_search_path,
)

# Loaded tables kept by lookup_schedule; a few (device, collective, world, dtype) files per process.
_CACHE_SIZE = 64
# Seconds lookup_schedule answers a repeated call from memory before it looks at the files again.
TABLE_RECHECK_S = 1.0
# Remembered answers (call signatures: shapes x collectives x dtypes of one model); oldest dropped.
_ANSWERS_SIZE = 4096
# The provenance source of the overlap: false schedule a call without a table row gets.
MISS_SOURCE = "no table row"


# ---------------------------------------------------------------------------------------- lookup
class FindsRows(Protocol):
    """A table's finders (``ScheduleTable``, ``LoadedTable``), what ``best_row`` reads."""

    def find_exact(self, m: int, n: int, k: int, *, kind: str | None = None) -> Schedule | None: ...

    def find_range(self, m: int, n: int, k: int, *, kind: str | None = None) -> Schedule | None: ...


class _TableCache:
    """Loaded tables keyed by path, valid while the file's (inode, mtime_ns, size) is unchanged,
    and the answers of recent lookups."""

    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._tables: StampedFiles[LoadedTable] = StampedFiles(size, read_table)
        self._answers: OrderedDict[tuple, tuple[float, Schedule]] = OrderedDict()

    def load(self, path: Path) -> LoadedTable | None:
        """The table at ``path``, or None when there is no file."""
        with self._lock:
            return self._tables.get(path)

    def answer(self, key: tuple) -> Schedule | None:
        """A remembered lookup answer for ``key`` younger than ``TABLE_RECHECK_S``, else None."""
        with self._lock:
            hit = self._answers.get(key)
        if hit is None or time.monotonic() - hit[0] > TABLE_RECHECK_S:
            return None
        return hit[1]

    def remember(self, key: tuple, schedule: Schedule) -> None:
        with self._lock:
            self._answers.pop(key, None)
            self._answers[key] = (time.monotonic(), schedule)
            while len(self._answers) > _ANSWERS_SIZE:
                self._answers.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._answers.clear()


_CACHE = _TableCache(_CACHE_SIZE)


def lookup_schedule(
    collective: str,
    m: int,
    n: int,
    k: int,
    *,
    dtype: torch.dtype | str,
    world_size: int,
    device: torch.device | str | int | None = None,
) -> Schedule:
    """The schedule for this call: the best matching table row (``best_row``), else ``overlap: false``
    with a ``HeuristicScheduleWarning`` saying how to tune the shape (none at world size 1, where
    the call is the GEMM alone and there is nothing to tune).

    For ``all_gather``, ``m`` is the gathered M (world size x the shard's rows).
    Raises ``ScheduleError`` for an unknown collective or dtype, ``ShapeError`` for a bad shape and
    ``TableError`` for a found table that is malformed or for other hardware.
    """
    # A call repeated with the same arguments is answered before they are checked again (they
    # passed the first time): the ops look up every call, and the checks cost a few us of host time.
    # A device that depends on the current CUDA device (None, "cuda") is resolved first. The sizes'
    # types are in the key: True and 64.0 hash as 1 and 64 but are refused by the checks.
    pinned = isinstance(device, torch.device) and (device.type != "cuda" or device.index is not None)
    dev_key = device if pinned else resolve_device(device)
    key = (
        collective, m, n, k, dtype, world_size, dev_key, type(m), type(n), type(k), type(world_size),
        os.environ.get(TABLE_DIR_ENV), os.environ.get("XDG_DATA_HOME"),
    )  # fmt: skip
    try:
        remembered = _CACHE.answer(key)
    except TypeError:  # an unhashable argument, refused by the checks below
        remembered = None
    if remembered is not None:
        return remembered
    check_name("collective", collective, COLLECTIVES)
    dtype_name = table_dtype(dtype)
    for name, value in (("m", m), ("n", n), ("k", k), ("world_size", world_size)):
        check_positive(name, value)
    if collective in SHARDED_COLLECTIVES and m % world_size:
        raise ShapeError(f"{collective} needs M divisible by the world size {world_size}, got M={m}")
    dev = resolve_device(device) if pinned else dev_key  # (a pinned device is checked here)
    fp = current_fingerprint(dev, world_size)
    folders = table_search_path()
    tables: list[LoadedTable] = []
    found_paths: list[str] = []
    for folder in folders:
        path = table_path(folder, fp.device_key, collective, world_size, dtype_name)
        table = _CACHE.load(path)
        if table is None:
            continue
        check_fingerprint(table.header, fp, source=str(path))
        check_header_for(
            table.header, collective=collective, dtype=dtype_name, world_size=world_size, source=str(path)
        )
        tables.append(table)
        found_paths.append(str(path))
    found = best_row(tables, m, n, k)
    if found is not None:
        _CACHE.remember(key, found)
        return found
    # One rank's collective is the identity: its call is the GEMM alone whatever a row would say,
    # and `fo-tune search` refuses --world-size 1, so a miss there is nothing to warn about.
    if world_size > 1:
        filename = table_filename(collective, world_size, dtype_name)
        searched = "no table file"
        if found_paths:
            searched = f"tables without a matching row: {', '.join(found_paths)}"
        searched += _other_machines(folders, fp.device_key, filename, f"{m}x{n}x{k}", collective)
        # Without GPUs the search plans the packaged H200 deployment offline, whose rows go under
        # the H200's device key: this machine's own rows come from measuring on its gloo ranks,
        # which the search refuses for a shape above CPU_MAX_MACS unless --allow-slow.
        slow = dev.type == "cpu" and m * n * k > CPU_MAX_MACS
        mode = (" --mode measure" + (" --allow-slow" if slow else "")) if dev.type == "cpu" else ""
        warnings.warn(
            f"no schedule table row for {collective} {dtype_name} {m}x{n}x{k} at world size {world_size} "
            f"on device {fp.device_key}; looked for {fp.device_key}/{filename} in "
            f"{', '.join(map(str, folders))} ({searched}); running GEMM then the collective "
            f"(overlap: false); tune the shape with `fo-tune search --shape {m}x{n}x{k} -c {collective} "
            f"--world-size {world_size} --dtype {dtype_name}{mode}`"
            + (" (hours: every trial runs in Triton's CPU interpreter)" if slow else ""),
            HeuristicScheduleWarning,
            stacklevel=2,
        )
    miss = Schedule(
        collective=collective,
        dtype=dtype_name,
        world_size=world_size,
        problem=Problem(m=m, n=n, k=k),
        provenance={"source": MISS_SOURCE},
    )
    _CACHE.remember(key, miss)
    return miss


def _other_machines(
    folders: Sequence[Path], device_key: str, filename: str, shape: str, collective: str
) -> str:
    """For a miss's warning: the other device keys whose folders hold ``filename`` (a plan for
    another machine, e.g. an offline search's H200 rows on a CPU-only one), and how to read them."""
    keys: set[str] = set()
    for folder in folders:
        try:
            keys.update(p.parent.name for p in Path(folder).glob(f"*/{filename}"))
        except OSError:  # an unreadable folder: the lookup above already read what it could
            continue
    keys.discard(device_key)
    if not keys:
        return ""
    return (
        f"; other machines' tables hold {filename}: {', '.join(sorted(keys))} (the runtime reads "
        f"them on that machine; `fo-tune table lookup --shape {shape} -c {collective} -k KEY` shows "
        "the row a call there gets)"
    )


def best_match(tables: Sequence[FindsRows], m: int, n: int, k: int) -> tuple[int, Schedule] | None:
    """(which of ``tables``, the row) ``lookup_schedule`` takes for (m, n, k), ``tables`` in folder
    order: measured before predicted, then exact before M-range, then the first table's."""
    for kind in ("measured", "predicted"):
        for exact in (True, False):
            for i, table in enumerate(tables):
                finder = table.find_exact if exact else table.find_range
                found = finder(m, n, k, kind=kind)
                if found is not None:
                    return i, found
    return None


def best_row(tables: Sequence[FindsRows], m: int, n: int, k: int) -> Schedule | None:
    """The row ``lookup_schedule`` takes from ``tables`` (in folder order) for (m, n, k)
    (``best_match``)."""
    match = best_match(tables, m, n, k)
    return match[1] if match is not None else None
