"""Repeated copy-engine calls on N thread-ranks of the CPU executor, checked against float64.

    for call i = 1 .. calls, on every rank r, with no barrier between calls (a fast rank starts its
    next call while the others still read its buffers: the reuse guards must hold it back):
        a_r, b_r <- new random values, copied into the same tensors (the same buffers every call)
        out (and gathered) <- NaN, so a row the call does not write fails the check
        run the call's operation list (``cpu.CpuRank.call``), then
        err = ||out - ref|| / ||ref|| with ref in float64:
            all_reduce: sum_q a_q @ b_q   reduce_scatter: its rows of shard r
            all_gather: cat_q(a_q) @ b_r, and the gathered A must equal cat_q(a_q)

fp8 (``scaling`` tensorwise or rowwise): a_q, b_q in float8_e4m3fn with float32 scales, the
reference of the dequantized operands (a_q * sa_q) @ (b_q * sb_q), the output in ``out_dtype``.

``fo-tune demo --engine copy_engine`` and the CPU tests run this.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from fo_kernels.engines.copy_engine.buffers import Dtypes, region_bytes_for, scale_bytes_for
from fo_kernels.engines.copy_engine.cpu import CpuOptions, CpuRank, run_ranks
from fo_kernels.engines.copy_engine.layout import shard_rows
from fo_kernels.engines.copy_engine.modes import plan_call
from fo_kernels.scaling import FP8_DTYPE, Scales
from fo_kernels.tile import Tile

SCALINGS = ("", "tensorwise", "rowwise")


@dataclass(frozen=True, kw_only=True)
class CpuCheck:
    """One call shape to check: ``m`` rows of the output (all_gather: of the gathered A, each
    rank's shard ``m / world`` rows)."""

    collective: str
    world: int
    m: int
    n: int
    k: int
    mode: str = "ring"
    weights: tuple[int, ...] = (1, 1)
    tile: Tile | None = None
    dtype: torch.dtype = torch.float32
    calls: int = 3
    seed: int = 0
    scaling: str = ""  # fp8 operands (dtype ignored) with these scales; "": none
    out_dtype: torch.dtype = torch.bfloat16  # an fp8 call's output dtype

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling: {self.scaling!r} is not one of {SCALINGS}")


@dataclass(frozen=True)
class CheckResult:
    """The largest relative error over ranks and calls, NaN anywhere, the median wall time of a
    call on its slowest rank (the executor's, not a GPU's)."""

    rel_err: float
    has_nan: bool
    wall_ms: float


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _operands(c: CpuCheck, a_rows: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One rank's (a, b, scale_a, scale_b) of one call (scales None without ``scaling``);
    tensorwise, every rank's scale_a is the same (an all_gather's A has one scale)."""
    dtype = FP8_DTYPE if c.scaling else c.dtype
    a = (torch.randn(a_rows, c.k, generator=gen) * (3 if c.scaling else 1)).to(dtype)
    b = torch.randn(c.k, c.n, generator=gen).to(dtype)
    if c.scaling == "rowwise":
        return a, b, torch.rand(a_rows, 1, generator=gen) + 0.25, torch.rand(1, c.n, generator=gen) + 0.25
    if c.scaling == "tensorwise":
        return a, b, torch.tensor(0.5 + c.seed % 3 / 4), torch.rand((), generator=gen) + 0.25
    return a, b, None, None


def _dequantized(a: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return a.double() if scale is None else a.double() * scale.double()


def check_on_threads(check: CpuCheck, options: CpuOptions | None = None) -> CheckResult:
    """Run ``check``'s calls on ``check.world`` thread-ranks (see the module docstring)."""
    w, c = check.world, check
    gather = c.collective == "all_gather"
    row_scales = c.scaling == "rowwise"
    plans = [
        plan_call(c.mode, c.collective, w, r, c.m, c.n, c.k, c.weights, c.tile, row_scales=row_scales)
        for r in range(w)
    ]
    rows = shard_rows(c.m, w)
    a_rows = c.m // w if gather else c.m
    gen = torch.Generator().manual_seed(c.seed)
    operands = [[_operands(c, a_rows, gen) for _ in range(w)] for _ in range(c.calls)]
    refs = []
    for ops in operands:
        deq = [(_dequantized(a, sa), _dequantized(b, sb)) for a, b, sa, sb in ops]
        if gather:
            whole = torch.cat([a.double() for a, *_ in ops])
            refs.append([(whole, torch.cat([a for a, _ in deq]) @ b) for _, b in deq])
        else:
            total = sum(a @ b for a, b in deq)
            refs.append([(None, total if c.collective == "all_reduce" else total[r0:r1]) for r0, r1 in rows])
    in_dtype = operands[0][0][0].dtype
    out_dtype = c.out_dtype if c.scaling else c.dtype

    def body(rank: CpuRank) -> tuple[float, bool, float]:
        r, plan = rank.rank, plans[rank.rank]
        a, b = torch.empty(a_rows, c.k, dtype=in_dtype), torch.empty(c.k, c.n, dtype=in_dtype)
        out = torch.empty(plan.out_rows, c.n, dtype=out_dtype)
        gathered = torch.empty(c.m, c.k, dtype=in_dtype) if gather else None
        err, nan, times = 0.0, False, []
        for i in range(c.calls):
            a.copy_(operands[i][r][0])
            b.copy_(operands[i][r][1])
            _, _, sa, sb = operands[i][r]
            scales = None
            if c.scaling:
                scales = Scales(a=sa.reshape(-1), b=sb.reshape(-1), out_dtype=out_dtype, rowwise=row_scales)
            out.fill_(float("nan"))
            if gathered is not None:
                gathered.view(torch.uint8).fill_(255)  # (NaN in float8_e4m3fn too)
            t0 = time.perf_counter()
            rank.call(plan, a, b, out, gathered, scales)
            times.append((time.perf_counter() - t0) * 1e3)
            whole, ref = refs[i][r]
            nan |= bool(out.isnan().any()) or (gathered is not None and bool(gathered.float().isnan().any()))
            err = max(err, _rel(out, ref), _rel(gathered, whole) if gathered is not None else 0.0)
        return err, nan, statistics.median(times)

    need = max(region_bytes_for(p, Dtypes(in_dtype, out_dtype)) for p in plans)
    per_rank = run_ranks(
        w, body, region_bytes=need, options=options, scale_bytes=max(scale_bytes_for(p) for p in plans)
    )
    errs = [e for e, _, _ in per_rank]
    return CheckResult(
        rel_err=float("nan") if any(e != e for e in errs) else max(errs),
        has_nan=any(n for _, n, _ in per_rank),
        wall_ms=max(t for _, _, t in per_rank),
    )
