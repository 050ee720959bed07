"""The measure strategy: a TPE study over the union of engines, every trial timed on the ranks.

A new study first runs every engine's seeds (``fo_tune.search.study.warm_start``), then TPE
proposes points until the study holds ``--trials`` finished trials (resumed ones count); an
infeasible point is pruned before it runs, a schedule already timed is answered from its trial.
"""

from __future__ import annotations

from typing import ClassVar

from fo_tune.search.results import Outcome
from fo_tune.search.strategies.base import ShapeJob, Strategy
from fo_tune.search.study import run_tpe


class MeasureStrategy(Strategy):
    name: ClassVar[str] = "measure"

    def run(self, job: ShapeJob) -> Outcome:
        return run_tpe(job, predicted=False)
