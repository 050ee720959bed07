"""How a shape's row is decided: its baseline (``measure_baseline``), the confirmation of a measured
search, the no-gain rule, and the table row of the verdict (``make_row``).

A measured search re-times its ``CONFIRM_TOP`` best distinct schedules, and the best schedule of
every other engine it timed, beside GEMM-then-collective and the runtime's ``overlap: false``
fallback (what the row runs if it does not overlap) in alternating rounds (``ConfirmTask``:
paired, samples of at least 16 ms on GPUs, as the bench takes them), and takes the fastest of
those. It becomes the row unless it beats the fallback (the baseline where the fallback was not
timed) by no more than ``max(MIN_GAIN x fallback, measured spread)``; then the row says
``overlap: false``. The spread is the larger interquartile range of the two timings' samples (max
- min is kept in the report but is set by single outliers). A predict search applies the same rule
to the predicted best and the predicted fallback, without a spread.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fo_kernels.errors import FoTuneError
from fo_kernels.schedule import Schedule
from fo_kernels.table.provenance import finite_only
from fo_tune.calibrate.extrapolate import basis_for
from fo_tune.search.results import BaselineResult, Candidate

if TYPE_CHECKING:
    from fo_tune.model import CostModel
    from fo_tune.ranks.timing import Timing
    from fo_tune.search.request import SearchRequest
    from fo_tune.search.trials import Measurer

# The no-gain fallback: overlap must beat the overlap: false fallback by at least this fraction.
MIN_GAIN = 0.02
# Measured searches re-time their best few distinct schedules beside GEMM-then-collective in
# alternating rounds before deciding the row: on H200 x2 the baseline drifted 2-4% between
# measurements minutes apart (docs/perf-notes.md), as much as the gains being decided on.
CONFIRM_TOP = 3


@dataclass(slots=True)
class Verdict:
    """The row's decision: whether it overlaps, which schedule, and the numbers behind it."""

    overlap: bool
    speedup: float
    decision: str
    chosen: Candidate | None  # the schedule the row runs (None: overlap: false)
    best: Candidate | None  # the fastest overlapped schedule, even when the row does not overlap
    best_ms: float
    numbers: dict[str, Any] = field(default_factory=dict)
    confirmed: list[dict[str, Any]] = field(default_factory=list)


def decide(
    best_ms: float, best_iqr: float, base_ms: float, base_iqr: float, base: str = "sequential"
) -> tuple[bool, float, str]:
    """(overlap?, speedup, decision text): overlap only when it gains more than
    ``max(MIN_GAIN x baseline, the larger interquartile range of the two timings)``; ``base``
    names the baseline in the text."""
    noise = [x for x in (base_iqr, best_iqr) if not math.isnan(x)]
    need = max(MIN_GAIN * base_ms, max(noise, default=0.0))
    gain = base_ms - best_ms
    if gain <= need:
        return (
            False,
            1.0,
            f"best {best_ms:.3f} ms vs {base} {base_ms:.3f} ms: gain {gain:.3f} ms <= "
            f"{need:.3f} ms (max of {MIN_GAIN:.0%} and the timings' interquartile range)",
        )
    return True, base_ms / best_ms, f"overlap {base_ms / best_ms:.3f}x over {base}"


def to_confirm(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The ``CONFIRM_TOP`` best candidates, and every other engine's best (best first)."""
    picks = list(candidates[:CONFIRM_TOP])
    engines = {c.schedule.engine for c in picks}
    for c in candidates[CONFIRM_TOP:]:
        if c.schedule.engine not in engines:
            engines.add(c.schedule.engine)
            picks.append(c)
    return picks


def confirm(
    candidates: Sequence[Candidate], shape: tuple[int, int, int], measurer: Measurer, note: Any
) -> Verdict:
    """Re-time ``to_confirm(candidates)`` beside the baselines and decide (module docstring)."""
    picks = to_confirm(candidates)
    engines = ", ".join(sorted({str(c.schedule.engine) for c in picks}))
    got = measurer.confirm([c.schedule for c in picks], shape)
    note(f"re-timed the best {len(picks)} ({engines}) beside the baseline")  # a step, once it is done
    seq: Timing = got["sequential"]
    confirmed = []
    for c, timing, err in zip(picks, got["timings"], got["rel_err"], strict=True):
        confirmed.append(
            dict(
                trial=c.trial,
                search_ms=c.value_ms,
                schedule=c.schedule.describe(),
                rel_err=err,
                confirmed_ms=timing.median_ms if timing else math.nan,
                iqr_ms=timing.iqr_ms if timing else math.nan,
            )
        )
    ok = [(row["confirmed_ms"], i) for i, row in enumerate(confirmed) if not math.isnan(row["confirmed_ms"])]
    if not ok:
        text = "no schedule passed its check when re-timed"
        return Verdict(False, 1.0, text, None, None, math.nan, confirmed=confirmed)
    i = min(ok)[1]
    timing = got["timings"][i]
    # the row is decided against what it runs otherwise: the runtime's overlap: false fallback
    # (graphed on GPUs: faster than the eager GEMM then collective where the host bounds a call,
    # docs/design.md#fallback), or sequential if it was not timed
    fallback: Timing | None = got.get("fallback")
    base, base_name = (fallback, "the overlap: false fallback") if fallback else (seq, "sequential")
    overlap, speedup, decision = decide(
        timing.median_ms, timing.iqr_ms, base.median_ms, base.iqr_ms, base_name
    )
    numbers: dict[str, Any] = {
        "measured_ms": timing.median_ms,
        "iqr_ms": timing.iqr_ms,
        "sequential_ms": seq.median_ms,
        "sequential_iqr_ms": seq.iqr_ms,
    }
    if fallback:
        numbers.update(fallback_ms=fallback.median_ms, fallback_iqr_ms=fallback.iqr_ms)
    pick = picks[i]
    if pick.trial is not None:
        numbers["search_ms"] = pick.value_ms
    best = Candidate(
        pick.schedule, timing.median_ms, pick.predicted_ms, timing.median_ms, timing.iqr_ms, pick.trial
    )
    return Verdict(
        overlap, speedup, decision, best if overlap else None, best, timing.median_ms, numbers, confirmed
    )


def decide_predicted(candidates: Sequence[Candidate], fallback_ms: float, sequential_ms: float) -> Verdict:
    """The predicted best against the predicted fallback (module docstring)."""
    if not candidates:
        return Verdict(False, 1.0, "no feasible schedule", None, None, math.nan)
    best = candidates[0]
    overlap, speedup, decision = decide(best.value_ms, 0.0, fallback_ms, 0.0, "the overlap: false fallback")
    numbers = {"predicted_ms": best.value_ms, "sequential_ms": sequential_ms, "fallback_ms": fallback_ms}
    return Verdict(overlap, speedup, decision, best if overlap else None, best, best.value_ms, numbers)


def row_numbers(verdict: Verdict, extra: dict[str, Any]) -> dict[str, Any]:
    """The provenance numbers of the row: the verdict's, its decision, and (overlap: false) the
    rejected schedule's latency under ``rejected_*`` (the row runs the fallback)."""
    numbers = {**extra, **verdict.numbers, "decision": verdict.decision}
    if verdict.overlap:
        numbers["speedup"] = verdict.speedup
    else:
        for key in ("measured_ms", "predicted_ms"):
            if key in numbers:
                numbers[f"rejected_{key}"] = numbers.pop(key)
    return numbers


def make_row(
    request: SearchRequest, shape: tuple[int, int, int], verdict: Verdict, numbers: dict[str, Any]
) -> Schedule:
    """The table row: the chosen schedule with its provenance, or ``overlap: false``."""
    m, n, k = shape
    prov: dict[str, Any] = {
        "source": "fo-tune search",
        "mode": request.mode,
        "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        **{key: round(v, 5) if isinstance(v, float) else v for key, v in finite_only(numbers).items()},
    }
    # a predicted row says what its model rests on where that is not this machine's measurements
    basis = request.calibration.basis if request.mode == "predict" and request.calibration else ""
    basis = basis_for(basis, request.collective)
    chosen = verdict.chosen
    if chosen is None:
        from fo_kernels.schedule import Problem

        return Schedule(
            collective=request.collective,
            dtype=request.dtype,
            world_size=request.world_size,
            problem=Problem(m=m, n=n, k=k),
            provenance=prov,
            basis=basis,
        )
    if chosen.trial is not None:
        prov["trial"] = chosen.trial
    if not math.isnan(chosen.predicted_ms) and request.mode != "predict":
        prov["predicted_ms"] = round(chosen.predicted_ms, 5)
    return dataclasses.replace(chosen.schedule, provenance=prov, basis=basis)


def measure_baseline(
    request: SearchRequest, shape: tuple[int, int, int], model: CostModel | None, measurer: Any
) -> BaselineResult:
    """cuBLAS then the collective: measured on the ranks, else predicted (with the fallback)."""
    m, n, k = shape
    pred = model.baseline(request.collective, m, n, k, request.dtype) if model is not None else None
    predicted = pred.sequential_ms if pred is not None else math.nan
    if measurer is None:
        assert pred is not None
        return BaselineResult(
            "predicted", pred.gemm_ms, pred.comm_ms, pred.sequential_ms, 0.0, 0.0, predicted, pred.fallback_ms
        )
    got = measurer.baseline(request.collective, shape, request.dtype)
    from fo_tune.ranks.gemm import GEMM_TOL

    if got["has_nan"] or not got["rel_err"] < GEMM_TOL[request.dtype]:
        raise FoTuneError(
            f"the sequential baseline of {m}x{n}x{k} failed its check (rel err {got['rel_err']:.2e}); "
            "the GPUs or the NCCL setup are broken"
        )
    seq = got["sequential"]
    return BaselineResult(
        "measured",
        got["gemm"].median_ms,
        got["comm"].median_ms,
        seq.median_ms,
        seq.spread_ms,
        seq.iqr_ms,
        predicted,
    )
