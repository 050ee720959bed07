"""The exhaustive strategy: every point of the engines' exhaustive enumeration (each Triton config
with its DP grouping and near-equal splits, every copy-engine point), timed on the ranks
(``--mode measure``: enqueued in the shape's study) or priced by the model (``--mode predict``:
no bound, no study). A space with more than ``EXHAUSTIVE_LIMIT`` points for a shape is refused
before anything runs (``check_size``)."""

from __future__ import annotations

import itertools
from typing import ClassVar

from fo_tune.search.pricing import price
from fo_tune.search.request import SearchError
from fo_tune.search.results import Outcome
from fo_tune.search.strategies.base import ShapeJob, Strategy

# --exhaustive refuses a space with more points than this for one shape (the shipped H200 space has
# ~22,000: hours of measurement); search_spaces/bench/h200_small.yaml has 112-128.
EXHAUSTIVE_LIMIT = 4000


def check_size(job: ShapeJob) -> None:
    """Refuse (before anything runs) a space too large to enumerate for this shape."""
    count = sum(1 for _ in itertools.islice(job.enc.points(exhaustive=True), EXHAUSTIVE_LIMIT + 1))
    if count > EXHAUSTIVE_LIMIT:
        raise SearchError(
            f"--exhaustive: the space has more than {EXHAUSTIVE_LIMIT} points for {job.label}; give a "
            "smaller one with --space (search_spaces/bench/h200_small.yaml) or search without --exhaustive"
        )


class ExhaustiveStrategy(Strategy):
    name: ClassVar[str] = "exhaustive"

    def run(self, job: ShapeJob) -> Outcome:
        points = list(job.enc.points(exhaustive=True))
        if job.measurer is None:
            job.reporter.stage(job.stage, 1)
            return price(job, points, bound=False)
        from fo_tune.search.study import open_study, run_queued

        return run_queued(job, open_study(job, predicted=False), points)
