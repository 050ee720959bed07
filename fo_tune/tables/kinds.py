"""Which kind of table a file holds, and loading it as that kind: a dense schedule table
(``fo_kernels.table``) or an MoE table (``fo_kernels.moe.table``).

A file is the kind its ``kind`` says (``TABLE_KIND`` or ``MOE_TABLE_KIND``); a file whose ``kind``
is neither is an MoE table when its name starts with the MoE prefix (``moe-w<W>-<dtype>.yaml``,
the only name the runtime reads MoE rows from), else a dense table. Each marker is the format's
own, so a file is never loaded by trying one format and falling back to the other: a table under
the other kind's name is read as what it says it is, and ``fo-tune table validate`` names its
name as the problem (``fo_tune.tables.find.placement``), where the runtime's lookup refuses it.

Loading builds and checks every row, as ``load_table`` does, in a fraction of its time at fleet
scale (``build_table``): the garbage collector is paused while the rows are read and built (the
objects of 100,000 rows made it walk the heap again and again: half the parse time, a quarter of
the build), and the rows of one schedule (the same engine and settings, another M or provenance)
share the engine settings their first row built; ``load_any_tables`` (``fo-tune table diff``)
takes a row line an earlier file of the same header held as that file's row
(docs/perf-notes.md#tables-and-lookup).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import yaml

from fo_kernels.errors import ScheduleError, TableError
from fo_kernels.moe.table import MOE_TABLE_KIND, MOE_TABLE_PREFIX, MoeTable
from fo_kernels.schedule import Problem, Schedule
from fo_kernels.table import TABLE_KIND, TABLE_SCHEMA_VERSION, ScheduleTable
from fo_kernels.table.format import TableHeader, build_row, parse_header, read_table_data, read_table_text
from fo_kernels.table.text import (
    decode_row_lines,
    load_document,
    rows_first_line,
    split_table_text,
    unreadable,
)

TableKind = Literal["dense", "moe"]

# The row keys that differ between rows sharing one schedule: a row is its schedule's first row
# (built in full) with these replaced.
_PER_ROW_KEYS = ("problem", "provenance", "basis")


def is_moe_name(path: str | os.PathLike[str]) -> bool:
    """True when the file's name is an MoE table's (``moe-...``)."""
    return Path(path).name.startswith(f"{MOE_TABLE_PREFIX}-")


def table_kind(path: str | os.PathLike[str], data: Any) -> TableKind:
    """``moe`` for an MoE table (by its ``kind``, else by its name), else ``dense``; ``data``: the
    file's parsed content."""
    kind = data.get("kind") if isinstance(data, Mapping) else None
    if kind in (MOE_TABLE_KIND, TABLE_KIND):
        return "moe" if kind == MOE_TABLE_KIND else "dense"
    return "moe" if is_moe_name(path) else "dense"


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


def _rows_of(
    header: TableHeader, rows: list[Any], source: str, given: Mapping[int, Schedule] | None = None
) -> list[Schedule]:
    """Every row of a table file built (``build_row``'s checks and errors), but those ``given``
    (by index: rows an earlier table of the same header held). A schema-2 row whose keys and
    values other than ``_PER_ROW_KEYS`` are an earlier row's is that row with its own problem,
    provenance and basis (``dataclasses.replace``: the ``Schedule`` checks run again); any error
    is raised by ``build_row`` on the row itself, so it reads as loading's own."""
    given = given or {}
    if header.schema_version != TABLE_SCHEMA_VERSION:
        return [given[i] if i in given else build_row(row, i, header, source) for i, row in enumerate(rows)]
    first: dict[tuple[tuple[str, ...], str], Schedule] = {}
    out: list[Schedule] = []
    for i, row in enumerate(rows):
        if i in given:
            out.append(given[i])
            continue
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
    return ScheduleTable.of_rows(header, _rows_of(header, rows, source), source)


def load_dense_table(path: str | os.PathLike[str]) -> ScheduleTable:
    """``fo_kernels.table.load_table(path)``: the same table, or the same error, built as
    ``build_table`` builds it (the collector paused), for the tuner's reads of a table it merges
    into."""
    with paused_gc():
        return build_table(read_table_data(path), str(path))


def _decoded(lines: list[str], source: str, text: str, todo: list[int] | None = None) -> list[Any]:
    """The row ``lines`` of the file ``text`` (those at the indices ``todo``, default all) decoded as
    ``parse_table_text`` decodes them; ``TableError`` naming ``source`` and the row and line that
    does not read."""
    try:
        return decode_row_lines(lines if todo is None else [lines[i] for i in todo])
    except yaml.YAMLError as exc:
        error = exc
    try:  # again, every line, for the row's index and line in the file
        decode_row_lines(lines, first_line=rows_first_line(text))
    except yaml.YAMLError as exc:
        error = exc
    raise TableError(unreadable(source, error)) from None


# Per header that building a row depends on (schema version, collective, dtype, world size; as
# text), each row line of the tables read so far and the row it was built into.
_KnownRows = dict[str, dict[str, Schedule]]


def _load(path: str | os.PathLike[str], known: _KnownRows) -> ScheduleTable | MoeTable:
    """``load_any_table(path)``; a row line that a table in ``known`` of the same header held
    (two versions of one table) is that table's row, neither decoded nor built again."""
    source = str(path)
    text = read_table_text(path)
    try:
        split = split_table_text(text)
        if split is None:
            return _of_kind(path, load_document(text), source)
    except yaml.YAMLError as exc:
        raise TableError(unreadable(source, exc)) from None
    head, lines = split
    if table_kind(path, head) == "moe":
        return _of_kind(path, {**head, "rows": _decoded(lines, source, text)}, source)
    header_text = repr(
        tuple(head.get(key) for key in ("schema_version", "collective", "dtype", "world_size"))
    )
    seen = known.setdefault(header_text, {})
    given = {i: seen[line] for i, line in enumerate(lines) if line in seen}
    decoded = iter(_decoded(lines, source, text, [i for i in range(len(lines)) if i not in given]))
    rows = [None if i in given else next(decoded) for i in range(len(lines))]
    header, _ = parse_header({**head, "rows": rows}, source)
    schedules = _rows_of(header, rows, source, given)
    table = ScheduleTable.of_rows(header, schedules, source)
    seen.update(zip(lines, schedules, strict=True))
    return table


def _of_kind(path: str | os.PathLike[str], data: Any, source: str) -> ScheduleTable | MoeTable:
    """A table file's parsed ``data`` checked and built as its kind."""
    if table_kind(path, data) == "moe":
        return MoeTable.from_dict(data, source=source)
    return build_table(data, source)


def load_any_tables(paths: Sequence[str | os.PathLike[str]]) -> list[ScheduleTable | MoeTable]:
    """``load_any_table`` of each path, in order (the first error raised, as there): a row line
    that an earlier file of the same header held is built once (``diff`` of two versions of a
    fleet-scale table reads the second at the cost of its new rows)."""
    known: _KnownRows = {}
    with paused_gc():
        return [_load(path, known) for path in paths]


def load_any_table(path: str | os.PathLike[str]) -> ScheduleTable | MoeTable:
    """The table file at ``path`` read once and checked as its kind: what ``load_moe_table`` or
    ``load_table`` checks (``TableNotFoundError`` when there is none, ``TableError`` naming the
    path when it is malformed)."""
    return load_any_tables([path])[0]
