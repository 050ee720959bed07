"""Comparing two tables: per problem, whether a row is only in one table, changed (which fields) or
the same, and the headers' differences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from fo_kernels.schedule import Problem, Schedule
from fo_kernels.table import (
    ScheduleTable,
)

# Fields of a Schedule that change what the runtime does, in the order diffs report them: the
# common ones, then any engine's settings (``field_value``).
SCHEDULE_FIELDS = (
    "collective",
    "dtype",
    "world_size",
    "overlap",
    "engine",
    "mode",
    "tile",
    "sms_free",
    "nccl_max_ctas",
    "signal_tiles",
    "groups",
    "weights",
    "layout",
    "wait_mode",
)
# Of those, the ones that describe the header (every row of a table shares them).
_HEADER_FIELDS = ("collective", "dtype", "world_size")
# Provenance keys holding a latency in milliseconds, in the order of preference (a measurement
# beats the model's prediction).
LATENCY_KEYS = ("measured_ms", "predicted_ms")

DiffStatus = Literal["only_a", "only_b", "changed", "same"]
DIFF_STATUSES: tuple[DiffStatus, ...] = ("only_a", "only_b", "changed", "same")


# ------------------------------------------------------------------------------------- diff
def _problem_key(problem: Problem) -> tuple[int, int, int, int, int]:
    """Sort key of a problem, the order tables keep their rows in."""
    if problem.m is not None:
        return (problem.n, problem.k, problem.m, 0, problem.m)
    assert problem.m_min is not None and problem.m_max is not None
    return (problem.n, problem.k, problem.m_min, 1, problem.m_max)


def latencies(schedule: Schedule | None) -> dict[str, float]:
    """The latencies (``LATENCY_KEYS``) a row's provenance holds as numbers, in preference order."""
    return {} if schedule is None else provenance_latencies(schedule.provenance)


def provenance_latencies(provenance: Mapping[str, Any]) -> dict[str, float]:
    """The latencies (``LATENCY_KEYS``) ``provenance`` holds as numbers, in preference order."""
    out: dict[str, float] = {}
    for key in LATENCY_KEYS:
        value = provenance.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def field_value(schedule: Schedule, name: str) -> Any:
    """A ``SCHEDULE_FIELDS`` value of ``schedule``: a common field, or its engine's setting of that
    name (None where its engine has none)."""
    if name in ("collective", "dtype", "world_size", "overlap", "engine"):
        return getattr(schedule, name)
    return getattr(schedule.settings, name, None)


def changed_fields(a: Schedule, b: Schedule) -> tuple[str, ...]:
    """The ``SCHEDULE_FIELDS`` in which ``a`` and ``b`` differ.

    When ``overlap`` differs only it (and header fields) are reported: the other fields mean nothing
    on the side that does not overlap. Two rows without overlap compare on the header fields only.
    """
    header = tuple(name for name in _HEADER_FIELDS if getattr(a, name) != getattr(b, name))
    if a.overlap != b.overlap:
        return (*header, "overlap")
    if not a.overlap:
        return header
    return tuple(name for name in SCHEDULE_FIELDS if field_value(a, name) != field_value(b, name))


def changed_provenance(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[str, ...]:
    """The provenance keys whose values differ between ``a`` and ``b``, in first-seen order."""
    if a == b and all(value == value for value in a.values()):  # (a NaN differs from itself)
        return ()
    keys = list(dict.fromkeys([*a, *b]))
    return tuple(str(key) for key in keys if a.get(key) != b.get(key))


# A table's problem and row types: ``Problem`` and ``Schedule`` for the dense tables,
# ``MoeProblem`` and ``MoeRow`` for the MoE tables (``fo_tune.tables.moe_diff.MoeRowDiff``).
P = TypeVar("P")
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True, slots=True)
class RowDiff(Generic[P, R]):
    """How one problem's row compares between table ``a`` and table ``b``.

    ``status``: ``only_a``, ``only_b``, ``changed`` (some ``SCHEDULE_FIELDS`` differ, listed in
    ``fields``) or ``same`` (the runtime would do the same; the provenance may still differ, listed
    in ``provenance_changed``). ``latency_a``/``latency_b``: the rows' provenance latencies
    (``measured_ms``, ``predicted_ms``) where present.
    """

    problem: P
    status: DiffStatus
    a: R | None
    b: R | None
    fields: tuple[str, ...] = ()
    provenance_changed: tuple[str, ...] = ()
    latency_a: dict[str, float] = field(default_factory=dict)
    latency_b: dict[str, float] = field(default_factory=dict)

    @property
    def differs(self) -> bool:
        """True unless the rows are the same schedule (provenance aside)."""
        return self.status != "same"


def diff_tables(a: ScheduleTable, b: ScheduleTable) -> list[RowDiff[Problem, Schedule]]:
    """One ``RowDiff`` per problem in either table, in table order (N, K, then M or m_min).

    Rows are matched by problem (exact M, or the identical M range); rows of the two tables are
    compared field by field whatever their headers (compare the headers' fingerprints separately).
    """
    rows_a = {row.problem: row for row in a.rows}
    rows_b = {row.problem: row for row in b.rows}
    # changed_fields reads a row's header fields and settings alone, and a loaded table's rows of
    # one schedule share their settings (fo_tune.tables.kinds): each pair of schedules is compared
    # once (the rows, and so the settings each id names, live as long as the tables).
    known: dict[tuple[Any, ...], tuple[str, ...]] = {}

    def changed(ra: Schedule, rb: Schedule) -> tuple[str, ...]:
        key = (ra.collective, ra.dtype, ra.world_size, id(ra.settings))
        key += (rb.collective, rb.dtype, rb.world_size, id(rb.settings))
        fields_ = known.get(key)
        if fields_ is None:
            fields_ = known[key] = changed_fields(ra, rb)
        return fields_

    pairs = compare_rows(rows_a, rows_b, sort_key=_problem_key, changed=changed)
    return [RowDiff(**pair) for pair in pairs]


def compare_rows(
    rows_a: Mapping[Any, Any],
    rows_b: Mapping[Any, Any],
    *,
    sort_key: Callable[[Any], Any],
    changed: Callable[[Any, Any], tuple[str, ...]],
) -> list[dict[str, Any]]:
    """Rows matched by problem between two tables, in ``sort_key`` order: per problem in either,
    the fields of a ``RowDiff`` (or ``MoeRowDiff``) as keywords: ``status`` (``only_a``,
    ``only_b``, ``changed`` when ``changed(row_a, row_b)`` names fields, else ``same``), the rows,
    the changed fields and provenance keys, and the rows' provenance latencies. Rows are any with
    a ``provenance`` mapping."""
    out: list[dict[str, Any]] = []
    for problem in sorted(rows_a.keys() | rows_b.keys(), key=sort_key):
        ra, rb = rows_a.get(problem), rows_b.get(problem)
        pa = {} if ra is None else ra.provenance
        pb = {} if rb is None else rb.provenance
        pair: dict[str, Any] = dict(problem=problem, a=ra, b=rb)
        pair.update(latency_a=provenance_latencies(pa), latency_b=provenance_latencies(pb))
        if rb is None:
            pair["status"] = "only_a"
        elif ra is None:
            pair["status"] = "only_b"
        else:
            fields_ = changed(ra, rb)
            pair.update(
                status="changed" if fields_ else "same",
                fields=fields_,
                provenance_changed=changed_provenance(pa, pb),
            )
        out.append(pair)
    return out


def header_differences(a: ScheduleTable, b: ScheduleTable) -> list[tuple[str, Any, Any]]:
    """(name, value in a, value in b) for every header and fingerprint field that differs."""
    out: list[tuple[str, Any, Any]] = []
    for name in ("collective", "world_size", "dtype", "schema_version"):
        if getattr(a, name) != getattr(b, name):
            out.append((name, getattr(a, name), getattr(b, name)))
    fa, fb = a.fingerprint.to_dict(), b.fingerprint.to_dict()
    out.extend((f"fingerprint.{name}", fa[name], fb[name]) for name in fa if fa[name] != fb[name])
    return out
