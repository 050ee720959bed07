"""What each rank of ``fo-tune demo`` runs (``fo_tune.bench.demo.run_demo`` spawns them; its
docstring gives the per-rank pseudo-code): every (shape, collective) case checked against float64
and timed, overlapped and sequential, and the parent's merge of the ranks' results."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Untimed calls before a timed series (the checked call is the overlapped op's first).
WARMUP = 2


@dataclass(frozen=True, slots=True)
class Job:
    """What every rank runs: the shapes, dtype, timed calls per op and the operands' seed."""

    shapes: tuple[tuple[int, int, int], ...]
    dtype: str
    reps: int
    seed: int


def _timed_median(call: Callable[[], Any], reps: int, device: Any, warmup: int = WARMUP) -> float:
    """Median ms of ``reps`` calls after ``warmup`` untimed ones; each timed call starts at a barrier."""
    import torch
    import torch.distributed as dist

    from fo_tune.ranks.timing import warmup_calls

    for _ in range(warmup_calls(warmup, device)):
        call()
    cuda = device.type == "cuda"
    times: list[float] = []
    for _ in range(reps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _collective_of(collective: str, x: Any, world: int) -> Any:
    """``collective`` of ``x`` over the default group: all_reduce in place, reduce_scatter of an
    (M, N) product, all_gather of an (M/w, K) shard (fp8 as its bytes, ``fo_kernels.scaling.wire``:
    gloo has no fp8 type)."""
    import torch.distributed as dist

    from fo_kernels.collectives import all_gather_tensor, reduce_scatter_tensor
    from fo_kernels.scaling import wire

    if collective == "all_reduce":
        dist.all_reduce(x)
        return x
    if collective == "all_gather":
        out = x.new_empty((x.shape[0] * world, *x.shape[1:]))
        all_gather_tensor(wire(out), wire(x.contiguous()))
        return out
    out = x.new_empty((x.shape[0] // world, x.shape[1]))
    reduce_scatter_tensor(out, x)
    return out


def _gathered(scales: dict[str, Any], world: int) -> dict[str, Any]:
    """fp8 scales of a gathered A: rowwise, every rank's ``scale_a`` rows gathered (tensorwise and
    no scales: as they are)."""
    if not scales or scales["scale_a"].dim() == 0:
        return scales
    return {**scales, "scale_a": _collective_of("all_gather", scales["scale_a"], world)}


def _one_case(ctx: Any, collective: str, a: Any, b: Any, job: Job) -> dict[str, Any]:
    import fo_kernels
    from fo_kernels import HeuristicScheduleWarning, lookup_schedule
    from fo_kernels.table import MISS_SOURCE
    from fo_tune.ranks.scaled import dequantized, library_mm, scale_kwargs

    world = ctx.world_size
    gather = collective == "all_gather"
    if gather:
        a = a[: a.shape[0] // world]  # this rank's shard of the gathered A
    m = a.shape[0] * world if gather else a.shape[0]
    n, k = b.shape[1], b.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeuristicScheduleWarning)
        schedule = lookup_schedule(collective, m, n, k, dtype=job.dtype, world_size=world, device=ctx.device)
    op = {
        "all_reduce": fo_kernels.gemm_all_reduce,
        "reduce_scatter": fo_kernels.gemm_reduce_scatter,
        "all_gather": fo_kernels.all_gather_gemm,
    }[collective]

    kw = scale_kwargs(a, b)  # fp8: this rank's rows' scales, as the op takes them; else {}

    def overlapped() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", HeuristicScheduleWarning)
            return op(a, b, schedule=None, **kw)

    def sequential(x: Any, y: Any, scales: dict[str, Any]) -> Any:
        # (fp8: the library's scaled GEMM, torch._scaled_mm; gathered, with the gathered rows' scales)
        if gather:
            return library_mm(_collective_of(collective, x, world), y, _gathered(scales, world))
        return _collective_of(collective, library_mm(x, y, scales), world)

    out = overlapped()  # the checked call, also the first warm-up
    ref = sequential(*(t.double() for t in dequantized(a, b, kw)), {})
    has_nan = bool(out.isnan().any())
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return dict(
        schedule=schedule.describe(),
        source=MISS_SOURCE if schedule.provenance.get("source") == MISS_SOURCE else "table",
        overlap=schedule.settings is not None,
        rel_err=err,
        has_nan=has_nan,
        overlapped_ms=_timed_median(overlapped, job.reps, ctx.device, warmup=WARMUP - 1),
        sequential_ms=_timed_median(lambda: sequential(a, b, kw), job.reps, ctx.device),
    )


def rank_main(ctx: Any, job: Job) -> list[dict[str, Any] | None]:
    """On every rank: one result per (shape, collective), None for a skipped ReduceScatter or
    AllGather (M not divisible by the world size)."""
    import torch

    from fo_kernels.scaling import is_fp8
    from fo_kernels.schedule import COLLECTIVES, SHARDED_COLLECTIVES, torch_dtype
    from fo_tune.ranks.gemm import operand_seed

    dtype = torch_dtype(job.dtype)
    results: list[dict[str, Any] | None] = []
    for i, (m, n, k) in enumerate(job.shapes):
        gen = torch.Generator().manual_seed(operand_seed(job.seed, i, ctx.rank))
        a = torch.randn(m, k, generator=gen).to(dtype).to(ctx.device)
        if is_fp8(dtype):  # the transposed view of an (N, K) weight: the layout fp8 GEMMs read
            b = torch.randn(n, k, generator=gen).to(dtype).to(ctx.device).t()
        else:
            b = torch.randn(k, n, generator=gen).to(dtype).to(ctx.device)
        for collective in COLLECTIVES:
            if collective in SHARDED_COLLECTIVES and m % ctx.world_size:
                results.append(None)
                continue
            results.append(_one_case(ctx, collective, a, b, job))
    return results


# ------------------------------------------------------------------------------------ the parent
def merge_ranks(per_rank: list[dict[str, Any]], tol: float) -> dict[str, Any]:
    """One demo row's results from every rank's: the worst error and time over the ranks, passed when no rank
    has a NaN and the error is under ``tol``; no speedup (NaN) for a call that ran without overlap, GEMM
    then the collective as the baseline does."""
    err = max(r["rel_err"] for r in per_rank)
    nan = any(r["has_nan"] for r in per_rank)
    over = max(r["overlapped_ms"] for r in per_rank)
    seq = max(r["sequential_ms"] for r in per_rank)
    return dict(
        schedule=per_rank[0]["schedule"],
        schedule_source=per_rank[0]["source"],
        rel_err=err,
        has_nan=nan,
        passed=not nan and err == err and err < tol,
        overlapped_ms=over,
        sequential_ms=seq,
        speedup=seq / over if over > 0 and per_rank[0]["overlap"] else float("nan"),
    )
