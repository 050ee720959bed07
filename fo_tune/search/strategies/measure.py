"""The measure strategy: a TPE study over the union of engines, every trial timed on the ranks.

A new study first runs every engine's seeds (``fo_tune.search.study.warm_start``), then TPE
proposes points until the study holds ``--trials`` finished trials (resumed ones count); an
infeasible point is pruned before it runs, a schedule already timed is answered from its trial.
"""

from __future__ import annotations

from typing import ClassVar

from ..results import Outcome
from ..study import run_tpe
from .base import ShapeJob, Strategy


class MeasureStrategy(Strategy):
    name: ClassVar[str] = "measure"

    def run(self, job: ShapeJob) -> Outcome:
        return run_tpe(job, predicted=False)
