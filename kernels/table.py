"""YAML schedule tables: where they live, their format, loading, saving, and the runtime lookup.

One file per (device key, collective, world size, dtype),
``<root>/<device_key>/<collective>-w<world_size>-<dtype>.yaml`` (collective ``all_reduce``,
``reduce_scatter`` or ``all_gather``). Roots, in search order
(``table_search_path``): ``$FO_TUNE_TABLE_DIR`` when set; the user folder
``$XDG_DATA_HOME/fo-tune/tables`` (``~/.local/share/fo-tune/tables``); the packaged tables,
``importlib.resources.files("fo_results") / "tables"`` (skipped when not importable or zipped). A file::

    schema_version: 2
    kind: fo-tune-schedule-table
    fingerprint: {device_key: ..., gpu_name: ..., compute_capability: "9.0", ...}
    collective: all_reduce
    world_size: 2
    dtype: bfloat16
    rows:
      - problem: {m: 4096, n: 8192, k: 4096}      # or {m_min: 1, m_max: 2048, n: ..., k: ...}
        engine: copy_engine
        settings: {mode: ring, weights: [1, 1, 1, 1]}
      - problem: {m_min: 512, m_max: 1448, n: 4096, k: 4096}
        overlap: false

The problem of an ``all_gather`` row is that of its GEMM: M is the gathered M (world size x the
rows of one rank's shard of A), N and K those of B; like a ``reduce_scatter`` row's, its M is
divisible by the world size. Rows leave out ``collective``, ``dtype`` and ``world_size``; they
come from the header (a row that states other values is refused). A row is a
``fo_kernels.schedule.Schedule``: common fields and one engine's ``settings``. A schema-1 file
(every engine's fields side by side in the row) is read by ``upgrade_v1_row`` and written back as
schema 2 by the next ``save_table``. A table keeps its rows unique per problem and sorted by
(n, k, m or m_min); a later row for the same problem replaces an earlier one.

``lookup_schedule`` prefers, across every found file: a measured exact-shape row, a measured
M-range row, a predicted exact-shape row, a predicted M-range row (``row_kind``: a row whose
provenance says ``mode: predict`` came from the cost model alone; any other row was measured or
written by hand); between rows of the same kind, the folder order decides. Without a matching row
it returns ``overlap: false`` (GEMM then the collective, never slower than sequential) with a
``HeuristicScheduleWarning`` saying how to tune the shape. Tables it loads are cached per (path,
inode, mtime, size), so an unchanged file is parsed once and a rewritten one (``save_table``
renames) is read again. Its answer per call signature is kept for ``TABLE_RECHECK_S``: a layer
calling the op every step does not pay a filesystem round trip per GEMM (on H200 x2 that cost
0.3-0.45 ms a call, docs/design.md#tables), and a rewritten table is still picked up within
that time.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from .errors import (
    HeuristicScheduleWarning,
    ScheduleError,
    ShapeError,
    TableError,
    TableNotFoundError,
    VersionDriftWarning,
)
from .files import atomic_write, read_yaml
from .fingerprint import Fingerprint, current_fingerprint, resolve_device
from .schedule import COLLECTIVES, DTYPES, SHARDED_COLLECTIVES, Problem, Schedule, dtype_name

__all__ = [
    "MISS_SOURCE",
    "TABLE_DIR_ENV",
    "TABLE_KIND",
    "TABLE_SCHEMA_VERSION",
    "ScheduleTable",
    "best_row",
    "check_fingerprint",
    "load_table",
    "lookup_schedule",
    "row_kind",
    "save_table",
    "table_filename",
    "table_path",
    "table_search_path",
    "upgrade_v1_row",
]

TABLE_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
TABLE_KIND = "fo-tune-schedule-table"
TABLE_DIR_ENV = "FO_TUNE_TABLE_DIR"
# Row keys that the header owns.
_HEADER_KEYS = ("collective", "dtype", "world_size")
_TOP_KEYS = ("schema_version", "kind", "fingerprint", "collective", "world_size", "dtype", "rows")
# Loaded tables kept by lookup_schedule; a few (device, collective, world, dtype) files per process.
_CACHE_SIZE = 64
# Seconds lookup_schedule answers a repeated call from memory before it looks at the files again.
TABLE_RECHECK_S = 1.0
# Remembered answers (call signatures: shapes x collectives x dtypes of one model); oldest dropped.
_ANSWERS_SIZE = 4096
# The provenance source of the overlap: false schedule a call without a table row gets.
MISS_SOURCE = "no table row"


def _check_name(name: str, value: Any, valid: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in valid:
        raise ScheduleError(f"{name}: {value!r} is not one of {', '.join(valid)}")
    return value


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype_name(dtype)


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShapeError(f"{name}: expected an integer >= 1, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------- paths
def table_filename(collective: str, world_size: int, dtype: str) -> str:
    """``<collective>-w<world_size>-<dtype>.yaml``."""
    _check_name("collective", collective, COLLECTIVES)
    _check_name("dtype", dtype, DTYPES)
    return f"{collective}-w{int(world_size)}-{dtype}.yaml"


def table_path(
    root: str | os.PathLike[str], device_key: str, collective: str, world_size: int, dtype: str
) -> Path:
    """``<root>/<device_key>/<collective>-w<world_size>-<dtype>.yaml``."""
    return Path(root) / device_key / table_filename(collective, world_size, dtype)


def user_table_dir() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME")
    base = Path(data_home).expanduser() if data_home else Path.home() / ".local" / "share"
    return base / "fo-tune" / "tables"


def _packaged_table_dir() -> Path | None:
    try:
        root = resources.files("fo_results") / "tables"
    except (ImportError, TypeError):
        return None
    return root if isinstance(root, Path) else None  # a zipped install is not searched


def table_search_path() -> list[Path]:
    """Folders searched for tables, in order: ``$FO_TUNE_TABLE_DIR``, the user folder, the packaged one."""
    folders: list[Path] = []
    env = os.environ.get(TABLE_DIR_ENV)
    if env:
        folders.append(Path(env).expanduser())
    folders.append(user_table_dir())
    packaged = _packaged_table_dir()
    if packaged is not None:
        folders.append(packaged)
    unique: list[Path] = []
    for folder in folders:
        if folder not in unique:
            unique.append(folder)
    return unique


# ---------------------------------------------------------------------------------------- table
def _row_key(schedule: Schedule) -> tuple[int, int, int, int, int]:
    p = schedule.problem
    if p.m is not None:
        return (p.n, p.k, p.m, 0, p.m)
    assert p.m_min is not None and p.m_max is not None
    return (p.n, p.k, p.m_min, 1, p.m_max)


@dataclass(kw_only=True, slots=True)
class ScheduleTable:
    """The schedules of one (device, collective, world size, dtype); see the module docstring."""

    schema_version: int = TABLE_SCHEMA_VERSION
    fingerprint: Fingerprint
    collective: str
    world_size: int
    dtype: str
    rows: list[Schedule] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_name("collective", self.collective, COLLECTIVES)
        _check_name("dtype", self.dtype, DTYPES)
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise TableError(f"world_size: expected an integer >= 1, got {self.world_size!r}")
        rows, self.rows = list(self.rows), []
        for row in rows:
            self.upsert(row)

    def upsert(self, schedule: Schedule) -> None:
        """Replace the row for the same problem (exact M, or the identical range), else add it; keep order."""
        for key in _HEADER_KEYS:
            if getattr(schedule, key) != getattr(self, key):
                raise TableError(
                    f"{key}: the schedule says {getattr(schedule, key)!r}, "
                    f"the table is for {getattr(self, key)!r}"
                )
        self.rows = [row for row in self.rows if row.problem != schedule.problem]
        self.rows.append(schedule)
        self.rows.sort(key=_row_key)

    def find_exact(self, m: int, n: int, k: int, *, kind: str | None = None) -> Schedule | None:
        """The exact-shape row for (m, n, k) (of ``row_kind`` ``kind`` when given)."""
        for row in self.rows:
            if not row.problem.is_range and row.problem.covers(m, n, k) and kind in (None, row_kind(row)):
                return row
        return None

    def find_range(self, m: int, n: int, k: int, *, kind: str | None = None) -> Schedule | None:
        """The first M-range row (lowest m_min) covering m (of ``row_kind`` ``kind`` when given)."""
        for row in self.rows:
            if row.problem.is_range and row.problem.covers(m, n, k) and kind in (None, row_kind(row)):
                return row
        return None

    def find(self, m: int, n: int, k: int) -> Schedule | None:
        """The exact-shape row, else the first M-range row covering m, else None."""
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
        if not isinstance(data, Mapping):
            raise TableError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
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
            header = {key: data[key] for key in _HEADER_KEYS}
            table = cls(schema_version=version, fingerprint=fingerprint, **header)
        except (TableError, ScheduleError) as exc:
            raise TableError(f"{source}: {exc}") from None
        if fingerprint.world_size != table.world_size:
            raise TableError(
                f"{source}: fingerprint.world_size: {fingerprint.world_size} differs from the header's "
                f"world_size {table.world_size}"
            )
        rows = data["rows"]
        if rows is None:
            rows = []
        if not isinstance(rows, list):
            raise TableError(f"{source}: rows: expected a list, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise TableError(f"{source}: rows[{i}]: expected a mapping, got {type(row).__name__}")
            for key in _HEADER_KEYS:
                if key in row and row[key] != header[key]:
                    raise TableError(
                        f"{source}: rows[{i}]: {key}: the row says {row[key]!r}, the header {header[key]!r}"
                    )
            try:
                if version == 1:
                    row = upgrade_v1_row(row)
                table.upsert(Schedule.from_dict(row, defaults=header))
            except ScheduleError as exc:
                raise TableError(f"{source}: rows[{i}]: {exc}") from None
        table.schema_version = TABLE_SCHEMA_VERSION  # (saving it writes the rows in today's form)
        return table


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
def load_table(path: str | os.PathLike[str]) -> ScheduleTable:
    """Read and validate one table file."""
    data = read_yaml(
        path,
        error=TableError,
        missing=TableNotFoundError,
        missing_hint=f"no schedule table here; write one with `fo-tune search`, or set {TABLE_DIR_ENV} "
        "to a folder that has one",
    )
    return ScheduleTable.from_dict(data, source=str(path))


class _FlowMapping(dict):
    """A mapping written on one line (problem, tile, fingerprint-free leaves)."""


class _FlowList(list):
    """A list written on one line (groups)."""


class _TableDumper(yaml.SafeDumper):
    pass


_TableDumper.add_representer(
    _FlowMapping, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v, flow_style=True)
)
_TableDumper.add_representer(
    _FlowList, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True)
)


def _readable(data: dict[str, Any]) -> dict[str, Any]:
    """Mark a row's small leaves (problem, tile, lists) for one-line output; settings without a
    tile fit on one line too."""
    out = dict(data)
    out["problem"] = _FlowMapping(out["problem"])
    settings = out.get("settings")
    if settings is not None:
        settings = {
            key: _FlowList(value) if isinstance(value, list) else value for key, value in settings.items()
        }
        if "tile" in settings:
            settings["tile"] = _FlowMapping(settings["tile"])
            out["settings"] = settings
        else:
            out["settings"] = _FlowMapping(settings)
    return out


def save_table(table: ScheduleTable, path: str | os.PathLike[str]) -> None:
    """Write ``table`` as YAML: a temporary file in the same folder, then an atomic rename."""
    data = table.to_dict()
    data["rows"] = [_readable(row) for row in data["rows"]]
    text = yaml.dump(data, Dumper=_TableDumper, sort_keys=False, default_flow_style=False, width=110)
    atomic_write(path, lambda f: f.write(text))


def check_fingerprint(table: ScheduleTable, current: Fingerprint, *, source: str) -> None:
    """Refuse a table for other hardware or another world size; warn once on library version drift."""
    theirs = table.fingerprint
    if theirs.compute_capability != current.compute_capability:
        raise TableError(
            f"table {source} is for compute capability {theirs.compute_capability} ({theirs.gpu_name}), "
            f"this device is {current.compute_capability} ({current.gpu_name}); tune one for this GPU "
            "with `fo-tune search`"
        )
    if table.world_size != current.world_size or theirs.world_size != current.world_size:
        raise TableError(
            f"table {source} is for world size {table.world_size}, this job has {current.world_size}; "
            f"tune one for world size {current.world_size} with `fo-tune search`"
        )
    ours = current.versions()
    drift = [
        f"{name} {old} (now {ours[name]})" for name, old in theirs.versions().items() if old != ours[name]
    ]
    if drift:
        warnings.warn(
            f"table {source} was measured with {', '.join(drift)}; its schedules may no longer be the "
            "fastest, re-tune with `fo-tune search`",
            VersionDriftWarning,
            stacklevel=2,
        )


# ---------------------------------------------------------------------------------------- lookup
class _TableCache:
    """Loaded tables keyed by path, valid while the file's (inode, mtime_ns, size) is unchanged."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[Path, tuple[tuple[int, int, int], ScheduleTable]] = OrderedDict()
        self._answers: OrderedDict[tuple, tuple[float, Schedule]] = OrderedDict()

    def load(self, path: Path) -> ScheduleTable | None:
        """The table at ``path``, or None when there is no file."""
        with self._lock:
            try:
                st = path.stat()
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                hit = self._entries.pop(path, None)
                table = hit[1] if hit is not None and hit[0] == stamp else load_table(path)
            except (FileNotFoundError, TableNotFoundError):  # no file (or removed after the stat)
                return None
            self._entries[path] = (stamp, table)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
            return table

    def answer(self, key: tuple) -> Schedule | None:
        """A remembered lookup answer for ``key`` younger than ``TABLE_RECHECK_S``, else None."""
        with self._lock:
            hit = self._answers.get(key)
        if hit is None or time.monotonic() - hit[0] > TABLE_RECHECK_S:
            return None
        return hit[1]

    def remember(self, key: tuple, schedule: Schedule) -> None:
        with self._lock:
            self._answers.pop(key, None)
            self._answers[key] = (time.monotonic(), schedule)
            while len(self._answers) > _ANSWERS_SIZE:
                self._answers.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._answers.clear()


_CACHE = _TableCache(_CACHE_SIZE)


def lookup_schedule(
    collective: str,
    m: int,
    n: int,
    k: int,
    *,
    dtype: torch.dtype | str,
    world_size: int,
    device: torch.device | str | int | None = None,
) -> Schedule:
    """The schedule for this call: the best matching table row (``best_row``), else ``overlap: false``
    with a ``HeuristicScheduleWarning`` saying how to tune the shape.

    For ``all_gather``, ``m`` is the gathered M (world size x the shard's rows).
    Raises ``ScheduleError`` for an unknown collective or dtype, ``ShapeError`` for a bad shape and
    ``TableError`` for a found table that is malformed or for other hardware.
    """
    # A call repeated with the same arguments is answered before they are checked again (they
    # passed the first time): the ops look up every call, and the checks cost a few us of host time.
    # A device that depends on the current CUDA device (None, "cuda") is resolved first. The sizes'
    # types are in the key: True and 64.0 hash as 1 and 64 but are refused by the checks.
    pinned = isinstance(device, torch.device) and (device.type != "cuda" or device.index is not None)
    dev_key = device if pinned else resolve_device(device)
    key = (
        collective, m, n, k, dtype, world_size, dev_key, type(m), type(n), type(k), type(world_size),
        os.environ.get(TABLE_DIR_ENV), os.environ.get("XDG_DATA_HOME"),
    )  # fmt: skip
    try:
        remembered = _CACHE.answer(key)
    except TypeError:  # an unhashable argument, refused by the checks below
        remembered = None
    if remembered is not None:
        return remembered
    _check_name("collective", collective, COLLECTIVES)
    dtype_name = _dtype_name(dtype)
    for name, value in (("m", m), ("n", n), ("k", k), ("world_size", world_size)):
        _check_positive(name, value)
    if collective in SHARDED_COLLECTIVES and m % world_size:
        raise ShapeError(f"{collective} needs M divisible by the world size {world_size}, got M={m}")
    dev = resolve_device(device) if pinned else dev_key  # (a pinned device is checked here)
    fp = current_fingerprint(dev, world_size)
    folders = table_search_path()
    tables: list[ScheduleTable] = []
    found_paths: list[str] = []
    for folder in folders:
        path = table_path(folder, fp.device_key, collective, world_size, dtype_name)
        table = _CACHE.load(path)
        if table is None:
            continue
        check_fingerprint(table, fp, source=str(path))
        if (table.collective, table.dtype) != (collective, dtype_name):
            raise TableError(
                f"{path}: holds {table.collective} {table.dtype} rows, expected {collective} {dtype_name}"
            )
        tables.append(table)
        found_paths.append(str(path))
    found = best_row(tables, m, n, k)
    if found is not None:
        _CACHE.remember(key, found)
        return found
    filename = table_filename(collective, world_size, dtype_name)
    searched = f"tables without a matching row: {', '.join(found_paths)}" if found_paths else "no table file"
    warnings.warn(
        f"no schedule table row for {collective} {dtype_name} {m}x{n}x{k} at world size {world_size} on "
        f"device {fp.device_key}; looked for {fp.device_key}/{filename} in {', '.join(map(str, folders))} "
        f"({searched}); running GEMM then the collective (overlap: false); tune the shape with "
        f"`fo-tune search --shape {m}x{n}x{k} -c {collective} --world-size {world_size} "
        f"--dtype {dtype_name}`",
        HeuristicScheduleWarning,
        stacklevel=2,
    )
    miss = Schedule(
        collective=collective,
        dtype=dtype_name,
        world_size=world_size,
        problem=Problem(m=m, n=n, k=k),
        provenance={"source": MISS_SOURCE},
    )
    _CACHE.remember(key, miss)
    return miss


def row_kind(row: Schedule) -> str:
    """``predicted`` for a row the cost model alone chose (provenance ``mode: predict``), else
    ``measured`` (a measured search's row, or one written by hand)."""
    return "predicted" if row.provenance.get("mode") == "predict" else "measured"


def best_row(tables: list[ScheduleTable], m: int, n: int, k: int) -> Schedule | None:
    """The row ``lookup_schedule`` takes from ``tables`` (in folder order) for (m, n, k): measured
    before predicted, then exact before M-range, then the first table's."""
    for kind in ("measured", "predicted"):
        for finder in (ScheduleTable.find_exact, ScheduleTable.find_range):
            for table in tables:
                found = finder(table, m, n, k, kind=kind)
                if found is not None:
                    return found
    return None
