"""Merging rows into a table file under an inter-process lock, so several search workers (or several
``fo-tune search`` runs) can write into the same file without losing rows. A row takes only its
own Ms from the rows it overlaps, which keep the rest (``fo_kernels.table.spans``, the MoE tables'
rule too), so a merge loses no M a table covered; a row lookup takes first
(``fo_kernels.table.row_rank``: a measured row before a predicted one) keeps its Ms.

The lock is a second file beside the table, ``<table>.yaml.lock`` (``filelock``); the runtime never
takes it, because tables are replaced by an atomic rename and a reader sees the old or the new file.
``filelock`` is a dependency of the tuner only (the ``tune`` extra); the runtime never imports it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

from fo_kernels.errors import FoTuneError, TableError, TableNotFoundError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.moe.table import MoeRow, MoeTable
from fo_kernels.schedule import SHARDED_COLLECTIVES, Schedule
from fo_kernels.table import (
    ScheduleTable,
    row_kind,
    row_rank,
    save_table,
    table_filename,
)
from fo_kernels.table.paths import where_it_belongs
from fo_kernels.table.spans import Span, SpanRows, put_row
from fo_tune.tables.kinds import load_dense_table, paused_gc

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


def is_lock_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a table's lock file as a merge leaves it beside the table: named
    ``<table>.yaml.lock`` and empty (``filelock`` writes nothing into it). A glob of a table folder
    (``fo-tune table validate TABLES/*/*``) names these too."""
    path = Path(path)
    return path.name.endswith(".yaml" + LOCK_SUFFIX) and path.is_file() and path.stat().st_size == 0


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
    a row takes only its own Ms from the rows of its (N, K) it overlaps, which keep the rest, so
    re-tuning a range loses no M the table covered and leaves no overlapping rows behind), saves it with
    ``fo_kernels.table.save_table`` (atomic rename) and returns the merged table. Processes merging
    into the same file concurrently therefore never lose each other's rows (as long as every writer
    goes through ``merge_rows``; a bare ``save_table`` is not serialised); readers never wait.

    The header's fingerprint becomes ``fingerprint``: a table says which library versions its latest
    rows were measured with, and the runtime's version-drift warning compares against those. Rows
    kept from earlier merges stay (they may have been measured with older versions; record versions
    in their provenance where that matters, or re-tune).

    A predicted row (provenance ``mode: predict``) takes no M from a measured row: it goes in over
    the Ms no measured row covers, or is left out; measured beats predicted, and a predicted row of
    the machine's own calibration beats one with a ``basis`` (``merge_rank``). Predicted rows alone
    merged into a table that holds measured rows leave its fingerprint as it is: the versions the
    runtime's drift warning compares against stay those its measured rows ran with (a predicted
    row's calibration is in its provenance).

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
        with lock, paused_gc():  # (100,000 rows' objects made the collector walk them again and again)
            try:
                table = load_dense_table(path)
            except TableNotFoundError:
                table = ScheduleTable(
                    fingerprint=fingerprint, collective=collective, world_size=world_size, dtype=dtype
                )
            check_target(table, path, fingerprint, collective=collective, world_size=world_size, dtype=dtype)
            if not _keeps_header(table, rows):
                table = replace(table, fingerprint=fingerprint)
            table = merge_into(table, rows)
            save_table(table, path)
    except Timeout:
        raise TableLockTimeout(
            f"{lock_path(path)}: another process has held the table's lock for more than "
            f"{lock_timeout_s:g} s; wait for it to finish (or stop it) and merge again"
        ) from None
    return table


def check_target(
    table: ScheduleTable,
    path: Path,
    fingerprint: Fingerprint,
    *,
    collective: str,
    world_size: int,
    dtype: str,
) -> None:
    """``TableError`` (one line, saying what to do) unless rows of ``collective``, ``world_size``
    and ``dtype`` measured on ``fingerprint`` merge into ``table`` (the file at ``path``): its header
    is theirs and its fingerprint is for the same hardware. ``merge_rows`` checks it under the lock;
    a caller merging into several files checks each first, so a bad one stops it before any write."""
    check_header(table, path, fingerprint, collective=collective, world_size=world_size, dtype=dtype)
    mismatch = _hardware_mismatch(table.fingerprint, fingerprint)
    if mismatch is not None:
        raise TableError(
            f"{path}: the table is for other hardware ({mismatch}); merge the rows into the "
            f"table of {fingerprint.device_key}, or move this file away to start a new one"
        )


def check_header(
    table: ScheduleTable,
    path: Path,
    fingerprint: Fingerprint,
    *,
    collective: str,
    world_size: int,
    dtype: str,
    then: str = "merge again",
) -> None:
    """``TableError`` (one line, saying what to do) unless ``table``'s header is that of rows of
    ``collective``, ``world_size`` and ``dtype`` (of ``fingerprint``'s machine): the part of
    ``check_target`` a search checks before it starts, when the ranks' hardware is not known yet."""
    header = (table.collective, table.world_size, table.dtype)
    if header != (collective, world_size, dtype):
        own = table_filename(collective, world_size, dtype)
        if path.name == own:  # the file, not the rows, is under another table's name
            home = where_it_belongs(path, table.fingerprint.device_key, table_filename(*header))
            fix = f"{home} (lookup refuses it here), then {then}"
        else:
            fix = f"merge them into their own table, {fingerprint.device_key}/{own}"
        raise TableError(
            f"{path}: holds {header[0]} world size {header[1]} {header[2]} rows, these are "
            f"{collective} world size {world_size} {dtype}; {fix}"
        )


def _keeps_header(table: ScheduleTable, rows: Sequence[Schedule]) -> bool:
    """Whether merging ``rows`` leaves ``table``'s fingerprint: they are all predicted and it holds
    a measured row (whose versions the header records)."""
    predicted_only = all(row_kind(row) == "predicted" for row in rows)
    return predicted_only and any(row_kind(row) == "measured" for row in table.rows)


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


def _m_span(row: Schedule) -> Span:
    p = row.problem
    return (p.m, p.m) if p.m is not None else (p.m_min, p.m_max)  # type: ignore[return-value]


def _with_ms(row: Schedule, ms: Span) -> Schedule:
    """``row`` (an M-range row) over the Ms ``ms`` with the same settings: a range row's settings
    run any M in its range (its groups are relative weights)."""
    return replace(row, problem=replace(row.problem, m_min=ms[0], m_max=ms[1]))


def merge_rank(row: Schedule) -> tuple[bool, bool, bool]:
    """Where a merge ranks ``row`` among rows that hold an M, lower first: measured, then a
    predicted row of its machine's own calibration, then one that rests on another's (its
    ``basis``: an extrapolated calibration, a sibling GPU's profile); within one rank as lookup
    takes them (``row_rank``: exact before range). A predicted table row and an extrapolated one
    never share an M after a merge, so lookup needs no third rank."""
    predicted, is_range = row_rank(row)
    return (predicted, predicted and bool(row.basis), is_range)


def _outranks(rank: tuple[bool, bool, bool], old: Schedule) -> bool:
    """Whether a merge keeps ``old``'s Ms over a row of rank ``rank`` (``merge_rank``)."""
    return merge_rank(old) < rank


def merge_into(table: ScheduleTable, rows: Sequence[Schedule]) -> ScheduleTable:
    """``table`` with ``rows`` merged in, in order, by the merge rule (``fo_kernels.table.spans``):
    a row takes only its own Ms (one M, or its range) from the rows of its (N, K) it overlaps,
    exact or range, which keep the rest with their settings: a range is trimmed, split in two, or
    removed when covered, an exact row removed when covered. A row that lookup takes first
    (``row_rank``: measured before predicted, then exact before range) keeps its Ms: a predicted
    row goes in over the Ms no measured row holds (in parts, or not at all), and a measured range
    around a measured exact row, while an exact row splits an older range of its kind; a predicted
    row with a ``basis`` takes no M from one without (``merge_rank``). For
    ``reduce_scatter`` and ``all_gather`` every part is narrowed to the Ms divisible by the world
    size, and a part without one is dropped. O((n + m) log(n + m)) for n rows and m new ones, plus
    the moves within one (N, K); no M a row held before is left without one, and no row it writes
    overlaps another.
    """
    step = table.world_size if table.collective in SHARDED_COLLECTIVES else 1
    buckets: dict[tuple[int, int], tuple[SpanRows[Schedule], SpanRows[Schedule]]] = {}
    for (n, k), group in itertools.groupby(table.rows, key=lambda r: (r.problem.n, r.problem.k)):
        both = list(group)
        exact = SpanRows([r for r in both if not r.problem.is_range], _m_span)
        buckets[n, k] = (exact, SpanRows([r for r in both if r.problem.is_range], _m_span))
    for row in rows:
        nk = (row.problem.n, row.problem.k)
        if nk not in buckets:
            buckets[nk] = (SpanRows([], _m_span), SpanRows([], _m_span))
        exact, ranges = buckets[nk]
        into, beside = (ranges, exact) if row.problem.is_range else (exact, ranges)
        put_row(
            row, into, [beside], respan=_with_ms, step=step, yields_to=partial(_outranks, merge_rank(row))
        )
    merged = [r for exact, ranges in buckets.values() for part in (exact, ranges) for r in part.rows]
    return replace(table, rows=merged)


def kept_measured(merged: ScheduleTable, rows: Sequence[Schedule]) -> list[Schedule]:
    """The measured rows of ``merged`` (the result of merging ``rows``, none of them) that hold Ms
    of a predicted row of ``rows``: the rows that kept those Ms over it (what a search or a pull
    reports). Each once, in table order."""
    ours = {id(row) for row in rows}
    predicted: dict[tuple[int, int], list[Span]] = {}
    for row in rows:
        if row_kind(row) == "predicted":
            predicted.setdefault((row.problem.n, row.problem.k), []).append(_m_span(row))
    out = []
    for row in merged.rows:
        if id(row) in ours or row_kind(row) != "measured":
            continue
        lo, hi = _m_span(row)
        if any(a <= hi and lo <= b for a, b in predicted.get((row.problem.n, row.problem.k), ())):
            out.append(row)
    return out


def merge_moe_into(table: MoeTable, rows: Sequence[MoeRow]) -> MoeTable:
    """``table`` with the MoE ``rows`` merged in, in order, by the merge rule
    (``MoeTable.upsert_all`` with ``measured_first``, O((n + m) log(n + m))): a row takes its token
    range from the rows of its experts' shape it overlaps, which keep the tokens outside it, and a
    predicted row takes no tokens from a measured one (it is put in over the tokens no measured row
    covers, or left out). The result has no two rows of one experts' shape overlapping."""
    table.upsert_all(rows, measured_first=True)
    return table
