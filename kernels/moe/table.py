"""The MoE schedule table: ``MoeTable`` (one file's header and rows), its loading and saving, and
the runtime's lookup of a call's row (``MoeTableCache.lookup``, choosing with ``best_moe_row``).

One file per (device key, world size, dtype), ``<root>/<device_key>/moe-w<world_size>-<dtype>.yaml``,
in the dense tables' folders (``fo_kernels.table.table_search_path``: ``$FO_TUNE_TABLE_DIR``, the
user folder, the packaged tables), in the dense tables' text (the header in YAML, one JSON row a
line: ``fo_kernels.table.text``)::

    schema_version: 1
    kind: fo-tune-moe-schedule-table
    fingerprint: {device_key: ..., compute_capability: "9.0", world_size: 2, ...}
    world_size: 2
    dtype: bfloat16
    rows:
    - {"problem": {"hidden": 7168, "intermediate": 2048, "experts": 16, "top_k": 8,
       "tokens_min": 0, "tokens_max": 512}, "engine": "triton", "tile": {...}, ..., "provenance": {...}}

A row is a ``MoeSchedule`` (its ``dtype`` and ``world_size`` from the header) and its provenance
(``mode: predict`` for a row the cost model alone chose): a ``MoeRow``, read with the header by
``fo_kernels.moe.table_rows``. Rows are keyed by the experts' shape
(H, I, E_local, k) and a range of tokens per rank (the M bucket); two rows of one experts' shape
whose token ranges overlap are refused, naming both rows by their index. Loading sorts the rows
(O(n log n)) and a lookup bisects them; the runtime reads a file as a ``LoadedMoeTable`` (every
row's problem indexed, a row built when a lookup first takes it), as it reads a dense table.

The lookup key is the largest tokens per rank of the call over every rank (the counts exchange
carries each rank's tokens), so every rank of a call finds the same row. Across the folders a
measured row wins over a predicted one, then the first folder's. No row: None (the caller runs
its default, the no-overlap path).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import threading
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import yaml

from fo_kernels.errors import ScheduleError, TableError
from fo_kernels.fields import from_mapping
from fo_kernels.files import atomic_write
from fo_kernels.fingerprint import Fingerprint, current_fingerprint
from fo_kernels.moe.routing import MOE_DTYPES
from fo_kernels.moe.schedule import MoeProblem, MoeSchedule
from fo_kernels.moe.table_rows import MOE_TABLE_SCHEMA_VERSION, MoeRow, build_moe_row, moe_header
from fo_kernels.table.checks import check_fingerprint
from fo_kernels.table.format import MOE_TABLE_KIND, StampedFiles, read_table_data, read_table_text
from fo_kernels.table.paths import TABLE_DIR_ENV, check_name, table_search_path
from fo_kernels.table.spans import Span, SpanRows, put_row
from fo_kernels.table.text import (
    decode_row_at,
    dump_table_text,
    lazy_table_data,
    problem_again,
    row_built_once,
)

# The name a MoE table file starts with (the dense files start with their collective's name).
MOE_TABLE_PREFIX = "moe"
# Seconds a cache answers a repeated lookup from memory before it looks at the files again (the
# dense lookup's ``TABLE_RECHECK_S``, for the same reason: a filesystem round trip per call).
MOE_TABLE_RECHECK_S = 1.0
# Remembered answers (experts' shapes x the tokens calls see: routing changes the most tokens a rank
# holds every step); the oldest dropped past this many, the dense lookup's bound.
MOE_ANSWERS_SIZE = 4096
# Loaded tables a cache keeps (a few folders x dtypes x world sizes), the oldest dropped past this
# many: the dense lookup's bound.
MOE_TABLES_SIZE = 64

# Row kinds in the order the lookup prefers them (``MoeRow.kind``).
MOE_ROW_KINDS = ("measured", "predicted")

ExpertsKey = tuple[int, int, int, int]  # (hidden, intermediate, experts, top_k)


def experts_key(problem: MoeProblem) -> ExpertsKey:
    """The experts' shape of ``problem`` (hidden, intermediate, experts, top_k): the table's key for its
    token buckets."""
    return (problem.hidden, problem.intermediate, problem.experts, problem.top_k)


def moe_table_filename(world_size: int, dtype: str) -> str:
    """``moe-w<world_size>-<dtype>.yaml``."""
    check_name("dtype", dtype, MOE_DTYPES)
    return f"{MOE_TABLE_PREFIX}-w{int(world_size)}-{dtype}.yaml"


def moe_table_path(root: str | os.PathLike[str], device_key: str, world_size: int, dtype: str) -> Path:
    """``<root>/<device_key>/moe-w<world_size>-<dtype>.yaml``."""
    return Path(root) / device_key / moe_table_filename(world_size, dtype)


@dataclass(kw_only=True, slots=True)
class MoeTable:
    """The MoE schedules of one (device, world size, dtype); rows sorted by (experts' shape,
    tokens_min), no two token ranges of one experts' shape overlapping (``TableError``)."""

    fingerprint: Fingerprint
    world_size: int
    dtype: str
    rows: list[MoeRow] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_name("dtype", self.dtype, MOE_DTYPES)
        for i, row in enumerate(self.rows):
            if not isinstance(row, MoeRow):
                raise TableError(
                    f"rows[{i}]: expected a fo_kernels.MoeRow(schedule=...), got {type(row).__name__}"
                )
            s = row.schedule
            if (s.dtype, s.world_size) != (self.dtype, self.world_size):
                raise TableError(
                    f"a {s.dtype} w{s.world_size} row in a {self.dtype} w{self.world_size} table"
                )
        self.rows = _sorted_rows(self.rows)

    def upsert(self, row: MoeRow, *, measured_first: bool = False) -> list[MoeRow]:
        """Put ``row`` in over its token range by the merge rule (``fo_kernels.table.spans``): a
        row of its experts' shape that it overlaps keeps the tokens outside that range (trimmed,
        split in two, or gone when ``row`` covers all of it), so every token count the table
        covered keeps a row. With ``measured_first`` a predicted row takes no tokens from a
        measured one, nor an extrapolated one (provenance ``basis``) from a predicted one of its
        machine's own calibration: it goes in over the tokens no such row covers, or not at all. Returns
        the rows put in (``row`` or its parts)."""
        return self.upsert_all([row], measured_first=measured_first)

    def upsert_all(self, rows: Sequence[MoeRow], *, measured_first: bool = False) -> list[MoeRow]:
        """``upsert`` of each of ``rows`` in turn, in O((n + m) log(n + m)) for n rows and m new
        ones (plus the moves within one experts' shape), where m upserts cost O(n m). Returns the
        rows put in."""
        groups: dict[ExpertsKey, list[MoeRow]] = {}
        for old in self.rows:
            groups.setdefault(experts_key(old.schedule.problem), []).append(old)
        spans = {key: SpanRows(same, _tokens) for key, same in groups.items()}
        placed: list[MoeRow] = []
        for row in rows:
            same = spans.setdefault(experts_key(row.schedule.problem), SpanRows([], _tokens))
            yields = partial(_outranks, _rank(row)) if measured_first else None
            placed += put_row(row, same, respan=_with_tokens, yields_to=yields)
        self.rows = _sorted_rows([r for same in spans.values() for r in same.rows])
        return placed

    def find_row(self, key: ExpertsKey, tokens: int, *, kind: str | None = None) -> MoeRow | None:
        """The row of ``key`` whose token range holds ``tokens`` (of ``kind`` when given); a
        bisection of the sorted rows."""
        i = _covering(self.rows, key, tokens, by=lambda row: _row_key(row.schedule.problem))
        row = self.rows[i] if i is not None else None
        return row if row is not None and kind in (None, row.kind) else None

    def find(self, key: ExpertsKey, tokens: int, *, kind: str | None = None) -> MoeSchedule | None:
        """The schedule of ``find_row``'s row (None without one)."""
        row = self.find_row(key, tokens, kind=kind)
        return None if row is None else row.schedule

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": MOE_TABLE_SCHEMA_VERSION,
            "kind": MOE_TABLE_KIND,
            "fingerprint": self.fingerprint.to_dict(),
            "world_size": self.world_size,
            "dtype": self.dtype,
            "rows": [row.to_dict() for row in self.rows],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<where>") -> MoeTable:
        """Validate and build; every error is a ``TableError`` naming ``source`` (and the row)."""
        fingerprint, world, dtype, raw = moe_header(data, source)
        rows = [build_moe_row(row, i, dtype, world, source) for i, row in enumerate(raw)]
        try:
            return cls(fingerprint=fingerprint, world_size=world, dtype=dtype, rows=rows)
        except TableError as exc:
            raise TableError(f"{source}: {exc}") from None


def _tokens(row: MoeRow) -> Span:
    p = row.schedule.problem
    return (p.tokens_min, p.tokens_max)


def _with_tokens(row: MoeRow, tokens: Span) -> MoeRow:
    """``row`` over the tokens ``tokens`` with the same settings and provenance: a schedule runs
    any tokens in its range, and a smaller ``tokens_max`` only makes the copy engine's buffers
    smaller."""
    own = row.schedule.problem
    problem = replace(own, tokens_min=tokens[0], tokens_max=tokens[1])
    return MoeRow(schedule=replace(row.schedule, problem=problem), provenance=dict(row.provenance))


def _rank(row: MoeRow) -> tuple[bool, bool]:
    """Where a merge ranks ``row``, lower first: measured, then predicted from its machine's own
    calibration, then predicted from another's (provenance ``basis``: an extrapolated one)."""
    predicted = row.kind == "predicted"
    return (predicted, predicted and bool(row.provenance.get("basis")))


def _outranks(rank: tuple[bool, bool], old: MoeRow) -> bool:
    """Whether ``old`` keeps its tokens over a row of rank ``rank`` (``_rank``)."""
    return _rank(old) < rank


# A row's problem as the tables sort it: (experts' shape, tokens_min, tokens_max).
RowKey = tuple[ExpertsKey, int, int]


def _row_key(problem: MoeProblem) -> RowKey:
    return (experts_key(problem), problem.tokens_min, problem.tokens_max)


def _key_problem(key: RowKey) -> MoeProblem:
    (hidden, intermediate, experts, top_k), lo, hi = key
    return MoeProblem(
        hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, tokens_min=lo, tokens_max=hi
    )


def _key_order(keys: Sequence[RowKey]) -> list[int]:
    """The positions of ``keys`` in sorted order (O(n log n)); ``TableError`` naming two rows whose
    token ranges of one experts' shape overlap, by their index in ``keys`` (a file's order). Sorted
    by tokens_min, any overlap within an experts' shape shows between neighbours."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    for i, j in itertools.pairwise(order):
        (key_a, _, hi_a), (key_b, lo_b, _) = keys[i], keys[j]
        if key_a == key_b and lo_b <= hi_a:
            first, second = sorted((i, j))
            same = keys[i] == keys[j]
            what = "are both for" if same else "overlap:"
            raise TableError(
                f"rows[{first}] and rows[{second}] {what} {_key_problem(keys[first]).describe()}"
                + ("" if same else f" and {_key_problem(keys[second]).describe()}")
                + "; keep one row per tokens of an experts' shape (lookup could take either)"
            )
    return order


def _sorted_rows(rows: Sequence[MoeRow]) -> list[MoeRow]:
    """``rows`` sorted by (experts' shape, tokens_min); ``TableError`` naming two rows that overlap
    (``_key_order``)."""
    return [rows[i] for i in _key_order([_row_key(row.schedule.problem) for row in rows])]


def _covering(
    items: Sequence[Any], key: ExpertsKey, tokens: int, by: Callable[[Any], RowKey] | None = None
) -> int | None:
    """The position in ``items`` (sorted by their ``RowKey``, ``by(item)`` or the item itself, no
    two overlapping) whose tokens of ``key`` hold ``tokens``: one bisection."""
    i = bisect_right(items, (key, tokens, math.inf), key=by) - 1
    if i < 0:
        return None
    (found, lo, hi) = by(items[i]) if by is not None else items[i]
    return i if found == key and lo <= tokens <= hi else None


def load_moe_table(path: str | os.PathLike[str]) -> MoeTable:
    """Read and validate one MoE table file (``TableNotFoundError`` when there is none)."""
    return MoeTable.from_dict(read_table_data(path), source=str(path))


def save_moe_table(table: MoeTable, path: str | os.PathLike[str]) -> None:
    """Write ``table`` (the header in YAML, one row a line), atomically."""
    data = table.to_dict()
    rows = data.pop("rows")
    header = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=110)
    atomic_write(path, lambda f: f.write(dump_table_text(header, rows)))


# ------------------------------------------------------------------------------- runtime view
# The problem at the start of a written row line (``MoeRow.to_dict`` puts ``problem`` first, in
# ``MoeProblem.to_dict``'s order, and ``row_line`` writes it with these separators).
_PROBLEM_PREFIX = re.compile(
    r'\{"problem": \{"hidden": (D), "intermediate": (D), "experts": (D), "top_k": (D), "tokens_min": '
    r'(0|D), "tokens_max": (D)\}'.replace("D", "[1-9][0-9]{0,18}")  # (int() takes 19 digits)
)


class LoadedMoeTable:
    """An MoE table file as the runtime reads it: the header checked, every row's problem read
    (from the start of its line in the written form) and indexed, two overlapping rows refused as
    ``load_moe_table`` refuses them, and a row built (every field checked) when a lookup first
    takes it, as the dense tables' ``fo_kernels.table.LoadedTable``: a 100,000-row file costs the
    first lookup a fraction of building every row. ``find_row`` answers as ``MoeTable``'s does."""

    __slots__ = ("_built", "_keys", "_lock", "_order", "_raw", "dtype", "fingerprint", "source", "world_size")

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        data = lazy_table_data(text, source)  # (the rows stay text until a lookup takes one)
        self.fingerprint, self.world_size, self.dtype, self._raw = moe_header(data, source)
        keys = [self._key(i) for i in range(len(self._raw))]
        try:
            self._order = _key_order(keys)
        except TableError as exc:
            raise TableError(f"{source}: {exc}") from None
        self._keys = [keys[i] for i in self._order]
        self._built: dict[int, MoeRow] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._raw)

    def _key(self, i: int) -> RowKey:
        """Row i's key: read from the start of its line, else from the row decoded."""
        raw = self._raw[i]
        if isinstance(raw, str):
            match = _PROBLEM_PREFIX.match(raw)
            if match is not None and not problem_again(raw, match.end()):
                hidden, inter, experts, top_k, lo, hi = map(int, match.groups())
                if lo <= hi:  # (else decoding names the error)
                    return ((hidden, inter, experts, top_k), lo, hi)
            raw = self._raw[i] = decode_row_at(self._raw, i, self.source)
        if not isinstance(raw, Mapping):
            raise TableError(f"{self.source}: rows[{i}]: expected a mapping, got {type(raw).__name__}")
        try:
            return _row_key(from_mapping(MoeProblem, raw.get("problem"), "problem"))
        except ScheduleError as exc:
            raise TableError(f"{self.source}: rows[{i}]: {exc}") from None

    def row(self, i: int) -> MoeRow:
        """Row ``i`` (file order) as a ``MoeRow``; ``TableError`` naming the row when malformed."""
        with self._lock:
            return row_built_once(
                self._built,
                self._raw,
                i,
                self.source,
                lambda raw: build_moe_row(raw, i, self.dtype, self.world_size, self.source),
            )

    def find_row(self, key: ExpertsKey, tokens: int, *, kind: str | None = None) -> MoeRow | None:
        """The row of ``key`` whose token range holds ``tokens`` (of ``kind`` when given)."""
        i = _covering(self._keys, key, tokens)
        row = self.row(self._order[i]) if i is not None else None
        return row if row is not None and kind in (None, row.kind) else None


class FindsMoeRows(Protocol):
    """An MoE table's finder (``MoeTable``, ``LoadedMoeTable``), what ``best_moe_row`` reads."""

    def find_row(self, key: ExpertsKey, tokens: int, *, kind: str | None = None) -> MoeRow | None: ...


# ----------------------------------------------------------------------------------- lookup
def best_moe_row(tables: Sequence[FindsMoeRows], key: ExpertsKey, tokens: int) -> tuple[int, MoeRow] | None:
    """(index in ``tables``, row) of the row a call of the experts' shape ``key`` whose ranks hold
    at most ``tokens`` tokens each takes from ``tables`` (in search path order): a measured row of
    any table first, then a predicted one; between rows of one kind the first table's. None
    without one."""
    for kind in MOE_ROW_KINDS:
        for i, table in enumerate(tables):
            row = table.find_row(key, tokens, kind=kind)
            if row is not None:
                return i, row
    return None


def _read_moe_table(path: Path) -> LoadedMoeTable:
    return LoadedMoeTable(read_table_text(path), str(path))


class MoeTableCache:
    """The runtime's MoE lookups (one per device and group, kept in the runtime's
    ``engine_state``): tables per path while the file's (inode, mtime, size) is unchanged, answers
    per call key for ``MOE_TABLE_RECHECK_S``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: StampedFiles[LoadedMoeTable] = StampedFiles(MOE_TABLES_SIZE, _read_moe_table)
        self._answers: OrderedDict[tuple, tuple[float, MoeSchedule | None]] = OrderedDict()

    def lookup(
        self, key: ExpertsKey, tokens: int, *, dtype: str, world_size: int, device: Any
    ) -> MoeSchedule | None:
        """The row for a call of the experts' shape ``key`` whose ranks hold at most ``tokens``
        tokens each: measured rows first, then the first folder's; None without one. Raises
        ``TableError`` for a found table that is malformed or for other hardware."""
        ask = (
            key,
            tokens,
            dtype,
            world_size,
            str(device),
            os.environ.get(TABLE_DIR_ENV),
            os.environ.get("XDG_DATA_HOME"),
        )
        with self._lock:
            hit = self._answers.get(ask)
            if hit is not None and time.monotonic() - hit[0] <= MOE_TABLE_RECHECK_S:
                return hit[1]
            fp = current_fingerprint(device, world_size)
            tables = []
            for folder in table_search_path():
                path = moe_table_path(folder, fp.device_key, world_size, dtype)
                table = self._tables.get(path)
                if table is None:
                    continue
                check_fingerprint(table, fp, source=str(path))
                if table.dtype != dtype:
                    raise TableError(f"{path}: holds {table.dtype} rows, expected {dtype}")
                tables.append(table)
            match = best_moe_row(tables, key, tokens)
            found = None if match is None else match[1].schedule
            self._answers.pop(ask, None)
            self._answers[ask] = (time.monotonic(), found)
            while len(self._answers) > MOE_ANSWERS_SIZE:
                self._answers.popitem(last=False)
            return found
