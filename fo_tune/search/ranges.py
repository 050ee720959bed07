"""M-range rows: from the tuned exact shapes of each (N, K) to rows that cover every M of a range."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from fo_kernels.errors import ScheduleError, ShapeError
from fo_kernels.plan import check_fits
from fo_kernels.schedule import SHARDED_COLLECTIVES, Problem, Schedule
from fo_tune.search.results import ShapeResult


def range_rows(
    m_range: tuple[int, int] | None, results: Sequence[ShapeResult], sm_count: int
) -> list[Schedule]:
    """M-range rows from the tuned exact shapes of each (N, K): tuned M_i covers M from the
    geometric midpoint with its lower neighbour to the one with its upper neighbour. A row must
    plan for every M it covers that is checked (its ends, its tuned M); else the range says
    ``overlap: false``."""
    if m_range is None:
        return []
    lo, hi = m_range
    out: list[Schedule] = []
    by_nk: dict[tuple[int, int], list[ShapeResult]] = {}
    for r in results:
        by_nk.setdefault((r.shape[1], r.shape[2]), []).append(r)
    for (n, k), rs in by_nk.items():
        rs.sort(key=lambda r: r.shape[0])
        ms = [r.shape[0] for r in rs]
        bounds = [lo] + [math.isqrt(a * b) + 1 for a, b in itertools.pairwise(ms)] + [hi + 1]
        for r, start, stop in zip(rs, bounds, bounds[1:], strict=False):
            problem = Problem(m_min=start, m_max=stop - 1, n=n, k=k)
            prov = dict(r.row.provenance) | {"tuned_m": r.shape[0]}
            candidate = dataclasses.replace(r.row, problem=problem, provenance=prov)
            if candidate.overlap and not plans_everywhere(candidate, (start, stop - 1, r.shape[0]), sm_count):
                candidate = dataclasses.replace(
                    candidate,
                    settings=None,
                    provenance=prov | {"decision": "the tuned schedule does not plan across the range"},
                )
            out.append(candidate)
    return out


def plans_everywhere(schedule: Schedule, ms: Sequence[int], sm_count: int) -> bool:
    """The schedule plans at every M of ``ms`` (each rounded down to a multiple of the shards:
    the world size for reduce_scatter and all_gather)."""
    p = schedule.problem
    world = schedule.world_size if schedule.collective in SHARDED_COLLECTIVES else 1
    for m in ms:
        m = m - m % world if m % world else m
        if m < 1:
            continue
        try:
            check_fits(schedule, m, p.n, p.k, sm_count=sm_count)
        except (ScheduleError, ShapeError):
            return False
    return True
