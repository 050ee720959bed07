"""The hybrid strategy: the cost model ranks the space, the ranks time only its best.

The model prices the enumeration (``pricing``, bounded: the ``--top-k`` best overall and every
engine's best stay exact); the ``--top-k`` best distinct schedules and the best of every engine
not among them are enqueued in the shape's study and timed on the ranks (a schedule the study
already timed is not timed again).
"""

from __future__ import annotations

from typing import ClassVar

from fo_tune.search.pricing import price
from fo_tune.search.results import Outcome
from fo_tune.search.strategies.base import ShapeJob, Strategy
from fo_tune.search.study import open_study, run_queued


class HybridStrategy(Strategy):
    name: ClassVar[str] = "hybrid"

    def run(self, job: ShapeJob) -> Outcome:
        assert job.measurer is not None
        top_k = job.request.top_k
        ranked = price(job, job.enc.points(exhaustive=False), keep=top_k, per_engine=True).candidates
        picks = ranked[:top_k]
        engines = {c.schedule.engine for c in picks}
        for c in ranked[top_k:]:
            if c.schedule.engine not in engines:
                engines.add(c.schedule.engine)
                picks.append(c)
        opened = open_study(job, predicted=False)
        _stored, study, _resumed = opened
        done = {t.user_attrs.get("key") for t in study.get_trials(deepcopy=False)}
        from fo_tune.search.encoding import schedule_key

        points = [job.enc.params_of(c.schedule) for c in picks if schedule_key(c.schedule) not in done]
        # a DP grouping is rebuilt by its custom cuts; a point the space cannot express is left out
        return run_queued(job, opened, [p for p in points if p is not None])
