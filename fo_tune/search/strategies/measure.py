"""The measure strategy: a TPE study over the union of engines, every trial timed on the ranks.

A new study first runs every engine's seeds (``fo_tune.search.study.warm_start``), then TPE
proposes points until the study holds ``--trials`` finished trials (resumed ones count); an
infeasible point is pruned before it runs, a schedule already timed is answered from its trial.
"""

from __future__ import annotations

from typing import ClassVar

from ...trials import Objective
from ..results import Outcome
from ..study import candidates, close_study, finished_states, open_study, records
from .base import ShapeJob, Strategy


class MeasureStrategy(Strategy):
    name: ClassVar[str] = "measure"

    def run(self, job: ShapeJob) -> Outcome:
        import optuna

        assert job.measurer is not None
        stored, study, resumed = open_study(job, predicted=False)
        before = job.measurer.count
        objective = Objective(job.enc, job.model, job.measurer, "measured", lambda d, log: job.step(d, log))
        target = job.request.trial_count()
        have = len(study.get_trials(deepcopy=False, states=finished_states()))
        job.reporter.stage(job.stage, max(0, target - have))
        if have < target:
            stop = optuna.study.MaxTrialsCallback(target, states=finished_states())
            study.optimize(objective, n_trials=target - have, timeout=job.budget_s, callbacks=[stop])
        close_study(stored, study, resumed)
        return Outcome(candidates(study, job), records(study, job), job.measurer.count - before)
