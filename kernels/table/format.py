"""The schedule table: ``ScheduleTable`` (one file's header and rows, unique per problem and sorted),
its format (schema 2, schema-1 rows upgraded; the text is ``fo_kernels.table.text``'s), loading
and saving. A table's checks against a call and a device are ``fo_kernels.table.checks``'."""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml

from fo_kernels.errors import ScheduleError, TableError, TableNotFoundError
from fo_kernels.files import atomic_write
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import COLLECTIVES, DTYPES, Problem, Schedule
from fo_kernels.table.index import ProblemKey, RowIndex, problem_key
from fo_kernels.table.paths import TABLE_DIR_ENV, check_name, where_it_belongs
from fo_kernels.table.provenance import check_finite_provenance
from fo_kernels.table.text import dump_table_text, parse_table_text, unreadable

T = TypeVar("T")

TABLE_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
TABLE_KIND = "fo-tune-schedule-table"
# The MoE table's kind (``fo_kernels.moe.table`` reads those files; it imports this module), named
# here so a dense read of an MoE file says which file name it belongs under.
MOE_TABLE_KIND = "fo-tune-moe-schedule-table"
# Row keys that the header owns.
_HEADER_KEYS = ("collective", "dtype", "world_size")
_TOP_KEYS = ("schema_version", "kind", "fingerprint", "collective", "world_size", "dtype", "rows")


# ---------------------------------------------------------------------------------------- table
def _check_header_keys(schedule: Schedule, table: Any) -> None:
    for key in _HEADER_KEYS:
        if getattr(schedule, key) != getattr(table, key):
            theirs, ours = getattr(schedule, key), getattr(table, key)
            raise TableError(f"{key}: the schedule says {theirs!r}, the table is for {ours!r}")
    check_finite_provenance(schedule.provenance)


@dataclass(kw_only=True, slots=True)
class ScheduleTable:
    """The schedules of one (device, collective, world size, dtype); see the module docstring.

    ``rows`` are kept sorted by (N, K, then M or m_min) and unique: two rows for one problem, or
    two M ranges of one (N, K) that overlap, are refused (``TableError`` naming both by their
    index in the rows given). Change them through ``upsert`` (or build a new table), which keeps
    the lookup index (``fo_kernels.table.index``) in step.
    """

    schema_version: int = TABLE_SCHEMA_VERSION
    fingerprint: Fingerprint
    collective: str
    world_size: int
    dtype: str
    rows: list[Schedule] = field(default_factory=list)
    _index: RowIndex = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_name("collective", self.collective, COLLECTIVES)
        check_name("dtype", self.dtype, DTYPES)
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise TableError(f"world_size: expected an integer >= 1, got {self.world_size!r}")
        rows = list(self.rows)
        for row in rows:
            _check_header_keys(row, self)
        self._set_rows(rows)

    def _set_rows(self, rows: list[Schedule]) -> None:
        """Sort ``rows`` and index them (O(n log n)); refuse duplicates and overlapping ranges. Rows
        already sorted (a saved table, a merge's result) are indexed once."""
        keys = [problem_key(row.problem) for row in rows]
        index = RowIndex(keys)
        if index.order != list(range(len(keys))):  # index the sorted rows' positions
            rows = [rows[i] for i in index.order]
            index = RowIndex([keys[i] for i in index.order])
        self.rows = rows
        self._index = index

    def upsert(self, schedule: Schedule) -> None:
        """Replace the row for the same problem (exact M, or the identical range), else add it; keep
        the order. An M range that overlaps another row's range is refused (``TableError``):
        remove that row first."""
        _check_header_keys(schedule, self)
        self._set_rows([row for row in self.rows if row.problem != schedule.problem] + [schedule])

    def find_exact(self, m: int, n: int, k: int, *, kind: str | None = None) -> Schedule | None:
        """The exact-shape row for (m, n, k) (of ``row_kind`` ``kind`` when given)."""
        pos = self._index.exact(m, n, k)
        row = self.rows[pos] if pos is not None else None
        return row if row is not None and kind in (None, row_kind(row)) else None

    def find_range(self, m: int, n: int, k: int, *, kind: str | None = None) -> Schedule | None:
        """The M-range row covering m (of ``row_kind`` ``kind`` when given)."""
        pos = self._index.range(m, n, k)
        row = self.rows[pos] if pos is not None else None
        return row if row is not None and kind in (None, row_kind(row)) else None

    def find(self, m: int, n: int, k: int) -> Schedule | None:
        """The exact-shape row, else the M-range row covering m, else None."""
        return self.find_exact(m, n, k) or self.find_range(m, n, k)

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            data = row.to_dict()
            for key in _HEADER_KEYS:
                del data[key]
            rows.append(data)
        return {
            "schema_version": self.schema_version,
            "kind": TABLE_KIND,
            "fingerprint": self.fingerprint.to_dict(),
            "collective": self.collective,
            "world_size": self.world_size,
            "dtype": self.dtype,
            "rows": rows,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<where>") -> ScheduleTable:
        """Validate and build; every error is a ``TableError`` naming ``source``, the row and the field."""
        header, rows = parse_header(data, source)
        return cls.of_rows(header, [build_row(row, i, header, source) for i, row in enumerate(rows)], source)

    @classmethod
    def of_rows(cls, header: TableHeader, rows: list[Schedule], source: str) -> ScheduleTable:
        """The table of a file's checked ``header`` and its built ``rows`` (``TableError`` naming
        ``source`` for two rows of one problem, or M ranges that overlap, or a row's provenance
        that holds a NaN or an infinity: the tuner's reads, not the runtime's, which ignores it)."""
        for i, row in enumerate(rows):
            try:
                check_finite_provenance(row.provenance)
            except ScheduleError as exc:
                raise TableError(f"{source}: rows[{i}]: {exc}") from None
        try:
            return cls(
                fingerprint=header.fingerprint,
                collective=header.collective,
                world_size=header.world_size,
                dtype=header.dtype,
                rows=rows,
            )  # (saving it writes the rows in today's form: schema_version is today's)
        except TableError as exc:
            raise TableError(f"{source}: {exc}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class TableHeader:
    """A table file's header, checked: what every row shares."""

    schema_version: int
    fingerprint: Fingerprint
    collective: str
    world_size: int
    dtype: str

    def defaults(self) -> dict[str, Any]:
        """The row keys the header owns, as ``Schedule.from_dict`` defaults."""
        return {key: getattr(self, key) for key in _HEADER_KEYS}


# What to do with a file that is not a schedule table at all.
GIVE_A_TABLE = "give a schedule table file (the YAML `fo-tune search` writes)"


def written_key(data: Mapping) -> str:
    """The device key a table file's data says its fingerprint is ("" where it says none: the file
    is then taken to sit where it belongs)."""
    fingerprint = data.get("fingerprint")
    key = fingerprint.get("device_key") if isinstance(fingerprint, Mapping) else None
    return key if isinstance(key, str) else ""


def not_a_mapping(data: Any, source: str) -> TableError:
    """The error for a table file whose top level is not a mapping (an empty file, a list)."""
    got = "an empty file" if data is None else f"a {type(data).__name__}"
    return TableError(f"{source}: expected a mapping at the top level, got {got}; {GIVE_A_TABLE}")


def empty_rows(source: str) -> TableError:
    """The error for a table file whose ``rows:`` holds nothing (not ``[]``): what a file cut short
    right after that line reads as, every row gone; a table without rows is written ``rows: []``."""
    return TableError(
        f"{source}: rows: holds nothing (a file cut short after `rows:` reads so); restore the file "
        "from its copy, or write `rows: []` for a table without rows"
    )


def parse_header(data: Any, source: str) -> tuple[TableHeader, list[Any]]:
    """(the checked header, the rows as read) of a table file's data; every error is a
    ``TableError`` naming ``source`` and the key (the rows are checked by ``build_row``)."""
    if not isinstance(data, Mapping):
        raise not_a_mapping(data, source)
    if "kind" not in data and "schema_version" not in data:  # (a notes file beside the tables, say)
        keys = ", ".join(sorted(map(str, data))[:5]) or "none"
        raise TableError(
            f"{source}: not a table: no kind and no schema_version (its keys: {keys}); {GIVE_A_TABLE}"
        )
    if data.get("kind") == MOE_TABLE_KIND and data.get("dtype") in DTYPES:  # under a dense name
        name = f"moe-w{data.get('world_size')}-{data.get('dtype')}.yaml"
        raise TableError(
            f"{source}: an MoE table (kind {MOE_TABLE_KIND!r}), not a dense schedule table, and the MoE "
            f"lookup reads it only as {name}; {where_it_belongs(source, written_key(data), name)}"
        )
    version = data.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS or isinstance(version, bool):
        raise TableError(
            f"{source}: schema_version {version!r} is not supported (supported: "
            f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}); re-run `fo-tune search` to rewrite it"
        )
    unknown = sorted(str(key) for key in set(data) - set(_TOP_KEYS))
    if unknown:
        raise TableError(f"{source}: unknown key(s) {', '.join(unknown)}; valid: {list(_TOP_KEYS)}")
    missing = [key for key in _TOP_KEYS if key not in data]
    if missing:
        raise TableError(f"{source}: {missing[0]}: missing")
    if data["kind"] != TABLE_KIND:
        raise TableError(f"{source}: kind: expected {TABLE_KIND!r}, got {data['kind']!r}")
    try:
        fingerprint = Fingerprint.from_dict(data["fingerprint"])
        check_name("collective", data["collective"], COLLECTIVES)
        check_name("dtype", data["dtype"], DTYPES)
    except (TableError, ScheduleError) as exc:
        raise TableError(f"{source}: {exc}") from None
    world_size = data["world_size"]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TableError(f"{source}: world_size: expected an integer >= 1, got {world_size!r}")
    if fingerprint.world_size != world_size:
        raise TableError(
            f"{source}: fingerprint.world_size: {fingerprint.world_size} differs from the header's "
            f"world_size {world_size}"
        )
    rows = data["rows"]
    if rows is None:
        raise empty_rows(source)
    if not isinstance(rows, list):
        raise TableError(f"{source}: rows: expected a list, got {type(rows).__name__}")
    header = TableHeader(
        schema_version=version,
        fingerprint=fingerprint,
        collective=data["collective"],
        world_size=world_size,
        dtype=data["dtype"],
    )
    return header, rows


def _check_row_mapping(row: Any, i: int, header: TableHeader, source: str) -> None:
    if not isinstance(row, Mapping):
        raise TableError(f"{source}: rows[{i}]: expected a mapping, got {type(row).__name__}")
    for key in _HEADER_KEYS:
        if key in row and row[key] != getattr(header, key):
            raise TableError(
                f"{source}: rows[{i}]: {key}: the row says {row[key]!r}, the header {getattr(header, key)!r}"
            )


def build_row(row: Any, i: int, header: TableHeader, source: str) -> Schedule:
    """Row ``i`` of a file as a ``Schedule`` (a schema-1 row upgraded); errors name the row."""
    _check_row_mapping(row, i, header, source)
    try:
        if header.schema_version == 1:
            row = upgrade_v1_row(row)
        return Schedule.from_dict(row, defaults=header.defaults())
    except ScheduleError as exc:
        raise TableError(f"{source}: rows[{i}]: {exc}") from None


def row_problem_key(row: Any, i: int, header: TableHeader, source: str) -> ProblemKey:
    """Row ``i``'s ``ProblemKey``, its problem checked (the rest of the row is checked when it is
    built: ``build_row``)."""
    _check_row_mapping(row, i, header, source)
    try:
        return problem_key(Problem.from_dict(row.get("problem")))
    except ScheduleError as exc:
        raise TableError(f"{source}: rows[{i}]: {exc}") from None


# Schema 1: a row's Triton-engine fields, side by side with the common ones.
_V1_TRITON_KEYS = ("tile", "sms_free", "nccl_max_ctas", "signal_tiles", "groups", "layout", "wait_mode")


def upgrade_v1_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A schema-1 row in schema-2 form: the Triton fields move into ``settings``; a copy_engine
    row's ``groups`` are its chunk ``weights`` and its ``tile`` selects mode ``tiled``. A row of the
    removed ``exchange`` mode is refused (``ScheduleError``). A row already in schema-2 form (it has
    ``settings``) is returned as it is, so readers of old and new reports can call it on both."""
    if "settings" in row:
        return dict(row)
    out = {key: row[key] for key in ("problem", "provenance", *_HEADER_KEYS) if key in row}
    if row.get("overlap", True) is False:
        return {**out, "overlap": False}
    extra = sorted(str(key) for key in set(row) - {*out, "overlap", "engine", "exchange", *_V1_TRITON_KEYS})
    if extra:
        raise ScheduleError(f"schedule: unknown key(s) {', '.join(extra)} in a schema 1 row")
    engine = row.get("engine", "triton")
    if engine != "copy_engine":
        return {**out, "engine": engine, "settings": {k: row[k] for k in _V1_TRITON_KEYS if k in row}}
    if row.get("exchange"):
        raise ScheduleError(
            "exchange: the copy engine's exchange mode no longer exists; re-tune this shape with "
            "`fo-tune search` (or delete the row)"
        )
    settings: dict[str, Any] = {"mode": "ring", "weights": row.get("groups")}
    if row.get("tile") is not None:
        settings.update(mode="tiled", tile=row["tile"])
    return {**out, "engine": "copy_engine", "settings": settings}


# ------------------------------------------------------------------------------- load and save
# The byte order mark a file's text may start with (UTF-8's, read as text).
BOM = "\ufeff"


def read_table_text(path: str | os.PathLike[str]) -> str:
    """The text of the table file at ``path``: ``TableNotFoundError`` when there is none,
    ``TableError`` naming the path when it cannot be read."""
    path = Path(path)
    try:
        if stat.S_ISCHR(mode := path.stat().st_mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            # (read, /dev/zero fills the memory until the kernel kills the process; a pipe waits)
            raise TableError(f"{path}: not a file (a device, a pipe or a socket); {GIVE_A_TABLE}")
        # (a byte order mark, as some editors write, dropped: with it, a table that is one JSON
        # document would go to the YAML parser, 60 times slower than json on 5,000 rows)
        return path.read_text(encoding="utf-8").removeprefix(BOM)
    except FileNotFoundError:
        if path.is_symlink():
            raise _dangling(path) from None
        raise TableNotFoundError(
            f"{path}: no schedule table here; write one with `fo-tune search`, or set {TABLE_DIR_ENV} "
            "to a folder that has one"
        ) from None
    except IsADirectoryError:
        raise TableError(
            f"{path}: is a folder, not a table file; name one of its files "
            "(<device-key>/<collective>-w<world>-<dtype>.yaml; `fo-tune table list` lists them)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TableError(f"{path}: cannot read: {exc}; {GIVE_A_TABLE}") from None


def _dangling(path: Path) -> TableError:
    """The error for a table file name that is a symbolic link to nothing."""
    return TableError(
        f"{path}: a symbolic link to {os.readlink(path)}, which does not exist; mount or restore what "
        "it points to, or remove the link"
    )


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime_ns, size) of the table file at ``path``, what a cache keeps its read under;
    None where there is no file; ``TableError`` naming the path where it cannot be looked at (a
    folder it may not search, a symlink loop, a symlink to nothing: a table on a share not mounted
    would otherwise read as no table, its calls silently without overlap), as for a file it cannot
    read."""
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise _dangling(path) from None
        return None
    except OSError as exc:
        raise TableError(f"{path}: cannot read: {exc}; {GIVE_A_TABLE}") from None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class StampedFiles(Generic[T]):
    """What ``read`` makes of files, each kept while its ``file_stamp`` is unchanged, the least
    recently used dropped past ``size``: the runtime's loaded tables, dense and MoE. Not locked:
    its owner calls it under its own lock."""

    def __init__(self, size: int, read: Callable[[Path], T]) -> None:
        self._size, self._read = size, read
        self._entries: OrderedDict[Path, tuple[tuple[int, int, int], T]] = OrderedDict()

    def get(self, path: Path) -> T | None:
        """The file at ``path`` read (again where it changed), or None when there is no file or it
        is removed as it is read; ``TableError`` as ``file_stamp`` and ``read`` raise it."""
        try:
            stamp = file_stamp(path)
            if stamp is None:
                return None
            hit = self._entries.pop(path, None)
            value = hit[1] if hit is not None and hit[0] == stamp else self._read(path)
        except TableNotFoundError:  # removed after the stat
            return None
        self._entries[path] = (stamp, value)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


def read_table_data(path: str | os.PathLike[str]) -> Any:
    """The data of the table file at ``path`` (``fo_kernels.table.text``; errors as
    ``read_table_text``'s, and ``TableError`` naming the path when it is not YAML)."""
    try:
        return parse_table_text(read_table_text(path))
    except yaml.YAMLError as exc:
        raise TableError(unreadable(str(path), exc)) from None


def load_table(path: str | os.PathLike[str]) -> ScheduleTable:
    """Read and validate one table file: every row built and checked, O(n log n) in its rows."""
    return ScheduleTable.from_dict(read_table_data(path), source=str(path))


def table_text(table: ScheduleTable) -> str:
    """``table`` as its file holds it (``fo_kernels.table.text``: the header in YAML, one row a
    line), linear in its rows (the YAML emitter took minutes for 100,000 rows)."""
    data = table.to_dict()
    rows = data.pop("rows")
    header = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=110)
    return dump_table_text(header, rows)


def save_table(table: ScheduleTable, path: str | os.PathLike[str]) -> None:
    """Write ``table`` (``table_text``): a temporary file in the same folder, then an atomic rename.
    ``TableError`` (naming ``path`` and both rows), the file left as it was, when ``table.rows``
    was changed in place (not through ``upsert``) into two rows for one problem or M ranges that
    overlap: every reader refuses such a file, so writing it would lose the table."""
    try:
        RowIndex([problem_key(row.problem) for row in table.rows])  # (linear on sorted rows)
    except TableError as exc:
        raise TableError(f"{path}: not written: {exc}") from None
    text = table_text(table)
    atomic_write(path, lambda f: f.write(text))


def row_kind(row: Schedule) -> str:
    """``predicted`` for a row the cost model alone chose (provenance ``mode: predict``), else
    ``measured`` (a measured search's row, or one written by hand)."""
    return "predicted" if row.provenance.get("mode") == "predict" else "measured"


def row_rank(row: Schedule) -> tuple[bool, bool]:
    """Where ``lookup_schedule`` ranks ``row`` among the rows that hold an M, lower first
    (``best_match``): measured before predicted, then exact before M range."""
    return (row_kind(row) == "predicted", row.problem.is_range)
