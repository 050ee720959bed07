"""What a calibration measured, as functions the engines' terms call.

- ``TileProfile``: the signalled Triton GEMM alone per (shape, tile, grid): the measured point when
  the calibration profiled it, else the tile's wave model ``a + c * waves * K`` (least squares over
  every profiled point of that tile; ``waves = ceil(tiles / grid)``, a split last wave counted as
  its pieces' share), which fits the H200 profile within ~10%;
- ``Curves``: each collective alone on a buffer, interpolated on the bandwidth curve of its NCCL
  CTA cap (the latency floor below the smallest size, the latency/bandwidth fit beyond the largest),
  read as its running maximum over sizes: at the latency floor (below ~8 MB) the measured times dip
  by up to 3 us as the size grows (noise of a few percent), and a buffer priced faster than a
  smaller one would let a plan gain by moving more bytes;
- ``InterferenceTable``: the nearest calibrated (SMs left free, cap) pair's slowdowns (of the
  collective asked for; of every calibrated collective where it has none, which its ``matched``
  says: all_gather beside the GEMM was never measured on GPUs).

A collective without a curve is refused with what ``fo_tune.calibrate.missing.missing_curves``
says: the commands that measure it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fo_kernels.plan import TailPlan, cdiv, tail_plan
from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import (
    BandwidthPoint,
    Calibration,
    CalibrationError,
    GemmPoint,
    InterferencePoint,
)
from fo_tune.calibrate.missing import missing_curves
from fo_tune.model.types import Interference


@dataclass(frozen=True, slots=True)
class _WaveFit:
    a_ms: float  # fixed cost
    c_ms: float  # per wave per unit of K


# A wave of the split tail's pieces (``fo_kernels.plan.tail_split``) takes this share of a whole
# tile's wave, by pieces a tile: halves 0.53-0.58, quarters 0.36-0.38 on one H200
# (docs/perf-notes.md, "The split tail").
SPLIT_WAVE_SHARE = {2: 0.56, 4: 0.37}
# The stream-K tail (``fo_kernels.plan.stream_k_split``) takes its programs' share of K blocks plus
# this many blocks' time: 23-37 blocks measured where its rule shares out the tail (1024 tiles on 120
# programs at 224 and 231 K blocks, 3000x5120x6912 on 116), ~20 us at 0.64 us a block in a
# per-program timeline at 3000x5120x6912 (docs/perf-notes.md, "Where the stream-K tail's time goes").
STREAM_K_OVERHEAD_BLOCKS = 32


def waves(m: int, n: int, k: int, tile: Tile, grid: int, split: bool = True) -> float:
    """Waves of ``grid`` programs over the (m, n) output's tiles. ``split``: the GEMM is
    ``signalled_gemm`` (the profiled kernel), whose last, partial wave, where it splits it into
    pieces, counts as its pieces' share of a wave; ``rows_gemm`` (the copy engine's tiled mode and
    all_gather's chunks) never splits."""
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    whole, tail = divmod(tiles, max(1, grid))
    if tail == 0 or not split:
        return whole + (tail > 0)
    tail_run = tail_plan(tiles, max(1, grid), tile, k, m * n * k)
    return whole + last_wave_share(tail_run, cdiv(k, tile.block_k))


def last_wave_share(tail: TailPlan, k_tiles: int) -> float:
    """The last, partial wave of ``signalled_gemm`` as a share of a whole wave's time, as the kernel
    runs it by default (``tail``: ``fo_kernels.plan.tail_plan``'s choice; ``k_tiles``: K blocks of
    a tile): its pieces' share where it splits the wave, its programs' share of K blocks plus
    ``STREAM_K_OVERHEAD_BLOCKS`` where stream-K shares it out, a part's K blocks where the
    ping-pong kernel's K-split tail runs it (first: the rest of its cost runs beside the
    program's first whole tile), else 1 (a whole wave, or none)."""
    if tail.split != (1, 1):
        return SPLIT_WAVE_SHARE[tail.split[0] * tail.split[1]]
    if tail.parts:
        return cdiv(k_tiles, tail.parts) / k_tiles
    if tail.share:
        return min(1.0, (tail.share + STREAM_K_OVERHEAD_BLOCKS) / k_tiles)
    return 1.0


def _fit_waves(points: Sequence[GemmPoint]) -> _WaveFit:
    xs = [waves(p.m, p.n, p.k, p.tile_config(), p.grid) * p.k for p in points]
    ys = [p.time_ms for p in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else my / mx
    if c <= 0:  # one shape only, or noise: proportional through the origin
        c, a = my / mx, 0.0
    else:
        a = max(0.0, my - c * mx)
    return _WaveFit(a, c)


class TileProfile:
    """The calibration's Triton GEMM profile (see the module docstring)."""

    def __init__(self, cal: Calibration) -> None:
        self._points: dict[tuple, GemmPoint] = {}  # (m, n, k, tile, grid); a Tile is its own key
        by_tile: dict[Tile, list[GemmPoint]] = {}
        self.cublas: dict[tuple[int, int, int], float] = {}
        for p in cal.gemm:
            if p.status != "ok" or not p.time_ms > 0:
                continue
            key = p.tile_config()
            self._points[(p.m, p.n, p.k, key, p.grid)] = p
            by_tile.setdefault(key, []).append(p)
            if p.cublas_ms > 0:
                self.cublas[(p.m, p.n, p.k)] = p.cublas_ms
        self._fits = {key: _fit_waves(pts) for key, pts in by_tile.items()}

    def tiles(self) -> list[Tile]:
        """Tile configs the calibration profiled (the only ones the model can predict)."""
        return list(self._fits)

    def knows(self, tile: Tile) -> bool:
        return tile in self._fits

    def time(self, tile: Tile, m: int, n: int, k: int, grid: int, split: bool = True) -> tuple[float, str]:
        """(ms, source) of the signalled GEMM alone on ``grid`` programs (``split``: as ``waves``)."""
        if tile not in self._fits:
            raise CalibrationError(
                f"the calibration has no GEMM profile for tile {tile.label()}; profile it with "
                "`fo-tune calibrate` (or `fo-tune profile`), or search in --mode measure"
            )
        point = self._points.get((m, n, k, tile, grid))
        if point is not None:
            return point.time_ms, "measured"
        return self.wave_model_time(tile, m, n, k, grid, split), "wave-model"

    def scaled_time(
        self, tile: Tile, m: int, n: int, k: int, grid: int, split: bool = True
    ) -> tuple[float, str]:
        """(ms, source): the measured point, else the profiled point of this tile (on this grid
        when profiled there) nearest in waves x K, scaled by waves x K. For GEMMs of a wave or two
        (the copy engine's tiled phases) this follows the profile where the wave model's fixed
        cost, fitted over 2-32 waves, overshoots. ``split``: as ``waves`` (the profiled points are
        the signalled GEMM's)."""
        point = self._points.get((m, n, k, tile, grid))
        if point is not None:
            return point.time_ms, "measured"
        if tile not in self._fits:
            return self.time(tile, m, n, k, grid)  # raises the CalibrationError
        work = waves(m, n, k, tile, grid, split) * k
        pts = [p for key, p in self._points.items() if key[3] == tile]
        same_grid = [p for p in pts if p.grid == grid] or pts
        ref = min(same_grid, key=lambda p: abs(math.log(waves(p.m, p.n, p.k, tile, p.grid) * p.k / work)))
        return ref.time_ms * work / (waves(ref.m, ref.n, ref.k, tile, ref.grid) * ref.k), "scaled profile"

    def wave_model_time(self, tile: Tile, m: int, n: int, k: int, grid: int, split: bool = True) -> float:
        """The tile's fitted ``a + c * waves * K`` (ms), ignoring any profiled point (``split``: as
        ``waves``)."""
        fit = self._fits[tile]
        return fit.a_ms + fit.c_ms * waves(m, n, k, tile, grid, split) * k

    def wave_floor(self, tile: Tile) -> float:
        """The least ``time / wave_model_time`` over the tile's profiled points, at most 1: ``time``
        of any shape is at least this times its wave model (a lower bound's factor)."""
        fit = self._fits[tile]
        ratios = [
            p.time_ms / (fit.a_ms + fit.c_ms * waves(p.m, p.n, p.k, tile, p.grid) * p.k)
            for key, p in self._points.items()
            if key[3] == tile
        ]
        return min([1.0, *(r for r in ratios if r > 0)])


class Curves:
    """The calibration's collective bandwidth curves (see the module docstring)."""

    def __init__(self, cal: Calibration) -> None:
        self.cal = cal
        self._curves: dict[tuple[str, int], list[BandwidthPoint]] = {}
        for b in cal.bandwidth:
            self._curves.setdefault((b.collective, b.nccl_max_ctas), []).append(b)
        # per curve, its sizes and each point's time raised to the largest of the smaller sizes'
        # (see above), read by every ``time``
        self._sizes: dict[tuple[str, int], list[int]] = {}
        self._times: dict[tuple[str, int], list[float]] = {}
        for key, pts in self._curves.items():
            pts.sort(key=lambda b: b.size_bytes)
            self._sizes[key] = [p.size_bytes for p in pts]
            self._times[key] = list(itertools.accumulate((p.time_ms for p in pts), max))

    def knows(self, collective: str) -> bool:
        """The calibration has a bandwidth curve for ``collective``."""
        return any(name == collective for name, _ in self._curves)

    def _curve(self, collective: str, cap: int) -> tuple[str, int]:
        caps = sorted(c for (name, c) in self._curves if name == collective)
        if not caps:
            raise CalibrationError(missing_curves(self.cal, [collective]))
        use = cap if cap in caps else min(caps, key=lambda c: (abs(c - cap), c))
        return (collective, use)

    def time(self, collective: str, cap: int, nbytes: int) -> float:
        """The collective alone on ``nbytes`` (nccl-tests sizing), interpolated on the curve's
        running maximum; never less for more bytes."""
        key = self._curve(collective, cap)
        pts, sizes, times = self._curves[key], self._sizes[key], self._times[key]
        if nbytes <= sizes[0]:
            return times[0]
        i = bisect.bisect_left(sizes, nbytes)
        if i < len(pts):
            lo, hi = pts[i - 1], pts[i]
            frac = (nbytes - lo.size_bytes) / (hi.size_bytes - lo.size_bytes)
            return times[i - 1] + frac * (times[i] - times[i - 1])
        return times[-1] + (nbytes - pts[-1].size_bytes) / (self._tail_gbs(collective, pts[-1]) * 1e6)

    def _tail_gbs(self, collective: str, last: BandwidthPoint) -> float:
        """The bandwidth a curve runs on past its largest point ``last``: its fit's, else that
        point's own."""
        fit = self.cal.fit_for(collective, last.nccl_max_ctas)
        return fit.bandwidth_gbs if fit is not None and fit.bandwidth_gbs > 0 else last.algbw_gbs

    def times(self, collective: str, cap: int, nbytes: Any) -> Any:
        """``time`` of every element of the integer array ``nbytes`` (a numpy array of the same
        shape): the same arithmetic element by element, so the same floats, for the grouping DP's
        every (cut, cut) pair at once."""
        import numpy as np

        key = self._curve(collective, cap)
        pts, sizes, times = self._curves[key], self._sizes[key], self._times[key]
        nbytes = np.asarray(nbytes, dtype=np.int64)
        out = np.full(nbytes.shape, times[0], dtype=np.float64)
        size = np.asarray(sizes, dtype=np.int64)
        at = np.searchsorted(size, nbytes, side="left")
        inside = (nbytes > sizes[0]) & (at < len(pts))
        if inside.any():
            i = at[inside]
            t = np.asarray(times, dtype=np.float64)
            frac = (nbytes[inside] - size[i - 1]) / (size[i] - size[i - 1])
            out[inside] = t[i - 1] + frac * (t[i] - t[i - 1])
        beyond = (nbytes > sizes[0]) & (at >= len(pts))
        if beyond.any():
            last = pts[-1]
            out[beyond] = times[-1] + (nbytes[beyond] - last.size_bytes) / (
                self._tail_gbs(collective, last) * 1e6
            )
        return out


class InterferenceTable:
    """The calibration's interference points (see the module docstring)."""

    def __init__(self, cal: Calibration) -> None:
        self._points: dict[str, list[InterferencePoint]] = {}
        for q in cal.interference:
            self._points.setdefault(q.collective, []).append(q)
        # each (collective, sms_free, cap) looked up once: a predict search asks for the same few
        # thousands of times, and a lookup scans every point
        self._found: dict[tuple[str, int, int], Interference] = {}

    def lookup(self, collective: str, sms_free: int, cap: int) -> Interference:
        """Nearest calibrated (sms_free - cap, cap); cap 0 (NCCL's default) counts as the largest
        calibrated cap. No interference data at all: the two never ran together (CPU calibration)."""
        key = (collective, sms_free, cap)
        if key not in self._found:
            self._found[key] = self._lookup(collective, sms_free, cap)
        return self._found[key]

    def _lookup(self, collective: str, sms_free: int, cap: int) -> Interference:
        pts = self._points.get(collective)
        of = ""
        if not pts:  # (all_gather beside the GEMM: never measured on GPUs)
            pts = [q for qs in self._points.values() for q in qs]
            of = f" of {'/'.join(sorted(self._points))} ({collective} not calibrated)"
        if not pts:
            return Interference(False, 1.0, 1.0, "none calibrated")
        caps = sorted({q.nccl_max_ctas for q in pts})
        eff = cap if cap > 0 else caps[-1]
        exact = [q for q in pts if (q.sms_free, q.nccl_max_ctas) == (sms_free, eff)]
        if exact:
            chosen, matched = exact, "exact"
        else:

            def dist(q: InterferencePoint) -> tuple[float, float]:
                return (abs((q.sms_free - q.nccl_max_ctas) - (sms_free - eff)), abs(q.nccl_max_ctas - eff))

            best = min(dist(q) for q in pts)
            chosen = [q for q in pts if dist(q) == best]
            matched = f"nearest r={chosen[0].sms_free} cap={chosen[0].nccl_max_ctas}"
        matched += of
        concurrent = all(q.concurrent for q in chosen) and 2 * sum(q.comm_during_gemm for q in chosen) > len(
            chosen
        )
        during = [q for q in chosen if q.comm_during_gemm] or chosen
        comm = sum(max(1.0, q.comm_slowdown) for q in during) / len(during)
        gemm = sum(max(1.0, q.gemm_slowdown) for q in during) / len(during)
        return Interference(concurrent, comm, gemm, matched)
