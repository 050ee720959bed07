"""The bench's rank task: every variant of one (shape, collective) on this rank, checked, then timed.

ops   = case_operands(collective, M, N, K, seed per rank)   # fo_tune.bench.operands: random, never
        zero; for all_gather a is this rank's (M/w, K) shard; references in float32
for each variant (fo_tune.bench.variants): out = fn(); pass iff no NaN and
    rel_err(out, ref) < GEMM_TOL[dtype] on every rank (they agree before anything is timed);
    a failed variant is not timed. The fused torch op and fo_tune allocate their output per call,
    so they are checked on a second operand set: a freed buffer holding an earlier variant's
    answer cannot pass. At world size 1 the fused torch op (symmetric memory between ranks) is a
    SKIP row
time = fo_tune.ranks.timing.time_interleaved over every variant that passed (alternating rounds, the
    ranks agree on call counts)
fo_tune is checked once more after timing, its previous output poisoned with NaN first: the
    runtime replays repeated calls from CUDA graphs of its own, which the first check precedes
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fo_kernels.errors import HeuristicScheduleWarning
from fo_kernels.runtime import runtime_for
from fo_kernels.schedule import SHARDED_COLLECTIVES
from fo_tune.bench import variants as v
from fo_tune.bench.operands import CaseOperands, case_operands
from fo_tune.bench.request import CHUNK_COUNTS, GPU_REPS, WARMUP
from fo_tune.bench.rows import FUSED_VARIANT
from fo_tune.ranks.gemm import GEMM_TOL, operand_seed, rel_err
from fo_tune.ranks.pool import RankContext
from fo_tune.ranks.scaled import library_mm
from fo_tune.ranks.timing import MIN_SAMPLE_MS, time_interleaved

# Seed offset of the second operand set (any number keeping it apart from the first set's seeds).
FRESH_SEED = 7919


def entry(variant: str, status: str, detail: str = "", err: float = math.nan, **extra: Any) -> dict:
    """One rank's result of one variant (``timing`` is filled in once the variants are timed)."""
    return dict(variant=variant, status=status, detail=detail, rel_err=err, timing=None, source="", **extra)


def _worst(code: int, device: torch.device) -> int:
    """The largest code of any rank (0 pass, 1 fail, 2 unavailable): every rank decides alike."""
    t = torch.tensor([code], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def own_graph_calls(device: torch.device) -> tuple[int, int]:
    """(calls, replayed calls) so far of this rank's copy engine and ``overlap: false`` fallback, the
    runtime's two users of CUDA graphs of its own; (0, 0) before either is made. A bench row run
    eagerly pays a call's host time (~0.3 ms at 2048x4096x4096 on the copy engine,
    docs/design.md#host-time), so the fo_tune row says how many of its timed calls were replayed."""
    if device.type != "cuda":
        return 0, 0
    runtime = runtime_for(device, None)
    engine, fallback = runtime.made_copy_engine(), runtime.made_fallback()
    calls, replays = engine.call_counts() if engine is not None else (0, 0)
    if fallback is not None and fallback.graphs is not None:
        calls, replays = calls + fallback.graphs.calls, replays + fallback.graphs.replays
    return calls, replays


@dataclass(frozen=True)
class BenchCaseTask:
    """Every variant of one (shape, collective) on this rank: check, agree, then time."""

    collective: str
    m: int
    n: int
    k: int
    dtype: str
    chunks: tuple[int, ...] = CHUNK_COUNTS
    warmup: int = WARMUP
    reps: int = GPU_REPS
    seed: int = 0
    min_sample_ms: float = MIN_SAMPLE_MS  # the shortest timed sample (fo_tune.ranks.timing)

    def run(self, ctx: RankContext) -> list[dict[str, Any]]:
        m, n, k, c = self.m, self.n, self.k, self.collective
        seed = operand_seed(self.seed, m, n, k, ctx.rank)
        ops = case_operands(c, m, n, k, self.dtype, ctx.device, seed % (1 << 62))
        out = [
            self._measure(
                ctx, "gemm", "", lambda: lambda: library_mm(ops.gemm_a, ops.b, ops.gemm_kw), ops.gemm_ref
            ),
            self._measure(ctx, "collective", "", lambda: v.collective_alone(c, ops.comm_in), ops.comm_ref),
            self._measure(ctx, "sequential", "", lambda: v.sequential(c, ops.a, ops.b, ops.kw), ops.ref),
            *self._chunked(ctx, ops),
        ]
        fresh = case_operands(c, m, n, k, self.dtype, ctx.device, (seed + FRESH_SEED) % (1 << 62))
        out.append(self._fused(ctx, fresh))
        with warnings.catch_warnings():  # fo_tune's schedule source is recorded in its row instead
            warnings.simplefilter("ignore", HeuristicScheduleWarning)
            source, detail = v.fo_tune_schedule(c, m, n, k, self.dtype, ctx)
            build = lambda: v.fo_tune(c, fresh.a, fresh.b, fresh.kw)
            fo = self._measure(ctx, "fo_tune", detail, build, fresh.ref)
            out.append({**fo, "source": source})
            self._time(ctx, out, fresh.ref)
        return out

    def _chunked(self, ctx: RankContext, ops: CaseOperands) -> list[dict[str, Any]]:
        """One entry per chunk count: checked, or SKIP where M (a shard's rows) is too short."""
        sharded = self.collective in SHARDED_COLLECTIVES
        rows = self.m // ctx.world_size if sharded else self.m
        out = []
        for chunks in self.chunks:
            name = f"chunked_c{chunks}"
            if rows < chunks:
                what = f"M/world = {rows} rows per shard" if sharded else f"M = {rows} rows"
                out.append(entry(name, "SKIP", f"chunks={chunks}: {what}, fewer than {chunks}"))
                continue
            detail = f"chunks={chunks}"
            if ctx.device.type != "cuda":
                detail += ", CPU: no second stream, the chunks run one after the other"
            build = lambda chunks=chunks: v.chunked(self.collective, ctx, ops.a, ops.b, chunks, ops.kw)
            out.append(self._measure(ctx, name, detail, build, ops.ref))
        return out

    def _fused(self, ctx: RankContext, ops: CaseOperands) -> dict[str, Any]:
        """The collective's fused torch op (``FUSED_VARIANT``), checked on the fresh operands:
        UNAVAILABLE where it raises (off CUDA and NCCL), SKIP where it does not apply."""
        name = FUSED_VARIANT[self.collective]
        if self.collective == "all_reduce":
            return entry(name, "SKIP", "torch fuses matmul with reduce_scatter and all_gather only")
        if ctx.world_size < 2:
            return entry(name, "SKIP", "world size 1: no peer rank for torch's symmetric-memory op")
        scaled = "scaled_" if ops.kw else ""
        if self.collective == "reduce_scatter":
            build, what = (
                (lambda: v.async_tp(ctx, ops.a, ops.b, ops.kw)),
                f"fused_{scaled}matmul_reduce_scatter",
            )
        else:
            build, what = (
                (lambda: v.torch_fused(ctx, ops.a, ops.b, ops.kw)),
                f"fused_all_gather_{scaled}matmul",
            )
        return self._measure(ctx, name, what, build, ops.ref, raise_code=2)

    def _time(self, ctx: RankContext, out: list[dict[str, Any]], ref2: torch.Tensor) -> None:
        """Time every variant that passed its check side by side in alternating rounds (a clock
        drift during the case cannot favour the variant timed first), then check fo_tune again."""
        calls = {i: e.pop("fn") for i, e in enumerate(out) if "fn" in e}
        before = own_graph_calls(ctx.device)
        timings = time_interleaved(
            calls,
            ctx.device,
            warmup=self.warmup,
            rounds=self.reps,
            agree=True,
            min_sample_ms=self.min_sample_ms,
        )
        for i, timing in timings.items():
            out[i]["timing"] = timing
        fo = len(out) - 1  # fo_tune: checked again, now that its calls replay from the runtime's graphs
        if fo in calls:
            why = self._recheck(ctx, calls[fo], ref2)
            if why:
                out[fo].update(status="FAIL", detail=f"{out[fo]['detail']}: {why}", timing=None)
        after = own_graph_calls(ctx.device)
        if after[0] > before[0]:  # fo_tune ran through the runtime's graphs (no other variant does)
            out[-1]["replayed"] = (after[1] - before[1], after[0] - before[0])

    def _measure(
        self,
        ctx: RankContext,
        variant: str,
        detail: str,
        build: Callable[[], v.Call],
        ref: torch.Tensor,
        *,
        raise_code: int = 1,
    ) -> dict[str, Any]:
        """``build()`` returns the call; its first result is checked and every rank agrees; a passing
        entry carries the call (``fn``) for ``run`` to time beside the others.

        An exception counts as ``raise_code`` (1: FAIL, 2: UNAVAILABLE); the worst code of any rank wins.
        """
        fn: v.Call | None = None
        err, why, code = math.nan, "", 0
        try:
            fn = build()
            err, why = self._verdict(fn(), ref)
            code = 1 if why else 0
        except Exception as exc:  # a variant that cannot run is reported, never timed
            code, why = raise_code, v.reason(exc)
        worst = _worst(code, ctx.device)
        if worst:
            why = why or "failed on another rank"
            status = "UNAVAILABLE" if worst == 2 else "FAIL"
            return entry(variant, status, f"{detail}: {why}" if detail else why, err)
        assert fn is not None
        return {**entry(variant, "PASS", detail, err), "fn": fn}  # timed with the others in run()

    def _verdict(self, got: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
        """(relative error, '' or why ``got`` fails: a NaN, or an error at or above the dtype's
        tolerance)."""
        tol = GEMM_TOL[self.dtype]
        err = rel_err(got, ref)
        if bool(torch.isnan(got).any()):
            return err, "NaN in the output"
        if not err < tol:
            return err, f"relative error {err:.2e} >= {tol:g}"
        return err, ""

    def _recheck(self, ctx: RankContext, fn: v.Call, ref: torch.Tensor) -> str:
        """'' if ``fn``'s result is right with its previous output poisoned, else why not (every
        rank agrees). A call dropping its output gets the same block back (the runtime's outputs
        have a pool of their own), so a replay that wrote nothing reads NaN instead of the answer
        of the call before."""
        why = ""
        try:
            got = fn()
            got.fill_(math.nan)
            del got
            _, why = self._verdict(fn(), ref)
            why = f"{why} after timing" if why else ""
        except Exception as exc:
            why = f"after timing: {v.reason(exc)}"
        if _worst(1 if why else 0, ctx.device):
            return why or "failed after timing on another rank"
        return ""
