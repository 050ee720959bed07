"""``fo-tune table pull`` as a library call: the tables of every study in a shared storage, merged
into a table folder with the rules every merge follows (``fo_tune.tables.merge``).

The fleet's workers record their decided rows in their studies (``fo_tune.tables.stored``);
``pull_tables`` reads every record, groups the rows by table (device key, collective, world size,
dtype) and merges each group, oldest record first, into ``<table_dir>/<device key>/<file>``
under the table's file lock (``merge_rows``): a row takes only its own Ms from the rows it
overlaps, which keep the rest, and a predicted row takes no M from a measured one (from the
storage or already in the file). The header's fingerprint is the newest record's of that table.

A record holds a dense table's rows: `fo-tune search -c moe` plans the MoE table offline and
records no study, so the MoE tables (``moe-w<W>-<dtype>.yaml``) in ``table_dir`` are left as they are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fo_kernels.errors import TableNotFoundError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import Schedule
from fo_kernels.table import load_table, table_path
from fo_tune.tables.merge import kept_measured, merge_rows
from fo_tune.tables.stored import StoredRows, stored_rows


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
    for record in records:  # (oldest first: stored_rows' order)
        groups.setdefault(record.table_key, []).append(record)
    return groups


def pull_tables(storage: Any, table_dir: Path) -> list[PulledTable]:
    """Merge the rows of every study in ``storage`` into the tables under ``table_dir`` (see the
    module docstring); one ``PulledTable`` per file written, [] when no study records rows.
    Raises ``TableError`` for a malformed record (naming the study) or a table file of other
    hardware, before that table is written, and ``OutputError`` for a table file that cannot be
    written under ``table_dir`` (a file in its place, a read-only folder) or ``TableError`` for a
    malformed one there (not YAML, a duplicate row), before any is written."""
    from fo_tune.output import check_writable_file

    groups = _group(stored_rows(storage))
    for device_key, collective, world_size, dtype in groups:  # every file good before any is written
        path = table_path(table_dir, device_key, collective, world_size, dtype)
        check_writable_file(path, what="table file")
        with contextlib.suppress(TableNotFoundError):  # (a malformed file raises its TableError)
            load_table(path)
    out: list[PulledTable] = []
    for (device_key, collective, world_size, dtype), records in groups.items():
        fingerprint: Fingerprint = records[-1].fingerprint
        rows: list[Schedule] = [row for record in records for row in record.rows]
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
                studies=len(records),
                pulled=len(rows),
                rows=len(table.rows),
                kept_measured=len(kept),
            )
        )
    return out
