"""Fitting the copy engine's free parameters to measured table rows, and the measured ones to probes.

The shipped calibration's ``copy_engine`` section was made with these functions (each value keeps
its source); ``fo-tune calibrate`` measures what a GPU can measure and replaces those values.

- ``fit_lines``: least squares of ``time = latency + bytes / bandwidth`` over copy timings;
- ``fit_library``: least squares of the library wave model through measured cuBLAS times;
- ``fit_free``: coordinate descent of named parameters over a grid within bounds, minimising
  the mean absolute percentage error of the model over measured rows (``fo_tune.model.check``),
  with every other parameter fixed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from fo_kernels.plan import cdiv

from .check import Checked, mape
from .library import K_UNIT

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
    pts = [
        (cdiv(cdiv(m, 128) * cdiv(n, 256), sm_count) * k / K_UNIT, t) for (m, n, k), t in cublas.items()
    ]
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
