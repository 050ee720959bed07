"""The interface every search strategy implements, and what it is given for one shape.

A strategy is stateless and registered by exact name (``fo_tune.search.strategies.get_strategy``).
``run(job)`` is called once per shape; it explores ``job.enc`` (the union of the engines that can
run here) with the model and/or the ranks the job carries, and returns an ``Outcome``: the
distinct schedules it timed or priced, best first, and one record per trial or priced point. The
driver (``fo_tune.search.driver``) then confirms a measured outcome beside the baselines, or
decides a predicted one, with the same no-gain rule (``fo_tune.search.decide``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fo_tune.search.results import Outcome

if TYPE_CHECKING:
    from fo_kernels.table import ScheduleTable
    from fo_tune.model import CostModel
    from fo_tune.output import Reporter
    from fo_tune.search.encoding import UnionEncoding
    from fo_tune.search.request import SearchRequest
    from fo_tune.search.trials import Measurer


@dataclass(kw_only=True)
class ShapeJob:
    """One shape's search: the request, the encoding, the model and the ranks, where the study
    lives, the table it may seed from, its share of the time budget and the progress sink."""

    request: SearchRequest
    enc: UnionEncoding
    model: CostModel | None
    measurer: Measurer | None
    study_name: str
    storage: Any  # the opened Optuna storage (the enumeration runs no study in it)
    table: ScheduleTable | None
    budget_s: float | None
    reporter: Reporter
    baseline_ms: float  # the value speedups are quoted against (the fallback, else sequential)
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "x".join(map(str, self.enc.task.shape))

    @property
    def stage(self) -> str:
        return f"{self.label} {self.request.strategy}"

    def step(self, detail: str, log: bool = True) -> None:
        self.reporter.step(self.stage, detail, log=log)


class Strategy(ABC):
    """One way to search a shape (see the module docstring)."""

    name: ClassVar[str]

    @abstractmethod
    def run(self, job: ShapeJob) -> Outcome:
        """Search ``job``'s shape; the outcome's candidates are best first."""
