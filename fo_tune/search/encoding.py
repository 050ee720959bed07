"""The search's encoding: one study's parameters over the union of engines <-> a ``Schedule``.

A point of a shape's study is ``{"engine": NAME, "NAME.param": value, ...}``: the ``engine``
choice, then that engine's own parameters (``fo_tune.engines``), prefixed with its name so two
engines never share one; Optuna's TPE sampler handles parameters that exist only under one choice.
``UnionEncoding`` delegates everything per point to the engine the point names. A point that
cannot run raises ``Infeasible`` before anything runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fo_kernels.errors import ScheduleError
from fo_kernels.schedule import Schedule
from fo_tune.calibrate.calibration import CalibrationError
from fo_tune.engines import EngineTuner, Infeasible, ShapeTask, get_tuner

if TYPE_CHECKING:
    from fo_tune.model import CostModel

__all__ = [
    "Infeasible",
    "UnionEncoding",
    "describe_attrs",
    "join_params",
    "predicted_ms",
    "schedule_key",
    "split_params",
]


def schedule_key(schedule: Schedule) -> str:
    """What identifies a schedule's behaviour (everything but the provenance), as a JSON string."""
    data = schedule.to_dict()
    data.pop("provenance", None)
    return json.dumps(data, sort_keys=True)


def predicted_ms(model: CostModel | None, schedule: Schedule) -> float:
    """The model's latency of ``schedule`` (nan when there is no model or it cannot price it)."""
    if model is None:
        return math.nan
    p = schedule.problem
    assert p.m is not None
    try:
        return model.predict(schedule, p.m, p.n, p.k).total_ms
    except (CalibrationError, ScheduleError):
        return math.nan


def describe_attrs(schedule: Schedule) -> dict[str, Any]:
    """The user attributes a trial keeps about its schedule (the report's columns)."""
    settings = schedule.settings.to_dict() if schedule.settings is not None else None
    return {
        "key": schedule_key(schedule),
        "schedule": schedule.describe(),
        "engine": schedule.engine or "",
        "settings": json.dumps(settings, sort_keys=True),
    }


def split_params(params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(engine name, that engine's own parameters) of a union point."""
    engine = str(params.get("engine", ""))
    prefix = f"{engine}."
    return engine, {key[len(prefix) :]: v for key, v in params.items() if key.startswith(prefix)}


def join_params(engine: str, own: Mapping[str, Any]) -> dict[str, Any]:
    """The union point of an engine's own parameters."""
    return {"engine": engine, **{f"{engine}.{key}": v for key, v in own.items()}}


class _Prefixed:
    """An Optuna trial whose ``suggest_*`` names get the engine's prefix."""

    def __init__(self, trial: Any, prefix: str) -> None:
        self._trial, self._prefix = trial, prefix

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        return self._trial.suggest_categorical(self._prefix + name, choices)

    def suggest_int(self, name: str, low: int, high: int) -> int:
        return self._trial.suggest_int(self._prefix + name, low, high)

    def suggest_float(self, name: str, low: float, high: float) -> float:
        return self._trial.suggest_float(self._prefix + name, low, high)


@dataclass(frozen=True, slots=True)
class UnionEncoding:
    """The points of one shape over ``engines`` (the ones that can run here), in search order."""

    task: ShapeTask
    engines: tuple[str, ...]

    def tuner(self, name: str) -> EngineTuner:
        if name not in self.engines:
            raise Infeasible(f"engine {name!r} is not searched here (searched: {', '.join(self.engines)})")
        return get_tuner(name)

    def fingerprint(self) -> dict[str, Any]:
        """Every engine's choices, for naming the study (a changed space is a new study)."""
        return {name: get_tuner(name).choices(self.task) for name in self.engines}

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Ask ``trial`` (an ``optuna.Trial``) for a point; returns its parameters."""
        engine = trial.suggest_categorical("engine", list(self.engines))
        own = self.tuner(engine).suggest(_Prefixed(trial, f"{engine}."), self.task)
        return join_params(engine, own)

    def build(self, params: Mapping[str, Any]) -> Schedule:
        """The schedule of ``params``; ``Infeasible`` when it cannot run on this shape."""
        engine, own = split_params(params)
        settings = self.tuner(engine).build(own, self.task)
        return self.task.schedule(settings)

    def params_of(self, schedule: Schedule) -> dict[str, Any] | None:
        """Parameters that build ``schedule`` exactly, or None when the space cannot."""
        if schedule.settings is None or schedule.engine not in self.engines:
            return None
        own = get_tuner(schedule.engine).params_of(schedule.settings, self.task)
        return join_params(schedule.engine, own) if own is not None else None

    def points(self, *, exhaustive: bool) -> Iterator[dict[str, Any]]:
        """Every engine's enumeration, engine by engine."""
        for name in self.engines:
            for own in get_tuner(name).points(self.task, exhaustive=exhaustive):
                yield join_params(name, own)

    def seeds(self) -> list[dict[str, Any]]:
        """Every engine's warm-start points."""
        return [join_params(name, own) for name in self.engines for own in get_tuner(name).seeds(self.task)]

    def lower_bound(self, params: Mapping[str, Any]) -> float:
        engine, own = split_params(params)
        return self.tuner(engine).lower_bound(own, self.task)
