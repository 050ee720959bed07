"""What one trial of the search does: measuring schedules on the ranks, and the Optuna objective.

``Measurer`` runs ``OverlapTrialTask`` / ``SequentialTask`` / ``ConfirmTask`` on the pool and takes
the max over ranks. ``Objective`` turns a trial into a schedule of any engine (``UnionEncoding``),
prunes infeasible points before anything runs, answers a schedule already completed in the study
from that trial, predicts every schedule the cost model can price, and returns the predicted or
the measured latency.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from fo_kernels.schedule import Schedule
from fo_tune.model import CostModel
from fo_tune.ranks import CONFIRM_ROUNDS
from fo_tune.ranks.pool import Pool
from fo_tune.ranks.timing import Timing
from fo_tune.ranks.trials import ConfirmTask, OverlapTrialTask, SequentialTask
from fo_tune.search.encoding import Infeasible, UnionEncoding, describe_attrs, predicted_ms, schedule_key


class Measurer:
    """Runs trials and baselines on the pool's ranks (max over ranks)."""

    def __init__(self, pool: Pool, reps: int, seed: int, confirm_rounds: int = CONFIRM_ROUNDS) -> None:
        self.pool = pool
        self.reps = reps
        self.confirm_rounds = confirm_rounds
        self.seed = seed
        self.count = 0
        self._why: dict[str, str] = {}

    def unavailable(self, engine: str, task: Any) -> str:
        """Why these ranks cannot run ``engine`` ("" when they can): ``task`` (the engine's
        ``probe_task``, None: nothing to probe) run once on every rank."""
        if engine not in self._why:
            answers = self.pool.run(task) if task is not None else []
            self._why[engine] = next((a for a in answers if a), "")
        return self._why[engine]

    def trial(self, schedule: Schedule, shape: tuple[int, int, int]) -> dict[str, Any]:
        m, n, k = shape
        per_rank = self.pool.run(OverlapTrialTask(schedule, m, n, k, seed=self.seed, reps=self.reps))
        self.count += 1
        ok = all(r["ok"] for r in per_rank)
        timing = Timing.max_over([r["timing"] for r in per_rank]) if ok else None
        return dict(
            ok=ok,
            rel_err=max(r["rel_err"] for r in per_rank),
            has_nan=any(r["has_nan"] for r in per_rank),
            timing=timing,
            note=next((r["note"] for r in per_rank if r.get("note")), ""),
        )

    def confirm(self, schedules: Sequence[Schedule], shape: tuple[int, int, int]) -> dict[str, Any]:
        m, n, k = shape
        per_rank = self.pool.run(
            ConfirmTask(tuple(schedules), m, n, k, seed=self.seed + 1, rounds=self.confirm_rounds)
        )
        timings = []
        for i in range(len(schedules)):
            ts = [r["timings"][i] for r in per_rank]
            timings.append(Timing.max_over(ts) if all(t is not None for t in ts) else None)
        fallbacks = [r.get("fallback") for r in per_rank]
        return dict(
            sequential=Timing.max_over([r["sequential"] for r in per_rank]),
            fallback=Timing.max_over(fallbacks) if all(t is not None for t in fallbacks) else None,
            timings=timings,
            rel_err=[max(r["rel_err"][i] for r in per_rank) for i in range(len(schedules))],
        )

    def baseline(self, collective: str, shape: tuple[int, int, int], dtype: str) -> dict[str, Any]:
        m, n, k = shape
        per_rank = self.pool.run(SequentialTask(collective, m, n, k, dtype, seed=self.seed, reps=self.reps))
        return dict(
            rel_err=max(r["rel_err"] for r in per_rank),
            has_nan=any(r["has_nan"] for r in per_rank),
            gemm=Timing.max_over([r["gemm"] for r in per_rank]),
            comm=Timing.max_over([r["comm"] for r in per_rank]),
            sequential=Timing.max_over([r["sequential"] for r in per_rank]),
        )


class Objective:
    """What one Optuna trial does (see the module docstring)."""

    def __init__(
        self,
        enc: UnionEncoding,
        model: CostModel | None,
        measurer: Measurer | None,
        value: str,  # "measured" or "predicted"
        on_trial: Callable[[str, bool], None],
    ) -> None:
        self.enc = enc
        self.model = model
        self.measurer = measurer
        self.value = value
        self.on_trial = on_trial
        self._cache: dict[str, Any] = {}
        self._best = math.inf

    def _cached(self, study: Any, key: str) -> Any:
        import optuna

        if key not in self._cache:
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
                other = t.user_attrs.get("key")
                if other is not None and other not in self._cache:
                    self._cache[other] = t
        return self._cache.get(key)

    def __call__(self, trial: Any) -> float:
        import optuna

        try:
            params = self.enc.suggest(trial)
            schedule = self.enc.build(params)
        except Infeasible as exc:
            trial.set_user_attr("note", f"infeasible: {exc}")
            self.on_trial("infeasible", self.value != "predicted")
            raise optuna.TrialPruned(str(exc)) from None
        for name, value in describe_attrs(schedule).items():
            trial.set_user_attr(name, value)
        predicted = predicted_ms(self.model, schedule)
        if not math.isnan(predicted):
            trial.set_user_attr("predicted_ms", predicted)
        hit = self._cached(trial.study, schedule_key(schedule))
        if hit is not None:
            trial.set_user_attr("cached_from", hit.number)
            for name in ("measured_ms", "spread_ms", "iqr_ms", "rel_err"):
                if name in hit.user_attrs:
                    trial.set_user_attr(name, hit.user_attrs[name])
            self.on_trial(f"#{trial.number} cached from #{hit.number}", self.value != "predicted")
            return float(hit.value)
        if self.value == "predicted":
            if math.isnan(predicted):
                trial.set_user_attr("note", "the model cannot price it")
                raise optuna.TrialPruned("the model cannot price it")
            best = self._best
            self._best = min(best, predicted)
            self.on_trial(f"#{trial.number} {predicted:.3f} ms predicted", predicted < best)  # log new bests
            return predicted
        return self._measure(trial, schedule)

    def _measure(self, trial: Any, schedule: Schedule) -> float:
        import optuna

        assert self.measurer is not None
        got = self.measurer.trial(schedule, self.enc.task.shape)
        trial.set_user_attr("rel_err", got["rel_err"])
        if not got["ok"]:
            note = got.get("note") or "numerical check failed: " + (
                "NaN" if got["has_nan"] else f"rel err {got['rel_err']:.2e}"
            )
            trial.set_user_attr("note", note)
            self.on_trial(f"#{trial.number} {note}", True)
            raise optuna.TrialPruned(note)
        timing: Timing = got["timing"]
        trial.set_user_attr("measured_ms", timing.median_ms)
        trial.set_user_attr("spread_ms", timing.spread_ms)
        trial.set_user_attr("iqr_ms", timing.iqr_ms)
        self.on_trial(f"#{trial.number} {timing.median_ms:.3f} ms", True)
        return timing.median_ms
