"""The predict strategy: the cost model prices the enumerated space of every engine; no ranks.

Without ``--trials`` every point of the engines' enumeration (``EngineTuner.points``: each
Triton config with the model's DP grouping, every copy-engine point) is priced in the order of its
lower bound, and points whose bound is not below the best price are skipped (``pricing``): the
same answer as pricing all of them, without Optuna or a study. With ``--trials N``, or when the
enumeration holds more than ``ENUMERATE_LIMIT`` points, a TPE study of N predictions instead
(resumable and shareable like a measured one).
"""

from __future__ import annotations

import itertools
from typing import ClassVar

from ..pricing import price
from ..results import Outcome
from .base import ShapeJob, Strategy

# Points the enumeration prices at most; a larger space is sampled by a TPE study. Bounding a point
# costs a few microseconds and the model prices one in well under a millisecond, so this many stay
# within the second an offline plan of one shape may take on a 2-core CPU.
ENUMERATE_LIMIT = 20000


class PredictStrategy(Strategy):
    name: ClassVar[str] = "predict"

    def run(self, job: ShapeJob) -> Outcome:
        points = list(itertools.islice(job.enc.points(exhaustive=False), ENUMERATE_LIMIT + 1))
        if job.request.trials is None and len(points) <= ENUMERATE_LIMIT:
            job.reporter.stage(job.stage, 1)
            outcome = price(job, points)
            job.step(f"{len(outcome.records)} points priced", log=False)
            return outcome
        return sample(job)


def sample(job: ShapeJob) -> Outcome:
    """A TPE study of ``--trials`` predictions (see the module docstring)."""
    import optuna

    from ...trials import Objective
    from ..study import candidates, close_study, finished_states, open_study, records

    stored, study, resumed = open_study(job, predicted=True)
    objective = Objective(job.enc, job.model, None, "predicted", lambda d, log: job.step(d, log))
    target = job.request.trial_count()
    have = len(study.get_trials(deepcopy=False, states=finished_states()))
    job.reporter.stage(job.stage, max(0, target - have))
    if have < target:
        stop = optuna.study.MaxTrialsCallback(target, states=finished_states())
        study.optimize(objective, n_trials=target - have, timeout=job.budget_s, callbacks=[stop])
    close_study(stored, study, resumed)
    return Outcome(candidates(study, job), records(study, job))
