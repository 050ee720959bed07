"""The lookup index of one table's rows: by (N, K), then the exact rows' M and the M ranges, each
sorted, so a lookup is one dict access and a bisection; built in O(n log n), refusing two rows
for one problem and M ranges that overlap (each error names both rows by their index)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from fo_kernels.errors import TableError
from fo_kernels.schedule import Problem

# A row's problem as the index sorts it (the order tables keep their rows in): (n, k, m_lo, kind,
# m_hi); kind 0 an exact row (m_lo = m_hi = m), 1 an M range.
ProblemKey = tuple[int, int, int, int, int]
EXACT, RANGE = 0, 1


def problem_key(problem: Problem) -> ProblemKey:
    """The sort key (``ProblemKey``) of a row's ``problem``: an exact row's M, or its M range."""
    if problem.m is not None:
        return (problem.n, problem.k, problem.m, EXACT, problem.m)
    assert problem.m_min is not None and problem.m_max is not None
    return (problem.n, problem.k, problem.m_min, RANGE, problem.m_max)


def describe_key(key: ProblemKey) -> str:
    """``MxNxK`` or ``[m_min,m_max]xNxK``, as ``Problem.describe``."""
    n, k, lo, kind, hi = key
    return f"{lo}x{n}x{k}" if kind == EXACT else f"[{lo},{hi}]x{n}x{k}"


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
    ``ProblemKey``; the positions it returns are indexes into that sequence.

    The rows of every (N, K) are one slice of flat lists (the exact rows' Ms, the ranges' ends,
    each ascending, with their positions): a table of 100,000 (N, K) pairs is indexed in a fraction
    of the time per-pair objects took, and leaves the garbage collector few objects to walk."""

    __slots__ = ("_exact_m", "_exact_pos", "_range_hi", "_range_lo", "_range_pos", "_slices", "order")

    def __init__(self, keys: Sequence[ProblemKey]) -> None:
        # Every row's position in key order (timsort: linear on rows already sorted).
        self.order: list[int] = sorted(range(len(keys)), key=keys.__getitem__)
        exact_m: list[int] = []
        exact_pos: list[int] = []
        range_lo: list[int] = []
        range_hi: list[int] = []
        range_pos: list[int] = []
        # (N, K) -> (first exact, end of exact, first range, end of range) in the flat lists.
        self._slices: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        nk: tuple[int, int] | None = None
        e0 = r0 = 0
        for pos in self.order:
            n, k, lo, kind, hi = keys[pos]
            if (n, k) != nk:
                if nk is not None:
                    self._slices[nk] = (e0, len(exact_m), r0, len(range_lo))
                nk, e0, r0 = (n, k), len(exact_m), len(range_lo)
            # Within one (N, K) each kind's rows come in ascending M: a clash is with the last one.
            if kind == EXACT:
                if len(exact_m) > e0 and exact_m[-1] == lo:
                    raise TableError(_conflict(keys, exact_pos[-1], pos))
                exact_m.append(lo)
                exact_pos.append(pos)
            else:
                if len(range_lo) > r0 and lo <= range_hi[-1]:
                    raise TableError(_conflict(keys, range_pos[-1], pos))
                range_lo.append(lo)
                range_hi.append(hi)
                range_pos.append(pos)
        if nk is not None:
            self._slices[nk] = (e0, len(exact_m), r0, len(range_lo))
        self._exact_m, self._exact_pos = exact_m, exact_pos
        self._range_lo, self._range_hi, self._range_pos = range_lo, range_hi, range_pos

    def exact(self, m: int, n: int, k: int) -> int | None:
        """The position of the exact row for (m, n, k), else None."""
        found = self._slices.get((n, k))
        if found is None:
            return None
        e0, e1 = found[0], found[1]
        i = bisect_left(self._exact_m, m, e0, e1)
        return self._exact_pos[i] if i < e1 and self._exact_m[i] == m else None

    def range(self, m: int, n: int, k: int) -> int | None:
        """The position of the M-range row of (n, k) whose range holds m, else None."""
        found = self._slices.get((n, k))
        if found is None:
            return None
        r0, r1 = found[2], found[3]
        i = bisect_right(self._range_lo, m, r0, r1) - 1
        return self._range_pos[i] if i >= r0 and m <= self._range_hi[i] else None
