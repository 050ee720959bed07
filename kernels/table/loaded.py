"""A table file as the runtime reads it (``LoadedTable``): the header checked, every row's problem
checked and indexed (``fo_kernels.table.index``), and a row decoded and built into a ``Schedule``
(every field checked) the first time a lookup takes it.

Building every row is what ``load_table`` does, and what ``fo-tune table validate`` is for; the
runtime's first lookup pays for the rows' problems only: in a file in the written form
(``fo_kernels.table.text``) each row's problem is read from the start of its line, and the rest of
the line stays text until a lookup takes the row. A 100,000-row table costs the first lookup in a
training or serving process well under a second (docs/perf-notes.md#tables-and-lookup).
"""

from __future__ import annotations

import os
import threading

from fo_kernels.engines import engine_names, engine_settings
from fo_kernels.errors import TableError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import Schedule
from fo_kernels.table.block import TOO_BIG
from fo_kernels.table.format import (
    TableHeader,
    build_row,
    parse_header,
    read_table_text,
    row_kind,
    row_problem_key,
)
from fo_kernels.table.index import ProblemKey, RowIndex
from fo_kernels.table.text import decode_row_at, lazy_table_data, line_problem, loads, row_built_once


class LoadedTable:
    """One table file's header and rows, found by problem, built on first use (see the module
    docstring). ``find_exact`` / ``find_range`` / ``find`` answer as ``ScheduleTable``'s do."""

    __slots__ = ("_built", "_index", "_lock", "_raw", "header", "source")

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        data = lazy_table_data(text, source)  # (the rows stay text until a lookup takes one)
        self.header: TableHeader
        self.header, self._raw = parse_header(data, source)
        self._decode_unkeyed()
        keys = [self._key(i) for i in range(len(self._raw))]
        try:
            self._index = RowIndex(keys)
        except TableError as exc:
            raise TableError(f"{source}: {exc}") from None
        self._built: dict[int, Schedule] = {}
        self._lock = threading.Lock()
        # Each engine's settings type is imported with the first row of that engine built; import
        # them here, in the first lookup (a few ms), so no later lookup pays for an import.
        for name in engine_names():
            engine_settings(name)

    def _decode_unkeyed(self) -> None:
        """Decode, in one ``json`` call, the row lines whose problem is not at their start (a
        script's lines, with other key order or separators): one call per line took twice as long."""
        lines = [i for i, raw in enumerate(self._raw) if isinstance(raw, str) and line_problem(raw) is None]
        if not lines:
            return
        try:
            rows = loads("[" + ",".join(self._raw[i] for i in lines) + "]")
        except TOO_BIG:  # a line that is not JSON, too big or with a key repeated: ``_key`` decodes each
            return
        for i, row in zip(lines, rows, strict=True):
            self._raw[i] = row

    def _key(self, i: int) -> ProblemKey:
        """Row i's problem: read from the start of its line, else from the row decoded."""
        raw = self._raw[i]
        if isinstance(raw, str):
            key = line_problem(raw)
            if key is not None:
                return key
            raw = self._raw[i] = decode_row_at(self._raw, i, self.source)
        return row_problem_key(raw, i, self.header, self.source)

    @property
    def fingerprint(self) -> Fingerprint:
        return self.header.fingerprint

    @property
    def collective(self) -> str:
        return self.header.collective

    @property
    def world_size(self) -> int:
        return self.header.world_size

    @property
    def dtype(self) -> str:
        return self.header.dtype

    def __len__(self) -> int:
        return len(self._raw)

    def row(self, i: int) -> Schedule:
        """Row ``i`` (file order) as a ``Schedule``; ``TableError`` naming the row when malformed."""
        with self._lock:
            return row_built_once(
                self._built,
                self._raw,
                i,
                self.source,
                lambda raw: build_row(raw, i, self.header, self.source),
            )

    def find_exact(self, m: int, n: int, k: int, *, kind: str | None = None) -> Schedule | None:
        """The exact-shape row for (m, n, k) (of ``row_kind`` ``kind`` when given)."""
        pos = self._index.exact(m, n, k)
        row = self.row(pos) if pos is not None else None
        return row if row is not None and kind in (None, row_kind(row)) else None

    def find_range(self, m: int, n: int, k: int, *, kind: str | None = None) -> Schedule | None:
        """The M-range row covering m (of ``row_kind`` ``kind`` when given)."""
        pos = self._index.range(m, n, k)
        row = self.row(pos) if pos is not None else None
        return row if row is not None and kind in (None, row_kind(row)) else None

    def find(self, m: int, n: int, k: int) -> Schedule | None:
        """The exact-shape row, else the M-range row covering m, else None."""
        return self.find_exact(m, n, k) or self.find_range(m, n, k)


def read_table(path: str | os.PathLike[str]) -> LoadedTable:
    """The table file at ``path`` as a ``LoadedTable`` (``TableNotFoundError`` when there is none,
    ``TableError`` naming the path, the row and the field when it is malformed)."""
    return LoadedTable(read_table_text(path), str(path))
