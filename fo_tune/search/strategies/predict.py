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

from fo_tune.search.pricing import price
from fo_tune.search.results import Outcome
from fo_tune.search.strategies.base import ShapeJob, Strategy

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
    from fo_tune.search.study import run_tpe

    return run_tpe(job, predicted=True)
