"""Comparing two MoE tables: per experts' shape and token bucket, whether a row is only in one
table, changed (which fields) or the same, and the headers' differences.
"""

from __future__ import annotations

from typing import Any

from fo_kernels.moe.schedule import MoeProblem, MoeSchedule
from fo_kernels.moe.table import MoeRow, MoeTable, experts_key
from fo_tune.tables.diff import RowDiff, compare_rows

# Fields of a MoeSchedule that change what the runtime does, in the order diffs report them, per
# engine (a field another engine's schedule carries means nothing to this one's).
MOE_ENGINE_FIELDS: dict[str | None, tuple[str, ...]] = {
    None: (),
    "triton": ("tile", "sms_free", "nccl_max_ctas", "wait_mode"),
    "copy_engine": ("chunks",),
}
# Header fields every row of a table shares.
_HEADER_FIELDS = ("world_size", "dtype")


def moe_changed_fields(a: MoeSchedule, b: MoeSchedule) -> tuple[str, ...]:
    """The fields in which ``a`` and ``b`` differ: ``engine`` alone (with header fields) when the
    engines differ, else the engine's own fields (``MOE_ENGINE_FIELDS``)."""
    header = tuple(name for name in _HEADER_FIELDS if getattr(a, name) != getattr(b, name))
    if a.engine != b.engine:
        return (*header, "engine")
    own = MOE_ENGINE_FIELDS[a.engine]
    return (*header, *(name for name in own if getattr(a, name) != getattr(b, name)))


# How one (experts' shape, bucket)'s row compares between MoE table ``a`` and table ``b``: the
# dense tables' ``RowDiff`` over MoE problems and rows.
MoeRowDiff = RowDiff[MoeProblem, MoeRow]


def _key(problem: MoeProblem) -> tuple[int, ...]:
    """Sort key of a problem, the order MoE tables keep their rows in."""
    return (*experts_key(problem), problem.tokens_min, problem.tokens_max)


def diff_moe_tables(a: MoeTable, b: MoeTable) -> list[MoeRowDiff]:
    """One ``MoeRowDiff`` per (experts' shape, token bucket) in either table, in table order.

    Rows are matched by their problem (the experts' shape and the identical bucket); a bucket
    that changed its bounds is one row only in A and one only in B."""
    rows_a = {row.schedule.problem: row for row in a.rows}
    rows_b = {row.schedule.problem: row for row in b.rows}
    pairs = compare_rows(
        rows_a, rows_b, sort_key=_key, changed=lambda ra, rb: moe_changed_fields(ra.schedule, rb.schedule)
    )
    return [RowDiff(**pair) for pair in pairs]  # (a subscripted alias cannot build a frozen slotted one)


def moe_header_differences(a: MoeTable, b: MoeTable) -> list[tuple[str, Any, Any]]:
    """(name, value in a, value in b) for every header and fingerprint field that differs."""
    out: list[tuple[str, Any, Any]] = [
        (name, getattr(a, name), getattr(b, name))
        for name in _HEADER_FIELDS
        if getattr(a, name) != getattr(b, name)
    ]
    fa, fb = a.fingerprint.to_dict(), b.fingerprint.to_dict()
    out.extend((f"fingerprint.{name}", fa[name], fb[name]) for name in fa if fa[name] != fb[name])
    return out
