"""``fo-tune table pull`` as a library call: the tables of every study in a shared storage, merged
into a table folder with the rules every merge follows (``fo_tune.tables.merge``).

The fleet's workers record their decided rows in their studies (``fo_tune.tables.stored``; of a
study's records, the one decided from most trials). ``read_pull`` reads every study's record from
the storage, all of it before anything is written, so a storage that fails mid-read (its server
stopped) is one ``StorageError`` and no table changes; ``write_pulled`` groups the rows by table
(device key, collective, world size, dtype) and merges each group, oldest record first, into
``<table_dir>/<device key>/<file>`` under the table's file lock (``merge_rows``): a row takes only
its own Ms from the rows it overlaps, which keep the rest, and a predicted row takes no M from a
measured one (from the storage or already in the file). The header's fingerprint is the newest
record's of that table. ``pull_tables`` is the two.

A record holds a dense table's rows: `fo-tune search -c moe` plans the MoE table offline and
records no study, so the MoE tables (``moe-w<W>-<dtype>.yaml``) in ``table_dir`` are left as they are.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fo_kernels.errors import TableNotFoundError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import Schedule
from fo_kernels.table import table_path
from fo_tune.search.storage import storage_lost
from fo_tune.tables.kinds import load_dense_table
from fo_tune.tables.merge import check_target, kept_measured, merge_rows
from fo_tune.tables.stored import StoredRows, best_records

# What a pull that lost its storage says to do (``read_pull``).
PULL_AGAIN = "no table was written: once it answers again, run the pull again"


@dataclass(frozen=True, kw_only=True, slots=True)
class Pulled:
    """What ``read_pull`` read: how many studies the storage holds, and the records it keeps."""

    studies: int
    records: list[StoredRows]


@dataclass(frozen=True, kw_only=True, slots=True)
class PulledTable:
    """One table file ``pull_tables`` wrote: how many rows came from how many studies, how many the
    file holds now, and the measured rows that kept Ms a predicted row from the storage was for
    (``kept_measured``)."""

    path: Path
    device_key: str
    collective: str
    world_size: int
    dtype: str
    studies: int
    pulled: int
    rows: int
    kept_measured: int


def _group(records: list[StoredRows]) -> dict[tuple[str, str, int, str], list[StoredRows]]:
    groups: dict[tuple[str, str, int, str], list[StoredRows]] = {}
    for record in records:  # (oldest first: best_records' order)
        groups.setdefault(record.table_key, []).append(record)
    return groups


def check_table_dir(table_dir: Path) -> None:
    """``OutputError`` unless tables can be written under ``table_dir`` (a folder, or one that can
    be made): what a pull checks before it reads the storage."""
    from fo_tune.output import check_ancestor

    check_ancestor(Path(os.path.abspath(table_dir)) / "table", table_dir)


def read_pull(storage: Any, url: str) -> Pulled:
    """Every study's record in the opened ``storage`` (of ``url``, which messages name), read in
    one go. ``StorageError`` saying to pull again when the storage fails during the read;
    ``TableError`` naming the study for a malformed record."""
    with storage_lost(url, during="the pull", then=PULL_AGAIN, lost_on=(OSError,)):
        studies = storage.get_all_studies()
    return Pulled(studies=len(studies), records=best_records(studies))


def pull_tables(storage: Any, table_dir: Path, url: str) -> list[PulledTable]:
    """``read_pull`` then ``write_pulled``: the rows of every study in ``storage`` (of ``url``)
    merged into the tables under ``table_dir``."""
    return write_pulled(read_pull(storage, url).records, table_dir)


def write_pulled(records: list[StoredRows], table_dir: Path) -> list[PulledTable]:
    """Merge ``records`` (``read_pull``'s) into the tables under ``table_dir`` (see the module
    docstring); one ``PulledTable`` per file written, [] for no record. Raises, before any file is
    written, ``OutputError`` for a table file that cannot be written under ``table_dir`` (a file in
    its place, a read-only folder) and ``TableError`` for a malformed one there (not YAML, a
    duplicate row), one of other hardware or one holding another table's rows (``check_target``)."""
    from fo_tune.output import check_writable_file

    groups = _group(records)
    for (device_key, collective, world_size, dtype), group in groups.items():  # all good before any write
        path = table_path(table_dir, device_key, collective, world_size, dtype)
        check_writable_file(path, what="table file")
        with contextlib.suppress(TableNotFoundError):  # (a malformed file raises its TableError)
            table = load_dense_table(path)
            check_target(
                table, path, group[-1].fingerprint, collective=collective, world_size=world_size, dtype=dtype
            )
    out: list[PulledTable] = []
    for (device_key, collective, world_size, dtype), group in groups.items():
        fingerprint: Fingerprint = group[-1].fingerprint
        rows: list[Schedule] = [row for record in group for row in record.rows]
        path = table_path(table_dir, device_key, collective, world_size, dtype)
        table = merge_rows(path, fingerprint, rows, collective=collective, world_size=world_size, dtype=dtype)
        kept = kept_measured(table, rows)
        out.append(
            PulledTable(
                path=path,
                device_key=device_key,
                collective=collective,
                world_size=world_size,
                dtype=dtype,
                studies=len(group),
                pulled=len(rows),
                rows=len(table.rows),
                kept_measured=len(kept),
            )
        )
    return out
