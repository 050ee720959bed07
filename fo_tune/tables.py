"""The tuner's side of the schedule tables: merging measured rows into a table file, checking a table
against the plans the runtime will make from it, comparing two tables and finding table files.

The runtime (``fo_kernels.table``) owns the file format, loading, saving and the lookup; this module
owns everything that only the tuner and the ``fo-tune table`` commands need:

- ``merge_rows``: add or replace rows in a table file under an inter-process lock, so several search
  workers (or several ``fo-tune search`` runs) can write into the same file without losing rows; a
  predicted row (``fo_kernels.table.row_kind``) never replaces a measured one;
- ``find_row``: the row the runtime would use for a call, and the file it comes from;
- ``validate_table``: the checks that need a shape (``fo_kernels.plan.check_fits`` for every exact row,
  and for the ends and middle of every M range) and overlapping M ranges, beyond what loading checks;
- ``diff_tables``: per problem, whether a row is only in one table, changed (which fields) or the same;
- ``find_tables`` / ``known_device_keys``: table files in the runtime's search path.

The lock is a second file beside the table, ``<table>.yaml.lock`` (``filelock``); the runtime never
takes it, because tables are replaced by an atomic rename and a reader sees the old or the new file.
``filelock`` is a dependency of the tuner only (the ``tune`` extra); the runtime never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fo_kernels.errors import FoTuneError, ScheduleError, ShapeError, TableError, TableNotFoundError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.plan import check_fits
from fo_kernels.schedule import SHARDED_COLLECTIVES, Problem, Schedule
from fo_kernels.table import (
    ScheduleTable,
    best_row,
    load_table,
    row_kind,
    save_table,
    table_filename,
    table_path,
    table_search_path,
)

__all__ = [
    "DIFF_STATUSES",
    "LATENCY_KEYS",
    "LOCK_SUFFIX",
    "LOCK_TIMEOUT_S",
    "SCHEDULE_FIELDS",
    "DiffStatus",
    "RowDiff",
    "TableLockTimeout",
    "changed_fields",
    "diff_tables",
    "field_value",
    "find_row",
    "find_tables",
    "header_differences",
    "known_device_keys",
    "latencies",
    "lock_path",
    "merge_rows",
    "validate_table",
]

# The lock file beside a table: ``<table>.yaml.lock``.
LOCK_SUFFIX = ".lock"
# Seconds merge_rows waits for another process's merge. A merge holds the lock for one load, upsert
# and save of a small YAML file (milliseconds), so a minute means a stuck or very slow writer.
LOCK_TIMEOUT_S = 60.0
# Fields of a Schedule that change what the runtime does, in the order diffs report them: the
# common ones, then any engine's settings (``field_value``).
SCHEDULE_FIELDS = (
    "collective",
    "dtype",
    "world_size",
    "overlap",
    "engine",
    "mode",
    "tile",
    "sms_free",
    "nccl_max_ctas",
    "signal_tiles",
    "groups",
    "weights",
    "layout",
    "wait_mode",
)
# Of those, the ones that describe the header (every row of a table shares them).
_HEADER_FIELDS = ("collective", "dtype", "world_size")
# Provenance keys holding a latency in milliseconds, in the order of preference (a measurement
# beats the model's prediction).
LATENCY_KEYS = ("measured_ms", "predicted_ms")

DiffStatus = Literal["only_a", "only_b", "changed", "same"]
DIFF_STATUSES: tuple[DiffStatus, ...] = ("only_a", "only_b", "changed", "same")


class TableLockTimeout(FoTuneError, TimeoutError):
    """Another process held a table's lock for longer than the merge waits."""


# ------------------------------------------------------------------------------------- merge
def lock_path(path: str | os.PathLike[str]) -> Path:
    """The lock file of the table at ``path``: ``<path>.lock``."""
    return Path(str(path) + LOCK_SUFFIX)


def _hardware_mismatch(theirs: Fingerprint, ours: Fingerprint) -> str | None:
    """What makes ``theirs`` other hardware than ``ours`` (device key, capability, world size)."""
    for name in ("device_key", "compute_capability", "world_size"):
        if getattr(theirs, name) != getattr(ours, name):
            return f"{name} {getattr(theirs, name)!r}, the new rows' is {getattr(ours, name)!r}"
    return None


def merge_rows(
    path: str | os.PathLike[str],
    fingerprint: Fingerprint,
    rows: Sequence[Schedule],
    *,
    collective: str,
    world_size: int,
    dtype: str,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> ScheduleTable:
    """Upsert ``rows`` into the table file at ``path`` (created with its folders when missing).

    Under the file lock ``<path>.lock`` it loads the table (or starts one with ``fingerprint`` and
    the header ``collective``/``world_size``/``dtype``), replaces each row for the same problem
    (``ScheduleTable.upsert``: exact M, or the identical M range; an incoming M-range row also drops
    every existing range row of its (N, K) that it overlaps, so re-tuning a range never leaves
    overlapping ranges behind) or adds it, saves it with
    ``fo_kernels.table.save_table`` (atomic rename) and returns the merged table. Processes merging
    into the same file concurrently therefore never lose each other's rows (as long as every writer
    goes through ``merge_rows``; a bare ``save_table`` is not serialised); readers never wait.

    The header's fingerprint becomes ``fingerprint``: a table says which library versions its latest
    rows were measured with, and the runtime's version-drift warning compares against those. Rows
    kept from earlier merges stay (they may have been measured with older versions; record versions
    in their provenance where that matters, or re-tune).

    A predicted row (provenance ``mode: predict``) is left out where the table has a measured row
    for its problem (or, for an M range, a measured range it overlaps): measured beats predicted.

    Raises ``TableError`` (one line, saying what to do) when a row's collective, dtype or world size
    differs from the header, when ``fingerprint`` is for another world size, when the file holds
    another collective, world size or dtype, or when its fingerprint is for other hardware
    (device key, compute capability or world size); the file is then left untouched. A malformed
    file raises the ``TableError`` of ``load_table``. ``TableLockTimeout`` when another process
    holds the lock for more than ``lock_timeout_s`` seconds.
    """
    from filelock import FileLock, Timeout  # the tuner's dependency, never the runtime's

    if fingerprint.world_size != world_size:
        raise TableError(
            f"{path}: the fingerprint is for world size {fingerprint.world_size}, the rows for "
            f"{world_size}; measure the rows with {world_size} ranks"
        )
    # Checks every row against the header before the file is touched.
    incoming = ScheduleTable(
        fingerprint=fingerprint, collective=collective, world_size=world_size, dtype=dtype, rows=list(rows)
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path(path)), timeout=lock_timeout_s)
    try:
        with lock:
            try:
                table = load_table(path)
            except TableNotFoundError:
                table = ScheduleTable(
                    fingerprint=fingerprint, collective=collective, world_size=world_size, dtype=dtype
                )
            header = (table.collective, table.world_size, table.dtype)
            if header != (collective, world_size, dtype):
                raise TableError(
                    f"{path}: holds {header[0]} world size {header[1]} {header[2]} rows, these are "
                    f"{collective} world size {world_size} {dtype}; merge them into their own table, "
                    f"{fingerprint.device_key}/{table_filename(collective, world_size, dtype)}"
                )
            mismatch = _hardware_mismatch(table.fingerprint, fingerprint)
            if mismatch is not None:
                raise TableError(
                    f"{path}: the table is for other hardware ({mismatch}); merge the rows into the "
                    f"table of {fingerprint.device_key}, or move this file away to start a new one"
                )
            table.fingerprint = fingerprint
            for row in incoming.rows:
                if _keeps_measured(table, row):
                    continue
                if row.problem.is_range:  # a new M range replaces every older range it overlaps
                    table.rows = [old for old in table.rows if not _ranges_overlap(old.problem, row.problem)]
                table.upsert(row)
            save_table(table, path)
    except Timeout:
        raise TableLockTimeout(
            f"{lock_path(path)}: another process has held the table's lock for more than "
            f"{lock_timeout_s:g} s; wait for it to finish (or stop it) and merge again"
        ) from None
    return table


def _keeps_measured(table: ScheduleTable, row: Schedule) -> bool:
    """True when ``row`` is predicted and the table has a measured row it would replace (the same
    problem, or for an M range any range it overlaps): measured beats predicted."""
    if row_kind(row) != "predicted":
        return False
    return any(
        row_kind(old) == "measured"
        and (old.problem == row.problem or _ranges_overlap(old.problem, row.problem))
        for old in table.rows
    )


def _ranges_overlap(a: Problem, b: Problem) -> bool:
    if not (a.is_range and b.is_range) or (a.n, a.k) != (b.n, b.k):
        return False
    assert a.m_min is not None and a.m_max is not None and b.m_min is not None and b.m_max is not None
    return a.m_min <= b.m_max and b.m_min <= a.m_max


# ------------------------------------------------------------------------------------- validate
def _range_ms(problem: Problem, shards: int) -> list[int]:
    """M values a range row is checked at: both ends and the middle (multiples of ``shards``)."""
    assert problem.m_min is not None and problem.m_max is not None
    lo = -(-problem.m_min // shards) * shards
    hi = problem.m_max // shards * shards
    if lo > hi:
        return []
    mid = max(lo, (lo + hi) // 2 // shards * shards)
    return sorted({lo, mid, hi})


def _plan_issue(row: Schedule, m: int, sm_count: int, where: str) -> str | None:
    try:
        check_fits(row, m, row.problem.n, row.problem.k, sm_count=sm_count)
    except (ScheduleError, ShapeError) as exc:
        return f"row {where}: {exc}"
    return None


def validate_table(table: ScheduleTable, *, sm_count: int | None = None) -> list[str]:
    """Problems the runtime would hit with ``table`` that loading does not catch; [] when none.

    - every overlapped exact-shape row must fit its shape (``fo_kernels.plan.check_fits``): for the
      Triton engine a plan, with groups summing to the signal units, ``row_band`` groups starting
      on whole bands and a grid left by ``sms_free``; a copy-engine row fits any M;
    - every overlapped M-range row must give a plan at ``m_min``, ``m_max`` and a middle M (for
      ``reduce_scatter`` and ``all_gather`` the multiples of the world size nearest inside the
      range), and the range must hold at least one such M;
    - M ranges for the same (N, K) must not overlap (lookup would take the one with the lower
      ``m_min`` for the common Ms).

    ``sm_count`` defaults to the table fingerprint's. Each issue is one line naming the row
    (``problem.describe()``) and the field, e.g.
    ``row 64x64x32: groups: sizes sum to 3 signal units but this shape has 4 (...)``.
    """
    sms = sm_count if sm_count is not None else table.fingerprint.sm_count
    issues: list[str] = []
    for row in table.rows:
        if not row.overlap:
            continue
        problem = row.problem
        if not problem.is_range:
            assert problem.m is not None
            issue = _plan_issue(row, problem.m, sms, problem.describe())
            if issue is not None:
                issues.append(issue)
            continue
        shards = row.world_size if row.collective in SHARDED_COLLECTIVES else 1
        ms = _range_ms(problem, shards)
        if not ms:
            issues.append(
                f"row {problem.describe()}: problem: the M range holds no M divisible by world_size "
                f"{row.world_size}, which {row.collective} needs"
            )
        for m in ms:
            issue = _plan_issue(row, m, sms, f"{problem.describe()} at M={m}")
            if issue is not None:
                issues.append(issue)
    ranges = sorted(
        (row.problem for row in table.rows if row.problem.is_range),
        key=lambda p: (p.n, p.k, p.m_min, p.m_max),
    )
    for i, first in enumerate(ranges):
        assert first.m_max is not None
        for second in ranges[i + 1 :]:
            assert second.m_min is not None and second.m_max is not None
            if (second.n, second.k) != (first.n, first.k) or second.m_min > first.m_max:
                break
            issues.append(
                f"row {second.describe()}: problem: its M range overlaps row {first.describe()} for "
                f"M in [{second.m_min},{min(first.m_max, second.m_max)}] (lookup takes "
                f"{first.describe()} there); make the ranges disjoint"
            )
    return issues


# ------------------------------------------------------------------------------------- diff
def _problem_key(problem: Problem) -> tuple[int, int, int, int, int]:
    """Sort key of a problem, the order tables keep their rows in."""
    if problem.m is not None:
        return (problem.n, problem.k, problem.m, 0, problem.m)
    assert problem.m_min is not None and problem.m_max is not None
    return (problem.n, problem.k, problem.m_min, 1, problem.m_max)


def latencies(schedule: Schedule | None) -> dict[str, float]:
    """The latencies (``LATENCY_KEYS``) a row's provenance holds as numbers, in preference order."""
    if schedule is None:
        return {}
    out: dict[str, float] = {}
    for key in LATENCY_KEYS:
        value = schedule.provenance.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def field_value(schedule: Schedule, name: str) -> Any:
    """A ``SCHEDULE_FIELDS`` value of ``schedule``: a common field, or its engine's setting of that
    name (None where its engine has none)."""
    if name in ("collective", "dtype", "world_size", "overlap", "engine"):
        return getattr(schedule, name)
    return getattr(schedule.settings, name, None)


def changed_fields(a: Schedule, b: Schedule) -> tuple[str, ...]:
    """The ``SCHEDULE_FIELDS`` in which ``a`` and ``b`` differ.

    When ``overlap`` differs only it (and header fields) are reported: the other fields mean nothing
    on the side that does not overlap. Two rows without overlap compare on the header fields only.
    """
    header = tuple(name for name in _HEADER_FIELDS if getattr(a, name) != getattr(b, name))
    if a.overlap != b.overlap:
        return (*header, "overlap")
    if not a.overlap:
        return header
    return tuple(name for name in SCHEDULE_FIELDS if field_value(a, name) != field_value(b, name))


def _provenance_changed(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[str, ...]:
    keys = list(dict.fromkeys([*a, *b]))
    return tuple(str(key) for key in keys if a.get(key) != b.get(key))


@dataclass(frozen=True, kw_only=True, slots=True)
class RowDiff:
    """How one problem's row compares between table ``a`` and table ``b``.

    ``status``: ``only_a``, ``only_b``, ``changed`` (some ``SCHEDULE_FIELDS`` differ, listed in
    ``fields``) or ``same`` (the runtime would do the same; the provenance may still differ, listed
    in ``provenance_changed``). ``latency_a``/``latency_b``: the rows' provenance latencies
    (``measured_ms``, ``predicted_ms``) where present.
    """

    problem: Problem
    status: DiffStatus
    a: Schedule | None
    b: Schedule | None
    fields: tuple[str, ...] = ()
    provenance_changed: tuple[str, ...] = ()
    latency_a: dict[str, float] = field(default_factory=dict)
    latency_b: dict[str, float] = field(default_factory=dict)

    @property
    def differs(self) -> bool:
        """True unless the rows are the same schedule (provenance aside)."""
        return self.status != "same"


def diff_tables(a: ScheduleTable, b: ScheduleTable) -> list[RowDiff]:
    """One ``RowDiff`` per problem in either table, in table order (N, K, then M or m_min).

    Rows are matched by problem (exact M, or the identical M range); rows of the two tables are
    compared field by field whatever their headers (compare the headers' fingerprints separately).
    """
    rows_a = {row.problem: row for row in a.rows}
    rows_b = {row.problem: row for row in b.rows}
    out: list[RowDiff] = []
    for problem in sorted(rows_a.keys() | rows_b.keys(), key=_problem_key):
        ra, rb = rows_a.get(problem), rows_b.get(problem)
        lat = {"latency_a": latencies(ra), "latency_b": latencies(rb)}
        if rb is None:
            out.append(RowDiff(problem=problem, status="only_a", a=ra, b=None, **lat))
        elif ra is None:
            out.append(RowDiff(problem=problem, status="only_b", a=None, b=rb, **lat))
        else:
            fields_ = changed_fields(ra, rb)
            out.append(
                RowDiff(
                    problem=problem,
                    status="changed" if fields_ else "same",
                    a=ra,
                    b=rb,
                    fields=fields_,
                    provenance_changed=_provenance_changed(ra.provenance, rb.provenance),
                    **lat,
                )
            )
    return out


def header_differences(a: ScheduleTable, b: ScheduleTable) -> list[tuple[str, Any, Any]]:
    """(name, value in a, value in b) for every header and fingerprint field that differs."""
    out: list[tuple[str, Any, Any]] = []
    for name in ("collective", "world_size", "dtype", "schema_version"):
        if getattr(a, name) != getattr(b, name):
            out.append((name, getattr(a, name), getattr(b, name)))
    fa, fb = a.fingerprint.to_dict(), b.fingerprint.to_dict()
    out.extend((f"fingerprint.{name}", fa[name], fb[name]) for name in fa if fa[name] != fb[name])
    return out


# ------------------------------------------------------------------------------------- find
def find_row(
    device_key: str, collective: str, world_size: int, dtype: str, m: int, n: int, k: int
) -> tuple[Schedule | None, Path | None, list[Path]]:
    """(row, its file, every file read) of the row ``lookup_schedule`` takes for this call on the
    machine of ``device_key`` (``fo_kernels.table.best_row`` over ``find_tables``); (None, None,
    files) when no row matches (the runtime then runs overlap: false)."""
    paths = find_tables(device_key, collective, world_size, dtype)
    tables = [load_table(path) for path in paths]
    row = best_row(tables, m, n, k)
    if row is None:
        return None, None, paths
    path = next(p for p, t in zip(paths, tables, strict=True) if any(r is row for r in t.rows))
    return row, path, paths


def find_tables(device_key: str, collective: str, world_size: int, dtype: str) -> list[Path]:
    """The existing table files for this header in ``table_search_path()`` order (the order
    ``lookup_schedule`` reads them in: an exact-shape row in any of them beats an M-range row)."""
    paths = (table_path(root, device_key, collective, world_size, dtype) for root in table_search_path())
    return [path for path in paths if path.is_file()]


def known_device_keys() -> list[str]:
    """Device keys that have a table folder somewhere in the search path, sorted."""
    keys: set[str] = set()
    for root in table_search_path():
        if root.is_dir():
            keys.update(
                child.name for child in root.iterdir() if child.is_dir() and any(child.glob("*.yaml"))
            )
    return sorted(keys)
