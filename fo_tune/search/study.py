"""The Optuna side of a shape's search: its study, the warm start, running trials, and reading
the trials back as records and candidates.

The study ``<collective>-w<W>-<dtype>-<M>x<N>x<K>-<mode>-<space digest>`` lives in the request's
storage (re-running the same command resumes it; several workers may share it). Sampler: Optuna's
TPE (``TPESampler``): the union space is categorical with conditional parameters (each engine's
parameters exist only under its ``engine`` choice, the custom grouping's cuts only for some group
counts), which TPE samples natively; CMA-ES and GP samplers want a fixed numeric space. A new
study first runs every engine's seeds (``EngineTuner.seeds``: the Triton heuristic default and its
DP grouping, every copy-engine point) and the nearest existing row of the target table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.plan import group_step, resolve_groups
from fo_kernels.schedule import Problem, Schedule, settings_type
from fo_kernels.table import ScheduleTable
from fo_tune.search.encoding import schedule_key
from fo_tune.search.results import Candidate, Outcome, TrialRecord
from fo_tune.search.storage import is_rdb
from fo_tune.search.strategies.base import ShapeJob


def open_study(job: ShapeJob, *, predicted: bool) -> tuple[Any, Any, int]:
    """(stored study, the study trials run in, trials already there). Predicted trials take
    microseconds; one SQLite transaction per Optuna call would take ~50 ms a trial, so they run
    in memory (seeded with the stored ones) and are stored by ``close_study``. (A journal file is
    fast enough to share live between workers, and is used directly.)"""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=job.request.seed)
    storage = job.storage
    stored = optuna.create_study(
        study_name=job.study_name, storage=storage, sampler=sampler, direction="minimize", load_if_exists=True
    )
    fresh = not stored.trials
    study, resumed = stored, 0
    if predicted and is_rdb(storage):
        study = optuna.create_study(sampler=sampler, direction="minimize")
        study.add_trials(stored.get_trials(deepcopy=False, states=finished_states()))
        resumed = len(study.trials)
    if fresh:
        enqueue(study, warm_start(job))
    return stored, study, resumed


def close_study(stored: Any, study: Any, resumed: int) -> None:
    """Store the trials an in-memory study ran (``open_study``)."""
    if study is not stored:
        stored.add_trials(list(study.get_trials(deepcopy=False, states=finished_states())[resumed:]))


def run_tpe(job: ShapeJob, *, predicted: bool) -> Outcome:
    """TPE proposes points until the shape's study holds ``--trials`` finished trials (resumed ones
    count): each priced by the model (``predicted``) or timed on the ranks."""
    import optuna

    from fo_tune.search.trials import Objective

    measurer = None if predicted else job.measurer
    assert predicted or measurer is not None
    stored, study, resumed = open_study(job, predicted=predicted)
    before = measurer.count if measurer is not None else 0
    kind = "predicted" if predicted else "measured"
    objective = Objective(job.enc, job.model, measurer, kind, lambda d, log: job.step(d, log))
    target = job.request.trial_count()
    have = len(study.get_trials(deepcopy=False, states=finished_states()))
    job.reporter.stage(job.stage, max(0, target - have))
    if have < target:
        stop = optuna.study.MaxTrialsCallback(target, states=finished_states())
        with quiet_interrupt():
            study.optimize(objective, n_trials=target - have, timeout=job.budget_s, callbacks=[stop])
    close_study(stored, study, resumed)
    measured = measurer.count - before if measurer is not None else 0
    # Decide from the stored study: it also holds the trials other workers sharing it stored while
    # this one ran in memory. One read of its trials gives both the candidates and the records, so
    # the records count exactly the finished trials the row is decided from (what its stored record
    # says: ``fo_tune.tables.stored``).
    trials = stored.get_trials(deepcopy=False)
    return Outcome(candidates(trials, job), records(trials, job), measured)


def run_queued(job: ShapeJob, opened: tuple[Any, Any, int], points: Iterable[dict[str, Any]]) -> Outcome:
    """Time on the ranks the ``points`` the study (``opened``: what ``open_study`` returned) has not
    run yet, then store it."""
    from fo_tune.search.trials import Objective

    assert job.measurer is not None
    stored, study, resumed = opened
    waiting = enqueue(study, points)
    job.reporter.stage(job.stage, waiting)
    before = job.measurer.count
    if waiting:
        objective = Objective(job.enc, job.model, job.measurer, "measured", lambda d, log: job.step(d, log))
        with quiet_interrupt():
            study.optimize(objective, n_trials=waiting, timeout=job.budget_s)
    close_study(stored, study, resumed)
    trials = study.get_trials(deepcopy=False)  # (one read for both: see run_tpe)
    return Outcome(candidates(trials, job), records(trials, job), job.measurer.count - before)


# The logger Optuna's ``study.optimize`` reports a failed trial on.
OPTIMIZE_LOGGER = "optuna.study._optimize"


class _InterruptFilter(logging.Filter):
    """Drops Optuna's two warnings about the trial a Ctrl-C stopped (the KeyboardInterrupt's
    traceback, then "Trial N failed with value None"): the interrupt goes on to the caller, and
    the CLI says ``error: interrupted`` once. Every other record passes."""

    def __init__(self) -> None:
        super().__init__()
        self.trial: str | None = None  # "Trial N " of the interrupted trial

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if isinstance(exc, KeyboardInterrupt):
            self.trial = " ".join(message.split()[:2]) + " "
            return False
        return not (self.trial is not None and message.startswith(f"{self.trial}failed with value"))


@contextlib.contextmanager
def quiet_interrupt() -> Iterator[None]:
    """Within it, a Ctrl-C during a trial reaches the caller without Optuna's traceback of it."""
    logger = logging.getLogger(OPTIMIZE_LOGGER)
    quiet = _InterruptFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def finished_states() -> tuple[Any, ...]:
    """The Optuna trial states that count as finished: complete and pruned."""
    import optuna

    return (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


def warm_start(job: ShapeJob) -> list[dict[str, Any]]:
    """Every engine's seeds, then the nearest existing table row (any engine) at this shape."""
    seeds = job.enc.seeds()
    near = nearest_row(job.table, job.enc.task.shape)
    if near is not None:
        m, n, k = job.enc.task.shape
        params = job.enc.params_of(regroup(dataclasses.replace(near, problem=Problem(m=m, n=n, k=k))))
        if params is not None:
            seeds.append(params)
    return seeds


def enqueue(study: Any, points: Iterable[dict[str, Any]]) -> int:
    """Enqueue the points not yet in ``study``; returns how many trials now wait."""
    import optuna

    have = {_params_key(t.params) for t in study.get_trials(deepcopy=False)}
    for params in points:  # (enqueue_trial's own duplicate check scans every trial: quadratic)
        key = _params_key(params)
        if key not in have:
            have.add(key)
            study.enqueue_trial(params)
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))


def _params_key(params: Any) -> str:
    return json.dumps(dict(params), sort_keys=True, default=str)


def nearest_row(table: ScheduleTable | None, shape: tuple[int, int, int]) -> Schedule | None:
    """The overlapped exact-shape row nearest in FLOPs (same N, K when there is one), at another M."""
    if table is None:
        return None
    m, n, k = shape
    rows = [r for r in table.rows if r.overlap and not r.problem.is_range and r.problem.m != m]
    same = [r for r in rows if (r.problem.n, r.problem.k) == (n, k)] or rows
    if not same:
        return None
    return min(same, key=lambda r: abs(math.log(r.problem.m * r.problem.n * r.problem.k / (m * n * k))))  # type: ignore[operator]


def regroup(schedule: Schedule) -> Schedule:
    """A row taken to another M: a Triton row's groups read as relative weights (``resolve_groups``,
    cut where a group may start at that M: ``group_step``)."""
    st = schedule.settings
    if not isinstance(st, TritonSettings):
        return schedule
    from fo_tune.engines.triton.model import num_units

    p = schedule.problem
    assert p.m is not None
    units = num_units(schedule, p.m, p.n)
    groups = resolve_groups(st.groups, units, exact=False, step=group_step(schedule, p.m, p.n))
    return dataclasses.replace(schedule, settings=dataclasses.replace(st, groups=groups))


def records(trials: Iterable[Any], job: ShapeJob) -> list[TrialRecord]:
    """Every trial of a study (``trials``: Optuna's ``FrozenTrial``) as a record (speedups against
    ``job.baseline_ms``)."""
    out = []
    for t in trials:
        ua = t.user_attrs
        value = float(t.value) if t.value is not None else math.nan
        out.append(
            TrialRecord(
                shape=job.label,
                number=t.number,
                state=t.state.name,
                params=dict(t.params),
                schedule=str(ua.get("schedule", "")),
                predicted_ms=float(ua.get("predicted_ms", math.nan)),
                measured_ms=float(ua.get("measured_ms", math.nan)),
                spread_ms=float(ua.get("spread_ms", math.nan)),
                rel_err=float(ua.get("rel_err", math.nan)),
                value_ms=value,
                speedup=job.baseline_ms / value if value > 0 else math.nan,
                cached_from=ua.get("cached_from"),
                note=str(ua.get("note", "")),
                engine=str(ua.get("engine", "")),
                settings=str(ua.get("settings", "")),
            )
        )
    return out


def candidates(trials: Iterable[Any], job: ShapeJob) -> list[Candidate]:
    """The distinct completed schedules among a study's ``trials``, best value first (a schedule
    timed twice keeps its better value)."""
    import optuna

    best: dict[str, Candidate] = {}
    for t in trials:
        if t.state != optuna.trial.TrialState.COMPLETE:
            continue
        schedule = _schedule_of(t, job)
        if schedule is None:
            continue
        key = schedule_key(schedule)
        ua = t.user_attrs
        c = Candidate(
            schedule,
            float(t.value),
            predicted_ms=float(ua.get("predicted_ms", math.nan)),
            measured_ms=float(ua.get("measured_ms", math.nan)),
            iqr_ms=float(ua.get("iqr_ms", math.nan)),
            trial=t.number,
        )
        if key not in best or c.value_ms < best[key].value_ms:
            best[key] = c
    return sorted(best.values(), key=lambda c: c.value_ms)


def _schedule_of(trial: Any, job: ShapeJob) -> Schedule | None:
    """The trial's schedule from its recorded settings (rebuilding a "dp" point would run the DP
    again), else from its parameters."""
    engine, settings = trial.user_attrs.get("engine"), trial.user_attrs.get("settings")
    if engine and settings:
        return job.enc.task.schedule(settings_type(engine).from_dict(json.loads(settings)))
    try:
        return job.enc.build(trial.params)
    except ValueError:
        return None
