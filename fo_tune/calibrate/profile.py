"""``fo-tune profile`` as a library call: every tile config of a search space on one GEMM shape,
beside cuBLAS, and the confirmation of each reduced grid's best configs side by side
(``confirm_grids``: the fastest ``CONFIRM_CANDIDATES`` re-timed in ``CONFIRM_ROUNDS`` alternating
rounds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import (
    GemmPoint,
    GridBest,
    timing_name,
)
from fo_tune.ranks.gemm import GemmGridsTask, GemmProfileTask
from fo_tune.ranks.pool import Pool
from fo_tune.ranks.scaled import TUNE_SCALING
from fo_tune.ranks.timing import Timing


def profile_shape(
    pool: Pool,
    m: int,
    n: int,
    k: int,
    tiles: tuple[Tile, ...],
    frees: tuple[int, ...],
    dtype: str,
    *,
    graphs: bool = False,
    scaling: str = TUNE_SCALING,
) -> list[GemmPoint]:
    """Every tile x grid for one shape (max over ranks), with cuBLAS's time on each row: the
    cuBLAS samples timed in alternation with that row's config (``GemmProfileTask``), or cuBLAS
    timed alone where the config did not run. ``graphs``: every sample one CUDA graph replay of
    its calls (GPUs only; ``fo_tune.ranks.timing.time_interleaved``). ``scaling``: the fp8
    operands' scales, for the GEMM and ``torch._scaled_mm`` alike (``fo_tune.ranks.scaled.SCALINGS``;
    the default is the one calibrate tunes for)."""
    per_rank = pool.run(GemmProfileTask(m, n, k, tiles, frees, dtype, graphs=graphs, scaling=scaling))
    cublas_alone = Timing.max_over([r["cublas"] for r in per_rank]).median_ms
    points = []
    for i, row in enumerate(per_rank[0]["rows"]):
        rows = [r["rows"][i] for r in per_rank]
        ok = all(x["status"] == "ok" for x in rows)
        t = Timing.max_over([x["timing"] for x in rows]) if ok else None
        cublas = Timing.max_over([x["cublas"] for x in rows]).median_ms if ok else cublas_alone
        status = "ok" if ok else next(x["status"] for x in rows if x["status"] != "ok")
        tile: Tile = row["tile"]
        points.append(
            GemmPoint(
                m=m,
                n=n,
                k=k,
                tile=tile.label(),
                block_m=tile.block_m,
                block_n=tile.block_n,
                block_k=tile.block_k,
                group_m=tile.group_m,
                num_warps=tile.num_warps,
                num_stages=tile.num_stages,
                warp_specialize=tile.warp_specialize,
                pingpong=tile.pingpong,
                sms_free=row["sms_free"],
                grid=row["grid"],
                time_ms=t.median_ms if t else float("nan"),
                spread_ms=t.spread_ms if t else float("nan"),
                cublas_ms=cublas,
                rel_err=max(x["rel_err"] for x in rows),
                status=status,
            )
        )
    return points


# How many of each grid's fastest profiled configs ``confirm_grids`` times again side by side. The
# profile times each config beside cuBLAS alone, so its ranking moves with the card's drift between
# timings: a grid's profiled best has read up to 7% slower than the runner-up in a later side-by-side
# run (docs/perf-notes.md, "Each grid's best from its fastest three").
CONFIRM_CANDIDATES = 3
# Rounds of that run: its variants (CONFIRM_CANDIDATES a grid, four grids, cuBLAS) share each round.
CONFIRM_ROUNDS = 20


def confirm_grids(
    pool: Pool,
    points: Sequence[GemmPoint],
    dtype: str,
    *,
    graphs: bool = False,
    candidates: int = CONFIRM_CANDIDATES,
    scaling: str = TUNE_SCALING,
) -> list[GridBest]:
    """The fastest config of each grid in ``points`` (one shape's profile): each grid's
    ``candidates`` fastest measured configs and cuBLAS timed again in one interleaved run
    (``GemmGridsTask``; ``graphs`` and ``scaling`` as given to ``profile_shape`` for ``points``),
    and the fastest of them in that run kept, one row a grid by sms_free; [] unless the full grid
    (sms_free 0) and another grid both have one."""
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1, got {candidates}")
    measured: dict[int, list[GemmPoint]] = {}
    for p in points:
        if p.status == "ok" and not math.isnan(p.time_ms):
            measured.setdefault(p.sms_free, []).append(p)
    if 0 not in measured or len(measured) < 2:
        return []
    chosen = [p for r in sorted(measured) for p in sorted(measured[r], key=lambda p: p.time_ms)[:candidates]]
    m, n, k = chosen[0].m, chosen[0].n, chosen[0].k
    configs = tuple((p.tile_config(), p.sms_free) for p in chosen)
    task = GemmGridsTask(m, n, k, configs, dtype, reps=CONFIRM_ROUNDS, graphs=graphs, scaling=scaling)
    per_rank = pool.run(task)
    cublas = Timing.max_over([r["cublas"] for r in per_rank]).median_ms
    times = [
        Timing.max_over([r["rows"][i]["timing"] for r in per_rank]).median_ms for i in range(len(chosen))
    ]
    best: dict[int, int] = {}  # sms_free -> the index in chosen of its fastest in this run
    for i, p in enumerate(chosen):
        if p.sms_free not in best or times[i] < times[best[p.sms_free]]:
            best[p.sms_free] = i
    full = best[0]
    grid_of = [per_rank[0]["rows"][i]["grid"] for i in range(len(chosen))]
    rows = []
    for r in sorted(best):
        i = best[r]
        rows.append(
            GridBest(
                m=m,
                n=n,
                k=k,
                sms_free=r,
                grid=grid_of[i],
                tile=chosen[i].tile,
                time_ms=times[i],
                cublas_ms=cublas,
                over_share=times[i] / times[full] / (grid_of[full] / grid_of[i]),
                rel_err=max(rr["rows"][i]["rel_err"] for rr in per_rank),
                timing=timing_name(graphs),
                candidates=sum(p.sms_free == r for p in chosen),
            )
        )
    return rows
