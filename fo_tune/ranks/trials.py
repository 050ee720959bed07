"""The search's measurement tasks on every rank: a trial of one schedule (``OverlapTrialTask``), the
sequential baseline (``SequentialTask``) and the confirmation of decided rows (``ConfirmTask``);
each checks the schedule (``fo_tune.ranks.checks``) before it times it, and returns this rank's
numbers (the driver takes the max over ranks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fo_kernels.errors import DeviceLimitError
from fo_kernels.schedule import Problem, Schedule
from fo_tune.ranks import CONFIRM_ROUNDS
from fo_tune.ranks.checks import (
    call_operands,
    check_schedule,
    gathered_rows,
    op_of,
    reference,
    sequential_call,
)
from fo_tune.ranks.collectives import collective_call
from fo_tune.ranks.gemm import GEMM_TOL, operand_seed, rel_err
from fo_tune.ranks.pool import RankContext
from fo_tune.ranks.scaled import library_mm, scale_kwargs
from fo_tune.ranks.timing import comparison_sample_ms, time_interleaved, time_region


@dataclass(frozen=True)
class ConfirmTask:
    """The confirmation of a search: its best schedules (each checked again), GEMM-then-collective
    (checked by ``SequentialTask`` at the start of the search) and the runtime's ``overlap: false``
    fallback (checked here: what the row runs if it does not overlap, replayed from the runtime's
    own CUDA graphs on GPUs), timed side by side in alternating rounds (``time_interleaved``), so
    the row is decided on one paired measurement rather than on numbers taken minutes apart."""

    schedules: tuple[Schedule, ...]
    m: int
    n: int
    k: int
    seed: int
    warmup: int = 3
    rounds: int = CONFIRM_ROUNDS

    def run(self, ctx: RankContext) -> dict[str, Any]:
        s0 = self.schedules[0]
        errs = [check_schedule(ctx, s, self.m, self.n, self.k, self.seed) for s in self.schedules]
        ok = [e < GEMM_TOL[s0.dtype] for e in errs]
        fallback = Schedule(
            collective=s0.collective,
            dtype=s0.dtype,
            world_size=ctx.world_size,
            problem=Problem(m=self.m, n=self.n, k=self.k),
        )
        fallback_ok = check_schedule(ctx, fallback, self.m, self.n, self.k, self.seed) < GEMM_TOL[s0.dtype]
        a, b = call_operands(
            s0.collective,
            self.m,
            self.n,
            self.k,
            s0.dtype,
            ctx.device,
            operand_seed(self.seed, ctx.rank),
            ctx.world_size,
        )
        fns: dict[str, Callable[[], Any]] = {
            "sequential": sequential_call(s0.collective, a, b, ctx.world_size)
        }
        kw = scale_kwargs(a, b)  # (fp8: made once, outside the timed calls)
        if fallback_ok:
            fns["fallback"] = lambda: op_of(fallback.collective)(a, b, schedule=fallback, **kw)
        for i, s in enumerate(self.schedules):
            if ok[i]:
                fns[str(i)] = lambda s=s: op_of(s.collective)(a, b, schedule=s, **kw)
        # the bench's sample length, so a row is decided as the bench will time it
        sample_ms = comparison_sample_ms(ctx.device.type == "cuda")
        timings = time_interleaved(
            fns, ctx.device, warmup=self.warmup, rounds=self.rounds, agree=True, min_sample_ms=sample_ms
        )
        return dict(
            rel_err=errs,
            ok=ok,
            sequential=timings["sequential"],
            fallback=timings.get("fallback"),
            timings=[timings.get(str(i)) for i in range(len(self.schedules))],
        )


@dataclass(frozen=True)
class OverlapTrialTask:
    """One schedule of the search on every rank: checked on fresh random inputs against
    ``collective_fp32(a.float() @ b.float())``, then timed back to back (ranks agree on counts)."""

    schedule: Schedule
    m: int
    n: int
    k: int
    seed: int
    warmup: int = 3
    reps: int = 10

    def run(self, ctx: RankContext) -> dict[str, Any]:
        s = self.schedule
        try:
            worst = check_schedule(ctx, s, self.m, self.n, self.k, self.seed)
        except DeviceLimitError as exc:  # (every rank's GPU refuses the same kernel, none waits)
            return dict(
                rel_err=math.inf, has_nan=False, ok=False, timing=None, note=f"does not fit the GPU: {exc}"
            )
        ok = worst < GEMM_TOL[s.dtype]  # the same on every rank: none is left waiting in a collective
        timing = None
        if ok:
            a, b = call_operands(
                s.collective,
                self.m,
                self.n,
                self.k,
                s.dtype,
                ctx.device,
                operand_seed(self.seed, ctx.rank),
                ctx.world_size,
            )
            op, kw = op_of(s.collective), scale_kwargs(a, b)
            timing = time_region(
                lambda: op(a, b, schedule=s, **kw), ctx.device, warmup=self.warmup, reps=self.reps, agree=True
            )
        return dict(rel_err=worst, has_nan=math.isinf(worst), ok=ok, timing=timing)


@dataclass(frozen=True)
class SequentialTask:
    """The baselines of one shape: cuBLAS GEMM alone (all_gather: of the gathered A), the collective
    alone (NCCL's default communicator, on the bytes it moves in the op) and GEMM then collective
    (all_gather: the gather then the GEMM), the last checked against the float32 reference."""

    collective: str
    m: int
    n: int
    k: int
    dtype: str
    seed: int
    warmup: int = 3
    reps: int = 10

    def run(self, ctx: RankContext) -> dict[str, Any]:
        world = ctx.world_size
        a, b = call_operands(
            self.collective,
            self.m,
            self.n,
            self.k,
            self.dtype,
            ctx.device,
            operand_seed(self.seed, ctx.rank),
            world,
        )
        kw = scale_kwargs(a, b)
        if self.collective == "all_gather":
            gemm_a = gathered_rows(a, world)
            kw = {**kw, "scale_a": kw["scale_a"].repeat(world, 1)} if kw else kw
        else:
            gemm_a = a
        # what the collective moves: the shard (fp8: its bytes), or the GEMM's output
        moved = gemm_a if self.collective == "all_gather" else library_mm(gemm_a, b, kw)
        comm = collective_call(
            self.collective, moved.numel() * moved.element_size(), moved.dtype, ctx.device, world, None
        )

        sequential = sequential_call(self.collective, a, b, world)
        got = sequential()
        err = rel_err(got, reference(self.collective, a, b, world))
        timing = dict(warmup=self.warmup, reps=self.reps)
        return dict(
            rel_err=err,
            has_nan=bool(got.isnan().any()),
            gemm=time_region(lambda: library_mm(gemm_a, b, kw), ctx.device, **timing),
            comm=time_region(comm, ctx.device, agree=True, **timing),
            sequential=time_region(sequential, ctx.device, agree=True, **timing),
        )
