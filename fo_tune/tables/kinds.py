"""Which kind of table a file holds, and loading it as that kind: a dense schedule table
(``fo_kernels.table``) or an MoE table (``fo_kernels.moe.table``).

A file is an MoE table when its name starts with the MoE prefix (``moe-w<W>-<dtype>.yaml``, the
only name the runtime reads MoE rows from) or its ``kind`` says so (``MOE_TABLE_KIND``); any other
file is a dense table. Either marker is the format's own, so a file is never loaded by trying one
format and falling back to the other: a ``moe-`` file holding a dense table is an MoE table with
the wrong ``kind`` (loading names it).

Loading builds and checks every row, as ``load_table`` does, in a fraction of its time at fleet
scale (``build_table``): the garbage collector is paused while the rows are read and built (the
objects of 100,000 rows made it walk the heap again and again: half the parse time, a quarter of
the build), and the rows of one schedule (the same engine and settings, another M or provenance)
share the engine settings their first row built (docs/perf-notes.md#tables-and-lookup).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from fo_kernels.errors import ScheduleError, TableError
from fo_kernels.moe.table import MOE_TABLE_KIND, MOE_TABLE_PREFIX, MoeTable
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.table import TABLE_SCHEMA_VERSION, ScheduleTable
from fo_kernels.table.format import TableHeader, build_row, parse_header, read_table_data

TableKind = Literal["dense", "moe"]

# The row keys that differ between rows sharing one schedule: a row is its schedule's first row
# (built in full) with these replaced.
_PER_ROW_KEYS = ("problem", "provenance", "basis")


def is_moe_name(path: str | os.PathLike[str]) -> bool:
    """True when the file's name is an MoE table's (``moe-...``)."""
    return Path(path).name.startswith(f"{MOE_TABLE_PREFIX}-")


def table_kind(path: str | os.PathLike[str], data: Any) -> TableKind:
    """``moe`` for an MoE table (by its name or its ``kind``), else ``dense``; ``data``: the file's
    parsed content."""
    if is_moe_name(path):
        return "moe"
    if isinstance(data, Mapping) and data.get("kind") == MOE_TABLE_KIND:
        return "moe"
    return "dense"


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The garbage collector off for the block (back to its state after it): reading a table makes
    no reference cycles, only many objects, each batch of which triggered a walk of all of them."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _rows_of(header: TableHeader, rows: list[Any], source: str) -> list[Schedule]:
    """Every row of a table file built (``build_row``'s checks and errors). A schema-2 row whose
    keys and values other than ``_PER_ROW_KEYS`` are an earlier row's is that row with its own
    problem, provenance and basis (``dataclasses.replace``: the ``Schedule`` checks run again);
    any error is raised by ``build_row`` on the row itself, so it reads as loading's own."""
    if header.schema_version != TABLE_SCHEMA_VERSION:
        return [build_row(row, i, header, source) for i, row in enumerate(rows)]
    first: dict[tuple[tuple[str, ...], str], Schedule] = {}
    out: list[Schedule] = []
    for i, row in enumerate(rows):
        try:
            # the rest of the row as text (repr: 1, 1.0 and True differ), with the row's keys in order
            key = (tuple(row), repr({k: v for k, v in row.items() if k not in _PER_ROW_KEYS}))
            shared = first.get(key)
            if shared is None:
                shared = first[key] = build_row(row, i, header, source)
                out.append(shared)
                continue
            built = replace(
                shared,
                problem=Problem.from_dict(row["problem"]),
                provenance=row.get("provenance") or {},
                basis=row.get("basis") or "",
            )
        except (AttributeError, TypeError, ValueError, KeyError, ScheduleError):
            built = build_row(row, i, header, source)  # (raises loading's own error for the row)
        out.append(built)
    return out


def build_table(data: Any, source: str) -> ScheduleTable:
    """``ScheduleTable.from_dict(data, source)``: the same table, or the same ``TableError``
    naming ``source``, the row and the field; faster for many rows of few schedules (``_rows_of``)."""
    header, rows = parse_header(data, source)
    schedules = _rows_of(header, rows, source)
    try:
        return ScheduleTable(
            fingerprint=header.fingerprint,
            collective=header.collective,
            world_size=header.world_size,
            dtype=header.dtype,
            rows=schedules,
        )
    except TableError as exc:
        raise TableError(f"{source}: {exc}") from None


def load_any_table(path: str | os.PathLike[str]) -> ScheduleTable | MoeTable:
    """The table file at ``path`` read once and checked as its kind: what ``load_moe_table`` or
    ``load_table`` checks (``TableNotFoundError`` when there is none, ``TableError`` naming the
    path when it is malformed)."""
    with paused_gc():
        data = read_table_data(path)
        if table_kind(path, data) == "moe":
            return MoeTable.from_dict(data, source=str(path))
        return build_table(data, str(path))
