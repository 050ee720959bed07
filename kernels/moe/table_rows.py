"""An MoE table file's header and rows as read: the header checked (``moe_header``) and a row built
into a ``MoeRow`` (``build_moe_row``: its schedule and provenance checked), every error a
``TableError`` naming the file, and the row where there is one; ``fo_kernels.moe.table`` keeps
the rows, saves them and looks a call's row up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fo_kernels.errors import ScheduleError, TableError
from fo_kernels.fields import check_record
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.moe.routing import MOE_DTYPES
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.schedule import COLLECTIVES
from fo_kernels.table.format import MOE_TABLE_KIND, TABLE_KIND, empty_rows, not_a_mapping, written_key
from fo_kernels.table.paths import check_name, where_it_belongs

MOE_TABLE_SCHEMA_VERSION = 1
_TOP_KEYS = ("schema_version", "kind", "fingerprint", "world_size", "dtype", "rows")
# Row keys the header owns: a row may repeat the header's value, never state another.
_HEADER_KEYS = ("dtype", "world_size")


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeRow:
    """One row: the schedule and where it comes from (``provenance``, a mapping)."""

    schedule: MoeSchedule
    provenance: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, MoeSchedule):
            raise TableError(
                f"schedule: expected a fo_kernels.MoeSchedule, got {type(self.schedule).__name__} (a "
                "mapping becomes one through MoeSchedule.from_dict)"
            )
        try:
            check_record("provenance", self.provenance)
        except ScheduleError as exc:
            raise TableError(str(exc)) from None

    @property
    def kind(self) -> str:
        """``predicted`` for a row of the cost model alone (``mode: predict``), else ``measured``."""
        return "predicted" if self.provenance.get("mode") == "predict" else "measured"

    def to_dict(self) -> dict[str, Any]:
        data = self.schedule.to_dict()
        del data["dtype"], data["world_size"]
        return {**data, "provenance": dict(self.provenance)} if self.provenance else data


def moe_header(data: Any, source: str) -> tuple[Fingerprint, int, str, list[Any]]:
    """(fingerprint, world size, dtype, the rows as read) of an MoE table file's data, the header
    checked; every error is a ``TableError`` naming ``source``."""
    if not isinstance(data, Mapping):
        raise not_a_mapping(data, source)
    if data.get("kind") == TABLE_KIND and data.get("collective") in COLLECTIVES:  # under the MoE name
        name = f"{data.get('collective')}-w{data.get('world_size')}-{data.get('dtype')}.yaml"
        raise TableError(
            f"{source}: a dense schedule table (kind {TABLE_KIND!r}), not an MoE table, and the dense "
            f"lookup reads it only as {name}; {where_it_belongs(source, written_key(data), name)}"
        )
    version = data.get("schema_version")
    if data.get("kind") != MOE_TABLE_KIND or version != MOE_TABLE_SCHEMA_VERSION or isinstance(version, bool):
        raise TableError(
            f"{source}: expected kind {MOE_TABLE_KIND!r} schema_version {MOE_TABLE_SCHEMA_VERSION}, got "
            f"{data.get('kind')!r} {version!r}"
        )
    unknown = sorted(str(k) for k in set(data) - set(_TOP_KEYS))
    if unknown:
        raise TableError(f"{source}: unknown key(s) {', '.join(unknown)}; valid: {list(_TOP_KEYS)}")
    try:
        fingerprint = Fingerprint.from_dict(data.get("fingerprint"))
        world, dtype = data.get("world_size"), data.get("dtype")
        check_name("dtype", dtype, MOE_DTYPES)
        if isinstance(world, bool) or not isinstance(world, int) or world != fingerprint.world_size:
            raise TableError(f"world_size: {world!r} is not the fingerprint's {fingerprint.world_size}")
    except (ScheduleError, TableError) as exc:
        raise TableError(f"{source}: {exc}") from None
    if "rows" not in data:  # (a file cut short before its rows would read as an empty table)
        raise TableError(
            f"{source}: rows: missing; write `rows: []` for a table without rows, or restore the file "
            "from its copy"
        )
    rows = data["rows"]
    if rows is None:
        raise empty_rows(source)
    if not isinstance(rows, list):
        raise TableError(f"{source}: rows: expected a list, got {type(rows).__name__}")
    return fingerprint, world, dtype, rows


def build_moe_row(row: Any, i: int, dtype: str, world: int, source: str) -> MoeRow:
    """Row ``i`` of a file as a ``MoeRow``; errors name ``source`` and the row. The header's
    ``dtype`` and ``world_size`` are the row's (a row that states others is refused)."""
    if not isinstance(row, Mapping):
        raise TableError(f"{source}: rows[{i}]: expected a mapping, got {type(row).__name__}")
    header = {"dtype": dtype, "world_size": world}
    for key in _HEADER_KEYS:
        if key in row and row[key] != header[key]:
            raise TableError(
                f"{source}: rows[{i}]: {key}: the row says {row[key]!r}, the header {header[key]!r}; "
                "a table holds the rows of its header's dtype and world size"
            )
    body = {k: v for k, v in row.items() if k != "provenance"}
    try:
        schedule = MoeSchedule.from_dict({**body, **header})
        provenance = row.get("provenance") or {}
        return MoeRow(
            schedule=schedule, provenance=dict(provenance) if isinstance(provenance, Mapping) else provenance
        )
    except (ScheduleError, TableError) as exc:
        raise TableError(f"{source}: rows[{i}]: {exc}") from None
