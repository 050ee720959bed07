"""The library GEMM (cuBLAS) of one (rows, N, K) product, and the clock it runs at.

The copy engine's chunk GEMMs and the ``overlap: false`` baseline run cuBLAS. Its time is a wave
model over the library's tile choices (Hopper cuBLAS: 128x256 tiles on large outputs, smaller
tiles where an output has too few of those to fill the SMs)::

    waves(tile)  = ceil(tiles(rows, N) / SMs)          one kernel on its own stream
                 = tiles(rows, N) / SMs                chunks alternating on two streams: the next
                                                       chunk's tiles fill a partial last wave
    t_paced      = library_latency_ms + min over tiles of
                   library_wave_ms * (area / 128x256) / efficiency(tile) * waves(tile) * K / 1024
    t(beta = 1)  = t(beta = 0) * library_beta1_factor  (the epilogue also reads C)
    t            = t_paced * (1 + clock_context * (clock_sustained_factor - 1))

``clock_sustained_factor`` is a GEMM run back to back over the same GEMM with pauses (the card's
power limit lowers the SM clock, docs/design.md, "Power limit"); ``clock_context`` is how much
of that slowdown the measurement that decides a row sees (its 16 ms samples of back-to-back calls
alternate with other variants). A measured point of the calibration (``copy_engine.library_gemm``:
its paced and sustained times) replaces the wave model for its exact shape; for chunks whose
partial last wave the next chunk fills, only where asked (``measured_fill``: the copy engine at
N > 2 peers), scaled by the wave model's filled over whole waves. A point a sibling GPU measured
(``measured_on``: the N-peer chunk GEMMs of ``fo-tune calibrate --only copy_engine_n
--into-sibling``) serves only there: the baseline GEMM and every GEMM at N = 2 keep the wave model
of the calibration's own GPU (the sibling's times lack its memory and power edge, and one such
point, 256x8192x1024 on the packaged H100 profile, reads 15x its neighbours').

Without a copy-engine section the model is fitted through the cuBLAS times of the calibration's
tile profile (every profiled shape's ``cublas_ms``), at clock factor 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fo_kernels.plan import cdiv

# The library's tile candidates (block_m, block_n, efficiency parameter or None for 1.0): the
# 128x256 tile of Hopper cuBLAS's large-GEMM kernels and the 128x128 one it takes for outputs
# with fewer 128x256 tiles than SMs (the wave model picks the faster, as cuBLAS's heuristic does).
LIBRARY_TILES = ((128, 256, None), (128, 128, "library_small_tile_efficiency"))
# The wave model's unit of K (library_wave_ms is per wave per this many K).
K_UNIT = 1024
# The tile area library_wave_ms is per (LIBRARY_TILES' 128x256): another tile's wave costs its share.
REFERENCE_AREA = 128 * 256
# The parameters the library model reads, and what they are.
PARAMS = {
    "library_latency_ms": "cuBLAS launch and ramp per GEMM (ms)",
    "library_wave_ms": "one wave of 128x256 tiles on every SM per 1024 of K, at the paced clock (ms)",
    "library_small_tile_efficiency": "throughput of a 128x128 tile relative to a 128x256 one",
    "library_beta1_factor": "a beta = 1 GEMM (C read and added) over the same GEMM with beta = 0",
    "clock_sustained_factor": "a GEMM run back to back over the same GEMM with pauses",
    "clock_context": "the fraction of that slowdown the deciding measurements see",
}


def large_tile_waves(m: int, n: int, k: int, sm_count: int) -> float:
    """Whole waves of the large library tile (``LIBRARY_TILES[0]``, 128x256) on ``sm_count`` SMs,
    times K in ``K_UNIT``s: the x against which a fit to whole-GEMM cuBLAS times reads
    ``library_wave_ms``."""
    bm, bn, _ = LIBRARY_TILES[0]
    return cdiv(cdiv(m, bm) * cdiv(n, bn), sm_count) * k / K_UNIT


@dataclass(frozen=True, slots=True)
class LibraryPoint:
    """A measured library GEMM: paced (with pauses) and sustained (back to back) times."""

    paced_ms: float
    sustained_ms: float


class LibraryGemm:
    """cuBLAS time per (rows, N, K, beta) on ``sm_count`` SMs (see the module docstring)."""

    def __init__(
        self,
        params: Mapping[str, float],
        sm_count: int,
        points: Mapping[tuple[int, int, int, int], LibraryPoint] | None = None,
        sibling: frozenset[tuple[int, int, int, int]] = frozenset(),
    ) -> None:
        self.p = dict(params)
        self.sm_count = sm_count
        self.points = dict(points or {})
        self.sibling = sibling  # keys of ``points`` a sibling GPU measured (see the module docstring)

    @classmethod
    def from_cublas(cls, cublas: Mapping[tuple[int, int, int], float], sm_count: int) -> LibraryGemm:
        """The model through measured whole-GEMM cuBLAS times (least squares through the origin
        of time against waves * K), clock factor 1: what a calibration without a copy-engine
        section offers the baseline."""
        xs, ys = [], []
        for (m, n, k), t in cublas.items():
            xs.append(large_tile_waves(m, n, k, sm_count))
            ys.append(t)
        wave = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs) if xs else math.nan
        params = {
            "library_latency_ms": 0.0,
            "library_wave_ms": wave,
            "library_small_tile_efficiency": 1.0,
            "library_beta1_factor": 1.0,
            "clock_sustained_factor": 1.0,
            "clock_context": 0.0,
        }
        return cls(params, sm_count, {(m, n, k, 0): LibraryPoint(t, t) for (m, n, k), t in cublas.items()})

    @property
    def clock(self) -> float:
        """The factor on paced times in the deciding measurements' context."""
        return 1.0 + self.p["clock_context"] * (self.p["clock_sustained_factor"] - 1.0)

    def paced_ms(self, rows: int, n: int, k: int, *, beta: int = 0, fill: bool = False) -> float:
        """The wave model at the paced clock (``fill``: a partial last wave is filled by the next
        chunk's tiles, two streams)."""
        if rows <= 0:
            return 0.0
        best = math.inf
        for bm, bn, eff_key in LIBRARY_TILES:
            eff = self.p[eff_key] if eff_key else 1.0
            tiles = cdiv(rows, bm) * cdiv(n, bn)
            w = tiles / self.sm_count if fill else cdiv(tiles, self.sm_count)
            cost = self.p["library_wave_ms"] * (bm * bn / REFERENCE_AREA) / eff * w * k / K_UNIT
            best = min(best, cost)
        t = self.p["library_latency_ms"] + best
        return t * (self.p["library_beta1_factor"] if beta else 1.0)

    def time(
        self,
        rows: int,
        n: int,
        k: int,
        *,
        beta: int = 0,
        fill: bool = False,
        measured_fill: bool = False,
        sibling: bool = False,
    ) -> float:
        """The GEMM as the deciding measurements run it: a measured point's sustained-context time
        for this exact (rows, N, K, beta), else the wave model at the context clock. With ``fill``
        the wave model's, unless ``measured_fill``: then the measured point scaled by the wave
        model's filled over whole waves (the copy engine at N > 2 peers). A sibling's point is read
        only with ``measured_fill`` or ``sibling`` (the MoE model's weight read rate, which names
        the sibling in its basis)."""
        key = (rows, n, k, beta)
        point = self.points.get(key)
        if point is not None and key in self.sibling and not (measured_fill or sibling):
            point = None
        if point is not None and (not fill or measured_fill):
            p = self.p
            t = point.paced_ms + p["clock_context"] * (point.sustained_ms - point.paced_ms)
            if fill:
                whole = self.paced_ms(rows, n, k, beta=beta)
                t *= self.paced_ms(rows, n, k, beta=beta, fill=True) / whole if whole > 0 else 1.0
            return t
        return self.paced_ms(rows, n, k, beta=beta, fill=fill) * self.clock
