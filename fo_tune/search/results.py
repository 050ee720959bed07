"""What a search returns: its trials, the candidates a strategy found, and per shape the row."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import Schedule

if TYPE_CHECKING:
    from fo_tune.search.request import SearchRequest


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One trial (or one enumerated point) of a shape's search, flattened for the report."""

    shape: str
    number: int
    state: str  # COMPLETE, PRUNED (infeasible, failed check or bounded out), FAIL, RUNNING, WAITING
    params: dict[str, Any]
    schedule: str
    predicted_ms: float
    measured_ms: float
    spread_ms: float
    rel_err: float
    value_ms: float
    speedup: float  # baseline / value
    cached_from: int | None
    note: str
    engine: str = ""
    settings: str = ""  # the schedule's settings as JSON (rebuilds it: fo-tune model check)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A distinct schedule a strategy timed or priced: its value (measured, else predicted)."""

    schedule: Schedule
    value_ms: float
    predicted_ms: float = math.nan
    measured_ms: float = math.nan
    iqr_ms: float = math.nan
    trial: int | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a strategy returns for one shape: its candidates best first, its records, and how many
    trials it timed on the ranks in this run."""

    candidates: list[Candidate]
    records: list[TrialRecord]
    measured: int = 0


@dataclass(frozen=True, slots=True)
class BaselineResult:
    source: str  # "measured" or "predicted"
    gemm_ms: float
    comm_ms: float
    sequential_ms: float
    spread_ms: float
    iqr_ms: float
    predicted_ms: float  # the model's sequential (nan without a model)
    fallback_ms: float = math.nan  # predicted: the model's overlap: false fallback


@dataclass(slots=True)
class ShapeResult:
    shape: tuple[int, int, int]
    study: str
    mode: str
    baseline: BaselineResult
    row: Schedule
    best_ms: float  # measured: the fastest re-timed median (confirmation); else the best value
    best_trial: int | None  # its trial (None: an enumerated point, not an Optuna trial)
    best_schedule: Schedule | None  # the fastest overlapped schedule, even when the row says no overlap
    confirmed: list[dict[str, Any]]  # measured searches: the best few re-timed beside the baseline
    speedup: float  # baseline / row's latency (1.0 for overlap: false)
    decision: str  # why the row is what it is
    trials: list[TrialRecord]
    measured: int  # trials timed on the ranks in this run (cache hits excluded)
    wall_s: float
    mape: float  # over trials with both numbers (nan if none)
    worst_ape: float
    engines: tuple[str, ...] = ()  # the engines searched

    @property
    def decided_from(self) -> int:
        """The finished trials (or priced points) the row was decided from, which its stored record
        carries (``fo_tune.tables.stored``: of a study's records, pull takes the one from most)."""
        return sum(1 for t in self.trials if t.state in ("COMPLETE", "PRUNED"))


@dataclass(slots=True)
class SearchResult:
    request: SearchRequest
    fingerprint: Fingerprint
    shapes: list[ShapeResult]
    range_rows: list[Schedule] = field(default_factory=list)
    table: Path | None = None
    wall_s: float = 0.0
    storage: str = ""
    kept: list[Schedule] = field(default_factory=list)  # measured rows that kept Ms over predicted ones
    # shapes a Ctrl-C left unsearched (their rows were not written); empty for a search that finished
    not_done: list[tuple[int, int, int]] = field(default_factory=list)


class SearchInterrupted(KeyboardInterrupt):
    """A Ctrl-C during ``run_search``, carrying the ``SearchResult`` of the shapes decided before it
    (their rows are already in the table; ``result.not_done`` lists the rest), so a caller can write
    their report. A ``KeyboardInterrupt``: a caller that does not look for it still stops."""

    def __init__(self, result: SearchResult) -> None:
        super().__init__()
        self.result = result


def model_error(records: Sequence[TrialRecord]) -> tuple[float, float]:
    """(MAPE, worst absolute percentage error) of predicted vs measured, over distinct measured trials."""
    errs = [
        abs(r.predicted_ms - r.measured_ms) / r.measured_ms
        for r in records
        if r.cached_from is None and r.measured_ms > 0 and not math.isnan(r.predicted_ms)
    ]
    if not errs:
        return math.nan, math.nan
    return sum(errs) / len(errs), max(errs)
