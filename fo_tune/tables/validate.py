"""The table checks that need a shape, beyond what loading checks (every field, rows unique per
problem, M ranges disjoint): ``fo_kernels.plan.check_fits`` for every exact row and for the ends
and middle of every M range.
"""

from __future__ import annotations

from fo_kernels.errors import ScheduleError, ShapeError
from fo_kernels.plan import check_fits
from fo_kernels.scaling import FP8_ALIGN, FP8_DTYPE, fp8_aligned
from fo_kernels.schedule import SHARDED_COLLECTIVES, Problem, Schedule, dtype_name
from fo_kernels.table import (
    ScheduleTable,
)
from fo_tune.ranks.limits import INT32_MAX


# ------------------------------------------------------------------------------------- validate
def _range_ms(problem: Problem, shards: int) -> list[int]:
    """M values a range row is checked at: both ends and the middle (multiples of ``shards``)."""
    assert problem.m_min is not None and problem.m_max is not None
    lo = -(-problem.m_min // shards) * shards
    hi = problem.m_max // shards * shards
    if lo > hi:
        return []
    mid = max(lo, (lo + hi) // 2 // shards * shards)
    return sorted({lo, mid, hi})


def _too_big(problem: Problem) -> str | None:
    """The field of ``problem`` above ``INT32_MAX`` that no call reaches (N, K, an exact M or a
    range's m_min; a range's m_max above it still covers the Ms up to it), else None."""
    smallest_m = ("m", problem.m) if problem.m is not None else ("m_min", problem.m_min)
    for name, size in (("n", problem.n), ("k", problem.k), smallest_m):
        if size is not None and size > INT32_MAX:
            return name
    return None


def _plan_issue(row: Schedule, m: int, sm_count: int, where: str) -> str | None:
    try:
        check_fits(row, m, row.problem.n, row.problem.k, sm_count=sm_count)
    except (ScheduleError, ShapeError) as exc:
        return f"row {where}: {exc}"
    return None


def validate_table(table: ScheduleTable, *, sm_count: int | None = None) -> list[str]:
    """Problems the runtime would hit with ``table`` that loading does not catch; [] when none.

    - every overlapped exact-shape row must fit its shape (``fo_kernels.plan.check_fits``): for the
      Triton engine a plan, with groups summing to the signal units, ``row_band`` groups starting
      on whole bands and a grid left by ``sms_free``; a copy-engine row fits any M;
    - every overlapped M-range row must give a plan at ``m_min``, ``m_max`` and a middle M (for
      ``reduce_scatter`` and ``all_gather`` the multiples of the world size nearest inside the
      range), and the range must hold at least one such M;

    - an fp8 row's N and K must be multiples of ``FP8_ALIGN`` (the fp8 ops refuse other shapes, so
      such a row is never called);
    - a row's N, K and smallest M must be at most ``INT32_MAX`` (the GEMMs take int32 sizes and
      every call above it is refused, so such a row is never called);

    (Two rows for one problem, and M ranges of one (N, K) that overlap, cannot be in a
    ``ScheduleTable``: loading refuses them, naming both rows.)

    ``sm_count`` defaults to the table fingerprint's. Each issue is one line naming the row
    (``problem.describe()``) and the field, e.g.
    ``row 64x64x32: groups: sizes sum to 3 signal units but this shape has 4 (...)``.
    """
    sms = sm_count if sm_count is not None else table.fingerprint.sm_count
    issues: list[str] = []
    fp8 = dtype_name(FP8_DTYPE)
    for row in table.rows:
        problem = row.problem
        if row.dtype == fp8 and not fp8_aligned(problem.n, problem.k):
            issues.append(
                f"row {problem.describe()}: problem: an fp8 row's N and K must be multiples of "
                f"{FP8_ALIGN} (torch._scaled_mm's rule), so no call ever takes this row"
            )
        too_big = _too_big(problem)
        if too_big is not None:
            issues.append(
                f"row {problem.describe()}: problem.{too_big}: above {INT32_MAX}, the largest size the "
                "GEMMs take (int32), so no call ever takes this row; remove it or fix the size"
            )
            continue
        if not row.overlap:
            continue
        if not problem.is_range:
            assert problem.m is not None
            issue = _plan_issue(row, problem.m, sms, problem.describe())
            if issue is not None:
                issues.append(issue)
            continue
        shards = row.world_size if row.collective in SHARDED_COLLECTIVES else 1
        ms = _range_ms(problem, shards)
        if not ms:
            issues.append(
                f"row {problem.describe()}: problem: the M range holds no M divisible by world_size "
                f"{row.world_size}, which {row.collective} needs"
            )
        for m in ms:
            issue = _plan_issue(row, m, sms, f"{problem.describe()} at M={m}")
            if issue is not None:
                issues.append(issue)
    return issues
