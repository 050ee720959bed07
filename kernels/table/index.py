"""The lookup index of one table's rows: by (N, K), then the exact rows' M and the M ranges, each
sorted, so a lookup is one dict access and a bisection; built in O(n log n), refusing two rows
for one problem and M ranges that overlap (each error names both rows by their index)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from fo_kernels.errors import TableError
from fo_kernels.schedule import Problem

# A row's problem as the index sorts it (the order tables keep their rows in): (n, k, m_lo, kind,
# m_hi); kind 0 an exact row (m_lo = m_hi = m), 1 an M range.
ProblemKey = tuple[int, int, int, int, int]
EXACT, RANGE = 0, 1


def problem_key(problem: Problem) -> ProblemKey:
    if problem.m is not None:
        return (problem.n, problem.k, problem.m, EXACT, problem.m)
    assert problem.m_min is not None and problem.m_max is not None
    return (problem.n, problem.k, problem.m_min, RANGE, problem.m_max)


def describe_key(key: ProblemKey) -> str:
    """``MxNxK`` or ``[m_min,m_max]xNxK``, as ``Problem.describe``."""
    n, k, lo, kind, hi = key
    return f"{lo}x{n}x{k}" if kind == EXACT else f"[{lo},{hi}]x{n}x{k}"


@dataclass(slots=True)
class _Bucket:
    """The rows of one (N, K): exact Ms and the ranges' ends ascending, with their row positions."""

    exact_m: list[int] = field(default_factory=list)
    exact_pos: list[int] = field(default_factory=list)
    range_lo: list[int] = field(default_factory=list)
    range_hi: list[int] = field(default_factory=list)
    range_pos: list[int] = field(default_factory=list)


def _conflict(keys: Sequence[ProblemKey], first: int, second: int) -> str:
    """Why rows ``first`` and ``second`` cannot both be in a table (one line, what to do)."""
    a, b = sorted((first, second))
    ka, kb = keys[a], keys[b]
    if ka == kb:
        return (
            f"rows[{a}] and rows[{b}] are both for problem {describe_key(ka)}; keep one of them "
            "(lookup could take either)"
        )
    lo, hi = max(ka[2], kb[2]), min(ka[4], kb[4])
    return (
        f"rows[{a}] ({describe_key(ka)}) and rows[{b}] ({describe_key(kb)}) overlap for M in "
        f"[{lo},{hi}]; make the M ranges disjoint"
    )


class RowIndex:
    """Positions of a table's rows by problem (see the module docstring). ``keys[i]`` is row i's
    ``ProblemKey``; the positions it returns are indexes into that sequence."""

    __slots__ = ("_buckets", "order")

    def __init__(self, keys: Sequence[ProblemKey]) -> None:
        # Every row's position in key order (timsort: linear on rows already sorted).
        self.order: list[int] = sorted(range(len(keys)), key=keys.__getitem__)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        bucket = _Bucket()
        nk: tuple[int, int] | None = None
        for pos in self.order:
            n, k, lo, kind, hi = keys[pos]
            if (n, k) != nk:
                nk = (n, k)
                bucket = self._buckets[nk] = _Bucket()
            # Within one (N, K) each kind's rows come in ascending M: a clash is with the last one.
            if kind == EXACT:
                if bucket.exact_m and bucket.exact_m[-1] == lo:
                    raise TableError(_conflict(keys, bucket.exact_pos[-1], pos))
                bucket.exact_m.append(lo)
                bucket.exact_pos.append(pos)
            else:
                if bucket.range_hi and lo <= bucket.range_hi[-1]:
                    raise TableError(_conflict(keys, bucket.range_pos[-1], pos))
                bucket.range_lo.append(lo)
                bucket.range_hi.append(hi)
                bucket.range_pos.append(pos)

    def exact(self, m: int, n: int, k: int) -> int | None:
        """The position of the exact row for (m, n, k), else None."""
        bucket = self._buckets.get((n, k))
        if bucket is None:
            return None
        i = bisect_left(bucket.exact_m, m)
        return bucket.exact_pos[i] if i < len(bucket.exact_m) and bucket.exact_m[i] == m else None

    def range(self, m: int, n: int, k: int) -> int | None:
        """The position of the M-range row of (n, k) whose range holds m, else None."""
        bucket = self._buckets.get((n, k))
        if bucket is None:
            return None
        i = bisect_right(bucket.range_lo, m) - 1
        return bucket.range_pos[i] if i >= 0 and m <= bucket.range_hi[i] else None
