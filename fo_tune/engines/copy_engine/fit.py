"""Fitting the copy engine's free parameters to measured table rows, and the measured ones to probes.

The shipped calibration's ``copy_engine`` section was made with these functions (each value keeps
its source); ``fo-tune calibrate`` measures what a GPU can measure and replaces those values.

- ``fit_lines``: least squares of ``time = latency + bytes / bandwidth`` over copy timings;
- ``fit_library``: least squares of the library wave model through measured cuBLAS times;
- ``fit_free``: coordinate descent of named parameters over a grid within bounds, minimising
  the mean absolute percentage error of the model over measured rows (``fo_tune.model.check``),
  with every other parameter fixed;
- ``fit_calibration``: what ``fo-tune model fit`` runs: the copy engine's free parameters to
  measured table rows, the Triton term's host times to measured search trials, each keeping the
  rows it is told to hold out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fo_tune.calibrate.calibration import Calibration, EngineCalibration, Quantity
from fo_tune.engines import cost_models_by_dtype, get_tuner
from fo_tune.model.check import Checked, CheckError, Measured, mape
from fo_tune.model.core import CostModel
from fo_tune.model.library import large_tile_waves

# Parameters fit_free may move, and the range it searches each in.
FREE_BOUNDS = {
    "clock_context": (0.0, 1.0),
    "chunk_overhead_ms": (0.0, 0.02),
    "call_overhead_ms": (0.0, 0.04),
    "gather_exposed": (0.0, 1.0),
    "tiled_gemm_factor": (0.6, 1.2),
    "library_small_tile_efficiency": (0.5, 1.0),
    "library_beta1_factor": (1.0, 1.1),
    "library_latency_ms": (0.0, 0.02),
    "host_launch_ms": (0.0, 1.0),
    "host_per_group_ms": (0.0, 0.2),
}
# Grid points per parameter per sweep, and sweeps (each sweep narrows every range around its best).
GRID = 21
SWEEPS = 4


def fit_lines(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency_ms, bandwidth_gbs) of ``time_ms = latency + bytes / bandwidth`` (least squares over
    (bytes, time_ms) points)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return max(0.0, my - slope * mx), 1e-6 / slope


def fit_library(cublas: Mapping[tuple[int, int, int], float], sm_count: int) -> tuple[float, float]:
    """(library_latency_ms, library_wave_ms) through measured whole-GEMM cuBLAS times (128x256
    tiles, whole waves; least squares)."""
    pts = [(large_tile_waves(m, n, k, sm_count), t) for (m, n, k), t in cublas.items()]
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    wave = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else my / mx
    return max(0.0, my - wave * mx), wave


def fit_free(
    evaluate: Callable[[Mapping[str, float]], Sequence[Checked]],
    start: Mapping[str, float],
    free: Sequence[str],
) -> tuple[dict[str, float], float]:
    """(parameters, MAPE): ``free`` parameters of ``start`` moved one at a time over a grid in
    ``FREE_BOUNDS`` to the value with the lowest MAPE of ``evaluate(parameters)``."""
    params = dict(start)
    bounds = {name: FREE_BOUNDS[name] for name in free}
    best = mape(evaluate(params))[0]
    for _ in range(SWEEPS):
        for name in free:
            lo, hi = bounds[name]
            for i in range(GRID):
                value = lo + (hi - lo) * i / (GRID - 1)
                trial = {**params, name: value}
                err = mape(evaluate(trial))[0]
                if math.isfinite(err) and err < best - 1e-12:
                    best, params = err, trial
            span = (hi - lo) / 4
            lo0, hi0 = FREE_BOUNDS[name]
            bounds[name] = (max(lo0, params[name] - span), min(hi0, params[name] + span))
    return params, best


# The copy engine's parameters fit_calibration fits to table rows, and the Triton term's host times
# it fits to search trials (the rest are measured: fo-tune calibrate, or the probes named in their
# sources).
COPY_ENGINE_FREE = (
    "clock_context",
    "chunk_overhead_ms",
    "call_overhead_ms",
    "gather_exposed",
    "tiled_gemm_factor",
    "library_small_tile_efficiency",
    "library_beta1_factor",
)
TRITON_FREE = ("host_launch_ms", "host_per_group_ms")


@dataclass(frozen=True, slots=True)
class FitReport:
    """What ``fit_calibration`` did: per term the fitted values and the errors on the rows used
    and on the rows held out."""

    term: str
    values: dict[str, float]
    fit: list[Checked]
    held_out: list[Checked]


def _apply(models: Mapping[str, CostModel], term: str, params: Mapping[str, float]) -> None:
    for model in models.values():
        for name, value in params.items():
            if term == "copy_engine":
                if name in model.library.p:
                    model.library.p[name] = value
                model.term("copy_engine").p[name] = value
            else:
                model.term("triton").host[name] = value


def _fits_copy_engine(cal: Calibration, group: Sequence[Measured]) -> bool:
    """Whether ``fit_calibration`` fits the copy engine's parameters to ``group`` (its copy-engine
    and ``overlap: false`` rows): not without a copy_engine section, nor when the section cannot
    build the copy engine's term (a CPU calibration: no peers to measure) and no row of ``group``
    ran the copy engine, as the ``overlap: false`` rows are priced without it; a copy-engine row
    there is priced, and refused with what to measure."""
    if cal.copy_engine is None:
        return False
    gap = get_tuner("copy_engine").calibration_gap(cal, "all_reduce")
    return not gap or any(m.schedule.engine == "copy_engine" for m in group)


def fit_calibration(
    cal: Calibration,
    *,
    files: Sequence[Path],
    held_out: Callable[[Checked], bool],
    held_out_text: str = "",
) -> list[FitReport]:
    """Fit ``COPY_ENGINE_FREE`` to the measured copy-engine and ``overlap: false`` rows and trials
    of ``files`` and ``TRITON_FREE`` to their measured Triton ones, leaving out of each fit what
    ``held_out`` says (``held_out_text`` describes it in the sources); write the values into
    ``cal`` with their sources and return the reports. A term whose every row and trial is held
    out raises ``CheckError``: its parameters would be fitted to nothing."""
    from fo_tune.model.check import measured_in

    items = measured_in(files)
    # one model per operand dtype, sharing the parameters fitted here
    models = cost_models_by_dtype(cal, (m.schedule.dtype for m in items))

    def checked(m: Measured) -> Checked:
        return m.checked(models[m.schedule.dtype])

    out = []
    groups = (
        ("copy_engine", COPY_ENGINE_FREE, [m for m in items if m.schedule.engine != "triton"]),
        ("triton", TRITON_FREE, [m for m in items if m.schedule.engine == "triton"]),
    )
    for term, free, group in groups:
        if not group or (term == "copy_engine" and not _fits_copy_engine(cal, group)):
            continue
        train = [m for m in group if not held_out(checked(m))]
        if not train:
            raise CheckError(
                f"model fit: every one of the {len(group)} measured {term} rows and trials is held "
                f"out ({held_out_text or 'all of them'}); hold out fewer, or give more files"
            )

        def evaluate(params: Mapping[str, float], term: str = term, train: list = train) -> list[Checked]:
            _apply(models, term, params)
            return [checked(m) for m in train]

        any_model = next(iter(models.values()))
        start = cal.copy_engine.values() if term == "copy_engine" else dict(any_model.term("triton").host)
        values, _ = fit_free(evaluate, start, free)
        _apply(models, term, values)
        rows = [checked(m) for m in group]
        use = [c for c in rows if not held_out(c)]
        names = ", ".join(dict.fromkeys(c.source for c in use))
        held = f"{len(rows) - len(use)} held out" + (f": {held_out_text}" if held_out_text else "")
        source = f"fitted to {len(use)} measured rows and trials of {names} (fo-tune model fit; {held})"
        section = cal.copy_engine if term == "copy_engine" else (cal.triton or EngineCalibration())
        for name, value in values.items():
            if name in free:
                section.params[name] = Quantity(value=round(value, 6), source=source)
            elif term == "triton" and name not in section.params:
                section.params[name] = Quantity(
                    value=value,
                    source="measured on H200 x2 (model.triton.DEFAULT_HOST, docs/design.md#cost-model)",
                )
        if term == "triton":
            cal.triton = section
        out.append(FitReport(term, {n: values[n] for n in free}, use, [c for c in rows if held_out(c)]))
    return out
