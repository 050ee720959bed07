"""The MoE table checks beyond what loading checks (every field, the tile, ``chunks`` in
[1, ``MAX_CHUNKS``], no two token buckets of one experts' shape overlapping): whether every
overlapped row's engine can run its bucket on the table's machine, and whether a router's call
can have every row's experts' shape, and whether every number of its provenance is finite.
"""

from __future__ import annotations

from fo_kernels.errors import ScheduleError
from fo_kernels.moe.table import MoeRow, MoeTable
from fo_kernels.table.provenance import check_finite_provenance


def _row_issue(row: MoeRow, table: MoeTable, sm_count: int) -> str | None:
    """Why the runtime cannot run ``row`` as written on the table's machine (None when it can)."""
    s = row.schedule
    where = f"row {s.problem.describe()}"
    if s.engine == "triton" and s.sms_free >= sm_count:
        # the Triton path launches its grouped GEMMs on sm_count - sms_free programs
        return f"{where}: sms_free: {s.sms_free} leaves no SM of {sm_count} for the grouped GEMMs"
    from fo_tune.engines import moe_term

    why = moe_term(s.engine).blocker(table.fingerprint)
    if why:
        return (
            f"{where}: engine: {s.engine} {why}; the runtime skips this row there and runs the "
            "no-overlap path"
        )
    return None


def _shape_issue(row: MoeRow, world: int) -> str | None:
    """Why no router's call has ``row``'s experts' shape (None when one can): ``MoeExperts.check_world``,
    the rule the search and lookup refuse such a shape by."""
    p = row.schedule.problem
    total = p.experts * world
    if p.top_k <= total:
        return None
    return (
        f"row {p.describe()}: top_k: k = {p.top_k} is above the {total} experts at world size {world} "
        f"(E = {world} x E_local {p.experts}), and a router's top-k picks k distinct experts; "
        "`fo-tune search -c moe` writes no such row: remove it"
    )


def _provenance_issue(row: MoeRow) -> str | None:
    """A NaN or infinite number in ``row``'s provenance (the dense tables' rule,
    ``check_finite_provenance``), None when there is none."""
    try:
        check_finite_provenance(row.provenance)
    except ScheduleError as exc:
        return f"row {row.schedule.problem.describe()}: {exc}"
    return None


def validate_moe_table(table: MoeTable, *, sm_count: int | None = None) -> list[str]:
    """Problems the runtime would hit with ``table`` that loading does not catch; [] when none.

    - an overlapped ``triton`` row must leave its grouped GEMMs a grid: ``sms_free`` below the SM
      count (the Triton path launches ``sm_count - sms_free`` programs);
    - an overlapped row's engine must be able to run on the table's fingerprint (the engine's MoE
      term ``blocker``, what the planner checks: the copy engine needs peer access between the
      GPUs); the runtime skips a row it cannot run and runs the no-overlap path;
    - a row's k must not exceed its E = world size x E_local experts (a token picks k distinct
      experts: the search and lookup refuse such a shape);
    - a row's provenance holds no NaN or infinite number (what the planner records is finite).

    The grouped GEMMs mask partial tiles, so any tile that loads runs any bucket. ``sm_count``
    defaults to the table fingerprint's. Each issue is one line naming the row
    (``MoeProblem.describe()``) and the field.
    """
    sms = sm_count if sm_count is not None else table.fingerprint.sm_count
    issues: list[str] = []
    for row in table.rows:
        issue = _shape_issue(row, table.world_size) or _provenance_issue(row)
        if issue is None and row.schedule.engine is not None:
            issue = _row_issue(row, table, sms)
        if issue is not None:
            issues.append(issue)
    return issues
