"""Merging rows into a table file under an inter-process lock, so several search workers (or several
``fo-tune search`` runs) can write into the same file without losing rows; a predicted row
(``fo_kernels.table.row_kind``) never replaces a measured one.

The lock is a second file beside the table, ``<table>.yaml.lock`` (``filelock``); the runtime never
takes it, because tables are replaced by an atomic rename and a reader sees the old or the new file.
``filelock`` is a dependency of the tuner only (the ``tune`` extra); the runtime never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from fo_kernels.errors import FoTuneError, TableError, TableNotFoundError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.moe.table import MoeRow, MoeTable, experts_key, rows_outside
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.table import (
    ScheduleTable,
    load_table,
    row_kind,
    save_table,
    table_filename,
)

# The lock file beside a table: ``<table>.yaml.lock``.
LOCK_SUFFIX = ".lock"
# Seconds merge_rows waits for another process's merge. A merge holds the lock for one load, upsert
# and save of a small YAML file (milliseconds), so a minute means a stuck or very slow writer.
LOCK_TIMEOUT_S = 60.0


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
    the header ``collective``/``world_size``/``dtype``), merges ``rows`` in, in order (``merge_into``:
    a row replaces the row for the same problem, exact M or the identical M range; an M-range row
    also replaces every range of its (N, K) that it overlaps, so re-tuning a range never leaves
    overlapping ranges behind; the table stays unique per problem), saves it with
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
    check_rows_header(rows, collective=collective, world_size=world_size, dtype=dtype)
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
                own = table_filename(collective, world_size, dtype)
                if path.name == own:  # the file, not the rows, is under another table's name
                    fix = f"rename it to {table_filename(*header)} (lookup refuses it here), then merge again"
                else:
                    fix = f"merge them into their own table, {fingerprint.device_key}/{own}"
                raise TableError(
                    f"{path}: holds {header[0]} world size {header[1]} {header[2]} rows, these are "
                    f"{collective} world size {world_size} {dtype}; {fix}"
                )
            mismatch = _hardware_mismatch(table.fingerprint, fingerprint)
            if mismatch is not None:
                raise TableError(
                    f"{path}: the table is for other hardware ({mismatch}); merge the rows into the "
                    f"table of {fingerprint.device_key}, or move this file away to start a new one"
                )
            table = merge_into(replace(table, fingerprint=fingerprint), rows)
            save_table(table, path)
    except Timeout:
        raise TableLockTimeout(
            f"{lock_path(path)}: another process has held the table's lock for more than "
            f"{lock_timeout_s:g} s; wait for it to finish (or stop it) and merge again"
        ) from None
    return table


def check_rows_header(rows: Sequence[Schedule], *, collective: str, world_size: int, dtype: str) -> None:
    """``TableError`` (naming the row and the field) for a row of another collective, world size or
    dtype than the table's header."""
    header = {"collective": collective, "world_size": world_size, "dtype": dtype}
    for row in rows:
        for key, value in header.items():
            if getattr(row, key) != value:
                raise TableError(
                    f"{key}: the row {row.problem.describe()} says {getattr(row, key)!r}, the table is "
                    f"for {value!r}"
                )


def _ranges_overlap(a: Problem, b: Problem) -> bool:
    if not (a.is_range and b.is_range) or (a.n, a.k) != (b.n, b.k):
        return False
    assert a.m_min is not None and a.m_max is not None and b.m_min is not None and b.m_max is not None
    return a.m_min <= b.m_max and b.m_min <= a.m_max


def merge_into(table: ScheduleTable, rows: Sequence[Schedule]) -> ScheduleTable:
    """``table`` with ``rows`` merged in, in order, by the merge rules (``merge_rows``): a row
    replaces the row for its problem, an M-range row every range of its (N, K) it overlaps, and a
    predicted row is left out where it would replace a measured one. O((n + m) log(n + m)) for n
    rows and m new ones (ranges are compared within their (N, K) only); the result is unique per
    problem, its ranges disjoint."""
    by_problem: dict[Problem, Schedule] = {row.problem: row for row in table.rows}
    ranges: dict[tuple[int, int], list[Problem]] = {}
    for row in table.rows:
        if row.problem.is_range:
            ranges.setdefault((row.problem.n, row.problem.k), []).append(row.problem)
    for row in rows:
        problem = row.problem
        old = by_problem.get(problem)
        same_nk = ranges.setdefault((problem.n, problem.k), []) if problem.is_range else []
        overlapped = [p for p in same_nk if _ranges_overlap(p, problem)]
        if row_kind(row) == "predicted" and any(
            row_kind(by_problem[p]) == "measured" for p in [*([problem] if old else []), *overlapped]
        ):
            continue  # measured beats predicted
        for p in overlapped:  # a new M range replaces every older range it overlaps
            del by_problem[p]
            same_nk.remove(p)
        by_problem[problem] = row
        if problem.is_range:
            same_nk.append(problem)
    return replace(table, rows=list(by_problem.values()))


def merge_moe_into(table: MoeTable, rows: Sequence[MoeRow]) -> MoeTable:
    """``table`` with the MoE ``rows`` merged in, in order, keeping every token count either covers:
    a row takes its token range from the rows of its experts' shape it overlaps, which keep the
    tokens outside it (``MoeTable.upsert``; the same bucket is replaced outright), except that a
    predicted row takes no tokens from a measured one (it is put in over the tokens no measured
    row covers, or left out). The result has no two rows of one experts' shape overlapping."""
    for row in rows:
        pieces = [row]
        if row.kind == "predicted":
            key = experts_key(row.schedule.problem)
            for old in table.rows:
                p = old.schedule.problem
                if old.kind == "measured" and experts_key(p) == key:
                    pieces = [part for piece in pieces for part in rows_outside(piece, p)]
        for piece in pieces:
            table.upsert(piece)
    return table
