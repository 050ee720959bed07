"""Repeated copy-engine calls on N thread-ranks (or N virtual ranks of one GPU), checked against float64.

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

``check_on_gpu`` runs the same calls on the virtual ranks of one GPU (``virtual.VirtualRanks``):
eagerly, or captured in a CUDA graph after the first call and replayed.

``fo-tune demo --engine copy_engine`` and the tests run these.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fo_kernels.engines.copy_engine.buffers import Dtypes, region_bytes_for, scale_bytes_for
from fo_kernels.engines.copy_engine.cpu import CpuOptions, CpuRank, run_ranks
from fo_kernels.engines.copy_engine.layout import shard_rows
from fo_kernels.engines.copy_engine.modes import check_weights, plan_call
from fo_kernels.engines.copy_engine.settings import COPY_ENGINE_MIN_WORLD
from fo_kernels.errors import ArgumentError, ScaleError, ScheduleError, ShapeError
from fo_kernels.fields import check_int
from fo_kernels.scaling import FP8_ALIGN, FP8_DTYPE, OUT_DTYPES, Scales, fp8_aligned
from fo_kernels.tile import Tile

if TYPE_CHECKING:
    from fo_kernels.engines.copy_engine.virtual import VirtualRanks

SCALINGS = ("", "tensorwise", "rowwise")
# A tensorwise call's scale_a: one of these, the same on every rank (an all_gather's A has one
# scale) and another on each next call (a scale left from the previous call fails the check).
TENSORWISE_A_SCALES = (0.5, 0.75, 1.0, 0.25)


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
        """Every field a caller can get wrong, refused here (before any thread-rank starts), each
        error naming the field: the sizes, the call the operation lists are built for (collective,
        mode, weights, tile and the rows per rank, as ``plan_call`` refuses them), the dtypes."""
        check_int("world", self.world, minimum=COPY_ENGINE_MIN_WORLD, error=ScheduleError)
        for name in ("m", "n", "k"):
            check_int(name, getattr(self, name), minimum=1, error=ShapeError)
        check_int("calls", self.calls, minimum=1, error=ArgumentError)
        check_int("seed", self.seed, minimum=0, error=ArgumentError)
        if self.scaling not in SCALINGS:
            raise ScaleError(f"scaling: {self.scaling!r} is not one of {', '.join(map(repr, SCALINGS))}")
        if not self.scaling and self.dtype not in OUT_DTYPES:  # (the ops' unscaled operand dtypes)
            raise ShapeError(
                f"dtype: {self.dtype!r} is not one of torch.bfloat16, torch.float16, torch.float32 "
                "(float8_e4m3fn operands: give scaling)"
            )
        object.__setattr__(self, "weights", check_weights(self.weights))
        row_scales = self.scaling == "rowwise"
        plan_call(self.mode, self.collective, self.world, 0, self.m, self.n, self.k, self.weights, self.tile,
                  row_scales=row_scales)  # fmt: skip
        if not self.scaling:
            return
        if self.out_dtype not in OUT_DTYPES:  # (the fp8 ops' rule, ``scaling.check_scales``)
            raise ScaleError(
                f"out_dtype: {self.out_dtype!r} is not one of torch.bfloat16, torch.float16, torch.float32"
            )
        if not fp8_aligned(self.n, self.k):
            raise ShapeError(
                f"float8_e4m3fn operands need N and K multiples of {FP8_ALIGN} (as the fp8 ops), "
                f"got N={self.n}, K={self.k}"
            )


@dataclass(frozen=True)
class CheckResult:
    """The largest relative error over ranks and calls, NaN anywhere, the median wall time of a
    call on its slowest rank (the executor's, not a GPU's)."""

    rel_err: float
    has_nan: bool
    wall_ms: float


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _operands(c: CpuCheck, a_rows: int, gen: torch.Generator, call: int) -> tuple[torch.Tensor, ...]:
    """One rank's (a, b, scale_a, scale_b) of call number ``call`` on ``gen``'s device (scales None
    without ``scaling``); tensorwise, scale_a is ``TENSORWISE_A_SCALES``' for the call."""
    dtype, on = FP8_DTYPE if c.scaling else c.dtype, {"generator": gen, "device": gen.device}
    a = (torch.randn(a_rows, c.k, **on) * (3 if c.scaling else 1)).to(dtype)
    b = torch.randn(c.k, c.n, **on).to(dtype)
    if c.scaling == "rowwise":
        return a, b, torch.rand(a_rows, 1, **on) + 0.25, torch.rand(1, c.n, **on) + 0.25
    if c.scaling == "tensorwise":
        scale_a = TENSORWISE_A_SCALES[(c.seed + call) % len(TENSORWISE_A_SCALES)]
        return a, b, torch.tensor(scale_a, device=gen.device), torch.rand((), **on) + 0.25
    return a, b, None, None


def _dequantized(a: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return a.double() if scale is None else a.double() * scale.double()


def _references(c: CpuCheck, ops: list[tuple]) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """Each rank's (gathered A or None, output) of one call in float64, from every rank's
    ``_operands``."""
    deq = [(_dequantized(a, sa), _dequantized(b, sb)) for a, b, sa, sb in ops]
    if c.collective == "all_gather":
        whole = torch.cat([a.double() for a, *_ in ops])
        return [(whole, torch.cat([a for a, _ in deq]) @ b) for _, b in deq]
    total = sum(a @ b for a, b in deq)
    if c.collective == "all_reduce":
        return [(None, total) for _ in ops]
    return [(None, total[r0:r1]) for r0, r1 in shard_rows(c.m, c.world)]


def _scales_of(c: CpuCheck, sa: torch.Tensor | None, sb: torch.Tensor | None) -> Scales | None:
    if not c.scaling:
        return None
    return Scales(a=sa.reshape(-1), b=sb.reshape(-1), out_dtype=c.out_dtype, rowwise=c.scaling == "rowwise")


def _poison(out: torch.Tensor, gathered: torch.Tensor | None) -> None:
    """NaN into a call's outputs, so a row the call does not write fails the check."""
    out.fill_(float("nan"))
    if gathered is not None:
        gathered.view(torch.uint8).fill_(255)  # (NaN in float8_e4m3fn and bfloat16 too)


def _has_nan(out: torch.Tensor, gathered: torch.Tensor | None) -> bool:
    return bool(out.isnan().any()) or (gathered is not None and bool(gathered.float().isnan().any()))


def check_on_threads(check: CpuCheck, options: CpuOptions | None = None) -> CheckResult:
    """Run ``check``'s calls on ``check.world`` thread-ranks (see the module docstring)."""
    w, c = check.world, check
    gather = c.collective == "all_gather"
    row_scales = c.scaling == "rowwise"
    plans = [
        plan_call(c.mode, c.collective, w, r, c.m, c.n, c.k, c.weights, c.tile, row_scales=row_scales)
        for r in range(w)
    ]
    a_rows = c.m // w if gather else c.m
    gen = torch.Generator().manual_seed(c.seed)
    operands = [[_operands(c, a_rows, gen, i) for _ in range(w)] for i in range(c.calls)]
    refs = [_references(c, ops) for ops in operands]
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
            scales = _scales_of(c, *operands[i][r][2:])
            _poison(out, gathered)
            t0 = time.perf_counter()
            rank.call(plan, a, b, out, gathered, scales)
            times.append((time.perf_counter() - t0) * 1e3)
            whole, ref = refs[i][r]
            nan |= _has_nan(out, gathered)
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


def check_on_gpu(check: CpuCheck, ranks: VirtualRanks, *, graph: bool = False) -> CheckResult:
    """``check``'s calls on the virtual ranks of one GPU (``virtual.VirtualRanks``, ``check.world``
    of them), on the same tensors every call with new values, the outputs poisoned (NaN) before
    each: every call issued eagerly, or (``graph``) the first eagerly and every later one replayed
    from a CUDA graph captured after it. Errors against float64 on the GPU; ``wall_ms`` is the
    median GPU time of a call of all N ranks on the one GPU."""
    c, w = check, ranks.world
    if c.world != w:
        raise ShapeError(
            f"world: the check is for {c.world} ranks, the virtual ranks are {w}; give both the same"
        )
    device = ranks.dev.device
    gather = c.collective == "all_gather"
    a_rows = c.m // w if gather else c.m
    gen = torch.Generator(device=device).manual_seed(c.seed)
    first = [_operands(c, a_rows, gen, 0) for _ in range(w)]
    a, b = [x[0].clone() for x in first], [x[1].clone() for x in first]  # (the call's tensors)
    sa = [None if x[2] is None else x[2].clone() for x in first]
    sb = [None if x[3] is None else x[3].clone() for x in first]
    scales = [_scales_of(c, sa[r], sb[r]) for r in range(w)] if c.scaling else None
    out_dtype = c.out_dtype if c.scaling else c.dtype
    vp = ranks.plan(
        c.collective, c.m, c.n, c.k, Dtypes(a[0].dtype, out_dtype),
        mode=c.mode, weights=c.weights, tile=c.tile, row_scales=c.scaling == "rowwise" and gather,
    )  # fmt: skip
    outs = [torch.empty(p.out_rows, c.n, dtype=out_dtype, device=device) for p in vp.plans]
    gathered = [torch.empty(c.m, c.k, dtype=a[0].dtype, device=device) for _ in range(w)] if gather else None
    captured = None
    err, nan, times = 0.0, False, []
    for i in range(c.calls):
        ops = first if i == 0 else [_operands(c, a_rows, gen, i) for _ in range(w)]
        for r, (ar, br, sar, sbr) in enumerate(ops):
            a[r].copy_(ar)
            b[r].copy_(br)
            if sar is not None:
                sa[r].copy_(sar)
                sb[r].copy_(sbr)
            _poison(outs[r], None if gathered is None else gathered[r])
        ranks.dev.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if captured is not None:
            captured.replay()
        else:
            ranks.issue(vp, a, b, outs, gathered, scales=scales)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        for r, (whole, ref) in enumerate(_references(c, ops)):
            got = None if gathered is None else gathered[r]
            nan |= _has_nan(outs[r], got)
            err = max(err, _rel(outs[r], ref), _rel(got, whole) if got is not None else 0.0)
        if graph and captured is None:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                ranks.issue(vp, a, b, outs, gathered, scales=scales)
            ranks.dev.synchronize()
    return CheckResult(rel_err=err, has_nan=nan, wall_ms=statistics.median(times))
