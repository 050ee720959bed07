"""Pricing enumerated points with the cost model, without Optuna: the predict and hybrid
strategies' enumeration, and a predicted exhaustive search.

Points are priced in the order of their engine's lower bound (``EngineTuner.lower_bound``: the
Triton engine's GEMM alone on its grid; 0 where an engine knows none). With ``bound`` a point whose
bound is not below the ``keep``-th best price so far (and, ``per_engine``, not below its engine's
best) is skipped: the model would not price it lower, so the result is the same as pricing every
point, for a fraction of the dynamic programs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from typing import Any

from fo_kernels.errors import ScheduleError
from fo_tune.calibrate.calibration import CalibrationError
from fo_tune.search.encoding import Infeasible, describe_attrs, schedule_key, split_params
from fo_tune.search.results import Candidate, Outcome, TrialRecord
from fo_tune.search.strategies.base import ShapeJob


def _record(job: ShapeJob, number: int, params: dict[str, Any], **kw: Any) -> TrialRecord:
    value = kw.pop("value_ms", math.nan)
    fields = dict(schedule="", predicted_ms=math.nan, cached_from=None, note="", engine="", settings="")
    fields.update(kw)
    speedup = job.baseline_ms / value if value > 0 else math.nan
    return TrialRecord(
        job.label,
        number,
        fields.pop("state"),
        dict(params),
        fields["schedule"],
        fields["predicted_ms"],
        math.nan,
        math.nan,
        math.nan,
        value,
        speedup,
        fields["cached_from"],
        fields["note"],
        fields["engine"],
        fields["settings"],
    )


def price(
    job: ShapeJob,
    points: Iterable[dict[str, Any]],
    *,
    keep: int = 1,
    per_engine: bool = False,
    bound: bool = True,
) -> Outcome:
    """Price ``points`` (see the module docstring); candidates are the distinct priced schedules."""
    model = job.model
    assert model is not None
    ordered = [(job.enc.lower_bound(p) if bound else 0.0, i, p) for i, p in enumerate(points)]
    ordered.sort(key=lambda item: (item[0], item[1]))
    best_k: list[float] = []  # a max-heap (negated) of the keep best prices
    engine_best: dict[str, float] = {}
    seen: dict[str, int] = {}
    records: list[TrialRecord] = []
    candidates: dict[str, Candidate] = {}
    skipped = 0
    for lb, _, params in ordered:
        engine, _own = split_params(params)
        kth = -best_k[0] if len(best_k) >= keep else math.inf
        if bound and lb >= kth and (not per_engine or lb >= engine_best.get(engine, math.inf)):
            skipped += 1
            continue
        number = len(records)
        try:
            schedule = job.enc.build(params)
            total = model.predict(schedule, *job.enc.task.shape).total_ms
        except (Infeasible, ScheduleError, CalibrationError) as exc:
            records.append(
                _record(job, number, params, state="PRUNED", note=f"infeasible: {exc}", engine=engine)
            )
            continue
        attrs = describe_attrs(schedule)
        key = schedule_key(schedule)
        records.append(
            _record(
                job,
                number,
                params,
                state="COMPLETE",
                value_ms=total,
                predicted_ms=total,
                schedule=attrs["schedule"],
                engine=attrs["engine"],
                settings=attrs["settings"],
                cached_from=seen.get(key),
            )
        )
        seen.setdefault(key, number)
        if key not in candidates or total < candidates[key].value_ms:
            candidates[key] = Candidate(schedule, total, predicted_ms=total)
        engine_best[engine] = min(engine_best.get(engine, math.inf), total)
        heapq.heappush(best_k, -total)
        if len(best_k) > keep:
            heapq.heappop(best_k)
    if skipped:
        job.notes.append(f"{skipped} point(s) skipped: their lower bound was not below the best price")
    return Outcome(sorted(candidates.values(), key=lambda c: c.value_ms), records)
