"""The schedule table: ``ScheduleTable`` (one file's header and rows, unique per problem and sorted),
its YAML format (schema 2, schema-1 rows upgraded), loading and saving, and the fingerprint check."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from fo_kernels.errors import ScheduleError, TableError, TableNotFoundError, VersionDriftWarning
from fo_kernels.files import atomic_write, read_yaml
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import COLLECTIVES, DTYPES, Schedule
from fo_kernels.table.paths import TABLE_DIR_ENV, check_name

TABLE_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
TABLE_KIND = "fo-tune-schedule-table"
# Row keys that the header owns.
_HEADER_KEYS = ("collective", "dtype", "world_size")
_TOP_KEYS = ("schema_version", "kind", "fingerprint", "collective", "world_size", "dtype", "rows")


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
        check_name("collective", self.collective, COLLECTIVES)
        check_name("dtype", self.dtype, DTYPES)
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


def row_kind(row: Schedule) -> str:
    """``predicted`` for a row the cost model alone chose (provenance ``mode: predict``), else
    ``measured`` (a measured search's row, or one written by hand)."""
    return "predicted" if row.provenance.get("mode") == "predict" else "measured"
