"""The bench's results: ranks merged into one row per variant, the derived rows and the ratios.

per variant: the worst status of any rank, the largest error, the slowest rank's median
chunked = the best chunk count; ideal = max(gemm, collective) (not run); one fused torch op per
case (async_tp beside reduce_scatter and, as a SKIP row, all_reduce; torch_fused beside all_gather)
speedup_vs_sequential = sequential / variant, fraction_of_ideal = ideal / variant
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fo_kernels.fingerprint import Fingerprint
from fo_tune.ranks.gemm import worst_error
from fo_tune.ranks.timing import Timing

BENCH_SCHEMA_VERSION = 1
BENCH_KIND = "fo-tune-bench"
# The variants, in row order; chunked_c<C> rows follow "chunked". A case has one of the fused torch
# ops, its collective's (FUSED_VARIANT): async_tp (fused matmul + reduce-scatter) or torch_fused
# (fused all-gather + matmul); all_reduce has none, and keeps an async_tp SKIP row.
VARIANTS = ("gemm", "collective", "sequential", "chunked", "async_tp", "torch_fused", "fo_tune", "ideal")
FUSED_VARIANT = {"all_reduce": "async_tp", "reduce_scatter": "async_tp", "all_gather": "torch_fused"}
# Rows derived from others, not run themselves: the best chunk count, and max(gemm, collective).
DERIVED = ("chunked", "ideal")
# Row statuses: checked and timed, wrong (never timed), not applicable, cannot run here.
STATUSES = ("PASS", "FAIL", "SKIP", "UNAVAILABLE")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRow:
    """One variant of one (shape, collective), merged over ranks (times: the slowest rank's median)."""

    device_key: str
    world_size: int
    dtype: str
    m: int
    n: int
    k: int
    collective: str
    variant: str
    detail: str
    status: str  # PASS, FAIL, SKIP or UNAVAILABLE
    rel_err: float  # the largest of any rank; NaN when not checked
    median_ms: float
    spread_ms: float
    speedup_vs_sequential: float  # sequential_ms / median_ms
    fraction_of_ideal: float  # ideal_ms / median_ms
    schedule_source: str  # fo_tune rows: "table", or "no table row" (overlap: false)

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


BENCH_COLUMNS = tuple(f.name for f in fields(BenchRow))


@dataclass(kw_only=True)
class BenchResult:
    """Everything one ``fo-tune bench`` run measured, with where and how."""

    fingerprint: Fingerprint
    backend: str
    settings: dict[str, Any]
    rows: list[BenchRow] = field(default_factory=list)
    created: str = ""
    wall_s: float = 0.0

    @property
    def checked(self) -> list[BenchRow]:
        """Rows of variants that ran and were checked (PASS or FAIL), derived rows left out."""
        return [r for r in self.rows if r.variant not in DERIVED and r.status in ("PASS", "FAIL")]

    @property
    def failed(self) -> list[BenchRow]:
        return [r for r in self.checked if r.status == "FAIL"]

    def to_dict(self) -> dict[str, Any]:
        return dict(
            schema_version=BENCH_SCHEMA_VERSION,
            kind=BENCH_KIND,
            created=self.created,
            wall_s=round(self.wall_s, 3),
            backend=self.backend,
            settings=self.settings,
            fingerprint=self.fingerprint.to_dict(),
            rows=[asdict(r) for r in self.rows],
        )


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's entries of every rank: the worst status, the largest error, the slowest time."""
    statuses = {e["status"] for e in per_rank}
    status = next(s for s in ("FAIL", "UNAVAILABLE", "SKIP", "PASS") if s in statuses)
    errs = [e["rel_err"] for e in per_rank]
    err = worst_error(errs)
    timings = [e["timing"] for e in per_rank]
    t = Timing.max_over(timings) if status == "PASS" and all(timings) else None
    first = next((e for e in per_rank if e["status"] == status), per_rank[0])
    detail = first["detail"]
    replayed = [e["replayed"] for e in per_rank if "replayed" in e]
    if replayed:  # the rank that replayed the fewest of its timed calls from the runtime's graphs
        done, runs = min(replayed, key=lambda x: x[0] / x[1])
        detail += f"; {done} of {runs} timed calls replayed from fo-tune's own CUDA graphs"
    return dict(
        variant=first["variant"],
        status=status,
        detail=detail,
        rel_err=err,
        median_ms=t.median_ms if t else math.nan,
        spread_ms=t.spread_ms if t else math.nan,
        schedule_source=first["source"],
    )


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 and not math.isnan(num) else math.nan


def _derived(variant: str, status: str, detail: str, median_ms: float = math.nan) -> dict[str, Any]:
    """A row that was not measured itself (the best chunk count, the ideal)."""
    return dict(variant=variant, status=status, detail=detail, rel_err=math.nan, median_ms=median_ms,
                spread_ms=math.nan, schedule_source="")  # fmt: skip


def case_rows(head: dict[str, Any], merged: Sequence[dict[str, Any]]) -> list[BenchRow]:
    """A case's rows in ``VARIANTS`` order: the best chunk count as ``chunked``, ideal, the ratios."""
    nan = math.nan
    by = {e["variant"]: e for e in merged}
    chunks = [e for e in merged if e["variant"].startswith("chunked_c")]
    ran = [e for e in chunks if e["status"] == "PASS"]
    if ran:
        best = min(ran, key=lambda e: e["median_ms"])
        tried = ",".join(e["variant"].removeprefix("chunked_c") for e in ran)
        by["chunked"] = {**best, "variant": "chunked", "detail": f"{best['detail']} (best of {tried})"}
    else:
        bad = next((e for e in chunks if e["status"] == "FAIL"), chunks[0] if chunks else None)
        status, why = (bad["status"], bad["detail"]) if bad else ("SKIP", "no chunk count given")
        by["chunked"] = _derived("chunked", status, why)
    gemm, comm = by["gemm"], by["collective"]
    if gemm["status"] == comm["status"] == "PASS":
        ideal_ms = max(gemm["median_ms"], comm["median_ms"])
        by["ideal"] = _derived("ideal", "PASS", "max(gemm, collective), not run", ideal_ms)
    else:
        ideal_ms = nan
        by["ideal"] = _derived("ideal", "SKIP", "needs gemm and collective to pass")
    seq = by["sequential"]["median_ms"] if by["sequential"]["status"] == "PASS" else nan
    order = [v for v in (*VARIANTS[:4], *(e["variant"] for e in chunks), *VARIANTS[4:]) if v in by]
    rows = []
    for name in order:
        e = by[name]
        ms = e["median_ms"] if e["status"] == "PASS" else nan
        ratios = dict(speedup_vs_sequential=_ratio(seq, ms), fraction_of_ideal=_ratio(ideal_ms, ms))
        rows.append(BenchRow(**head, **{**e, "median_ms": ms}, **ratios))
    return rows


def case_variants(collective: str, chunks: Sequence[int]) -> list[str]:
    """The rows of a ``collective`` case, in order (``VARIANTS``, one fused torch op)."""
    other = {*FUSED_VARIANT.values()} - {FUSED_VARIANT[collective]}
    names = [*VARIANTS[:4], *(f"chunked_c{c}" for c in chunks), *VARIANTS[4:]]
    return [name for name in names if name not in other]


def skipped_rows(head: dict[str, Any], chunks: Sequence[int], why: str) -> list[BenchRow]:
    """Every row of a case that cannot run (ReduceScatter or AllGather of an M the world size
    does not divide)."""
    names = case_variants(head["collective"], chunks)
    nan = math.nan
    return [
        BenchRow(**head, **_derived(v, "SKIP", why), speedup_vs_sequential=nan, fraction_of_ideal=nan)
        for v in names
    ]
