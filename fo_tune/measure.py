"""Measurement tasks the worker pool runs on every rank: collectives, the signalled GEMM, both at once.

Each task is a small frozen dataclass with ``run(ctx)``; it returns this rank's numbers and the
driver takes the max over ranks. Collectives run on the runtime's cached process group for the CTA
cap (``OverlapRuntime.comm_group``), so a sweep over caps builds one communicator per cap for the
whole command. Every GEMM is checked against ``torch.matmul`` before it is timed.

The search's tasks (``OverlapTrialTask``, ``SequentialTask``, ``ConfirmTask``) run the op of the
schedule's collective on (M, N, K), M the GEMM's rows:

    all_reduce, reduce_scatter   a (M, K), b (K, N) per rank: collective(a @ b)
        reference: collective(a.float() @ b.float())
    all_gather                   a (M/w, K): this rank's shard; b (K, N) per rank: all_gather(a) @ b
        reference: all_gather(a.float()) @ b.float()   (rank r's shard at rows [r*M/w, (r+1)*M/w))

and GEMM then the collective (all_gather: the gather, then the GEMM) as the sequential baseline.
A schedule passes when no output holds a NaN and the relative error stays under ``GEMM_TOL`` on
every rank, on ``CHECK_INPUT_SETS`` input sets, each output poisoned with NaN once checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.gemm import BOperand, signalled_gemm
from fo_kernels.plan import cdiv, make_plan
from fo_kernels.runtime import reduce_scatter_tensor, runtime_for
from fo_kernels.schedule import Problem, Schedule, torch_dtype
from fo_kernels.tile import Tile
from fo_tune.launch import RankContext
from fo_tune.timing import Timing, comparison_sample_ms, time_interleaved, time_region

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 has the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Relative error a checked GEMM must stay under, per dtype (fp32 accumulation; docs/design.md#timing).
GEMM_TOL = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-4}


def collective_call(
    collective: str, size: int, dtype: torch.dtype, device: torch.device, world: int, group: Any
) -> Callable[[], Any]:
    """A closure running ``collective`` on a ``size``-byte buffer (nccl-tests sizing)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    count = max(world, size // elem // world * world)
    full = torch.randn(count, device=device).to(dtype)
    part = torch.empty(count // world, device=device, dtype=dtype)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if collective == "reduce_scatter":
        return lambda: reduce_scatter_tensor(part, full, group=group)
    if collective == "all_gather":
        return lambda: _all_gather(full, part, group=group)
    if collective == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    raise ValueError(f"unknown collective {collective!r}")


@dataclass(frozen=True)
class CollectiveSweepTask:
    """Time one collective over sizes on the communicator with CTA cap ``cap`` (0: NCCL default)."""

    collective: str
    sizes: tuple[int, ...]
    cap: int
    dtype: str
    warmup: int = 3
    reps: int = 10

    def run(self, ctx: RankContext) -> list[Timing]:
        group = runtime_for(ctx.device, None).comm_group(self.cap)
        out = []
        for size in self.sizes:
            fn = collective_call(
                self.collective, size, torch_dtype(self.dtype), ctx.device, ctx.world_size, group
            )
            dist.barrier()
            out.append(time_region(fn, ctx.device, warmup=self.warmup, reps=self.reps, agree=True))
        return out


def gemm_runner(
    a: torch.Tensor, b: torch.Tensor, tile: Tile, sms_free: int, sm_count: int
) -> tuple[Callable[[], torch.Tensor], int]:
    """The signalled persistent GEMM alone (one group, private counters): (run, grid)."""
    m, k = a.shape
    n = b.shape[1]
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    schedule = Schedule(
        collective="all_reduce",
        dtype="bfloat16",
        world_size=1,
        problem=Problem(m=m, n=n, k=k),
        settings=TritonSettings(
            tile=tile, sms_free=sms_free, signal_tiles=tiles, groups=(1,), layout="row_band"
        ),
    )
    plan = make_plan(schedule, m, n, k, sm_count=sm_count)
    counters = torch.zeros(4, dtype=torch.int32, device=a.device)
    unit_group = torch.zeros(1, dtype=torch.int32, device=a.device)
    group_info = torch.tensor([0, m], dtype=torch.int32, device=a.device)
    out = torch.empty(m * n, dtype=a.dtype, device=a.device)
    operand = BOperand.of(b)
    assert operand is not None

    def run() -> torch.Tensor:
        signalled_gemm(
            a, operand, out, plan, tile, counters=counters, unit_group=unit_group, group_info=group_info
        )
        return out.view(m, n)

    return run, plan.grid


def gemm_operands(m: int, n: int, k: int, dtype: str, device: torch.device, seed: int) -> tuple:
    """Random (never zero) A (M, K) and B as the transposed view of an (N, K) weight."""
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: large shapes stay fast
    a = torch.randn(m, k, generator=gen, device=device).to(torch_dtype(dtype))
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(torch_dtype(dtype))
    return a, w.t()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``|got - ref| / |ref|`` (Frobenius norms); ``inf`` when ``got`` holds a NaN or an infinity,
    so that a max over ranks or runs can never hide it (Python's ``max`` skips a NaN that is not
    first: ``max(0.002, nan)`` is 0.002, which would pass one rank's NaN output)."""
    err = ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if math.isfinite(err) else math.inf


def worst_error(errors: Sequence[float]) -> float:
    """The largest of ``errors``, NaN if any is NaN (a check that did not run, or one computed
    without ``rel_err``): Python's ``max`` would return the first argument over a later NaN."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _gemm_problem(m: int, n: int, k: int, dtype: str, device: torch.device) -> tuple:
    """(SMs, A, B, float32 reference A @ B) of one shape, the operands seeded by the shape, so that
    every task of a shape measures the same problem."""
    a, b = gemm_operands(m, n, k, dtype, device, seed=m + n + k)
    return runtime_for(device, None).sm_count, a, b, a.float() @ b.float()


@dataclass(frozen=True)
class GemmProfileTask:
    """Every tile config at every grid for one shape, checked, then timed beside cuBLAS: each
    config and cuBLAS in alternating back-to-back samples (``time_interleaved``, the comparison
    sample length), so both run at the card's sustained (power-limited) clock and each row's
    ``cublas`` is its own paired baseline. ``graphs``: each sample replays a CUDA graph of its
    calls (``time_interleaved(graphs=True)``), so a call whose host time exceeds its GPU time is
    timed by the GPU's; the output the timed calls wrote is checked again (poisoned before)."""

    m: int
    n: int
    k: int
    tiles: tuple[Tile, ...]
    sms_free: tuple[int, ...]
    dtype: str
    warmup: int = 3
    reps: int = 10
    graphs: bool = False

    def run(self, ctx: RankContext) -> dict[str, Any]:
        sm_count, a, b, ref = _gemm_problem(self.m, self.n, self.k, self.dtype, ctx.device)
        sample_ms = comparison_sample_ms(ctx.device.type == "cuda")
        cublas = time_interleaved(
            {"cublas": lambda: a @ b}, ctx.device, warmup=self.warmup, rounds=self.reps, graphs=self.graphs
        )["cublas"]
        rows = []
        for tile in self.tiles:
            for r in self.sms_free:
                row: dict[str, Any] = dict(tile=tile, sms_free=r, grid=0, timing=None, rel_err=float("nan"))
                try:
                    if r >= sm_count:
                        raise ValueError(f"sms_free {r} leaves no SM of {sm_count}")
                    run, row["grid"] = gemm_runner(a, b, tile, r, sm_count)
                    run().fill_(float("nan"))  # poisoned: a tile the check's call does not write fails it
                    out = run()
                    row["rel_err"] = _checked(out, ref, self.dtype)
                    paired = time_interleaved(
                        {"gemm": run, "cublas": lambda: a @ b},
                        ctx.device,
                        warmup=self.warmup,
                        rounds=self.reps,
                        min_sample_ms=sample_ms,
                        graphs=self.graphs,
                        before_samples=lambda out=out: out.fill_(float("nan")),  # the timed calls write it
                    )
                    row["rel_err"] = max(row["rel_err"], _checked(out, ref, self.dtype))
                    row["timing"], row["cublas"] = paired["gemm"], paired["cublas"]
                    row["status"] = "ok"
                except Exception as exc:  # a config that fails to compile or launch is skipped, with why
                    row["status"] = f"skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                rows.append(row)
        return {"cublas": cublas, "rows": rows}


def _checked(out: torch.Tensor, ref: torch.Tensor, dtype: str, what: str = "") -> float:
    """``out``'s relative error against ``ref``; ValueError beyond the dtype's tolerance, its
    message led by ``what`` (the config and when)."""
    err = rel_err(out, ref)
    if not err < GEMM_TOL[dtype]:
        raise ValueError(f"{what}wrong result (relative error {err:.2e})")
    return err


@dataclass(frozen=True)
class GemmGridsTask:
    """A few (tile, sms_free) configs of one shape, each checked against a float32 matmul (output
    poisoned first), then all of them and cuBLAS timed in one interleaved run (``time_interleaved``,
    the comparison sample length), so their ratios share one clock: ``GemmProfileTask`` times each
    config beside cuBLAS only, and ratios across its timings move with the card's drift. The
    outputs the timed calls wrote are checked again; ``graphs`` as ``GemmProfileTask``'s."""

    m: int
    n: int
    k: int
    configs: tuple[tuple[Tile, int], ...]
    dtype: str
    warmup: int = 3
    reps: int = 10
    graphs: bool = False

    def run(self, ctx: RankContext) -> dict[str, Any]:
        sm_count, a, b, ref = _gemm_problem(self.m, self.n, self.k, self.dtype, ctx.device)
        fns: dict[str, Callable[[], Any]] = {"cublas": lambda: a @ b}
        rows, outs = [], []
        for i, (tile, r) in enumerate(self.configs):
            run, grid = gemm_runner(a, b, tile, r, sm_count)
            run().fill_(float("nan"))  # poisoned: a tile the check's call does not write fails it
            out = run()
            err = _checked(out, ref, self.dtype, f"{tile.label()} on {grid} programs: ")
            fns[str(i)] = run
            outs.append(out)
            rows.append(dict(tile=tile, sms_free=r, grid=grid, rel_err=err))
        sample_ms = comparison_sample_ms(ctx.device.type == "cuda")

        def poison() -> None:  # after the warm-up and sizing calls: the timed calls must write it all
            for out in outs:
                out.fill_(float("nan"))

        timings = time_interleaved(
            fns,
            ctx.device,
            warmup=self.warmup,
            rounds=self.reps,
            min_sample_ms=sample_ms,
            graphs=self.graphs,
            before_samples=poison,
        )
        for i, row in enumerate(rows):
            what = f"{row['tile'].label()} on {row['grid']} programs, after the timed calls: "
            row["rel_err"] = max(row["rel_err"], _checked(outs[i], ref, self.dtype, what))
            row["timing"] = timings[str(i)]
        return {"rows": rows, "cublas": timings["cublas"]}


@dataclass(frozen=True)
class InterferenceTask:
    """The collective and the signalled GEMM on ``SMs - sms_free`` programs, alone and together."""

    collective: str
    size: int
    pairs: tuple[tuple[int, int], ...]  # (sms_free, nccl_max_ctas)
    gemm: tuple[int, int, int]
    tile: Tile
    dtype: str
    reps: int = 5

    def run(self, ctx: RankContext) -> list[dict[str, Any]]:
        rt = runtime_for(ctx.device, None)
        m, n, k = self.gemm
        a, b = gemm_operands(m, n, k, self.dtype, ctx.device, seed=7)
        ref = a.float() @ b.float()
        out = []
        for sms_free, cap in self.pairs:
            run, _grid = gemm_runner(a, b, self.tile, sms_free, rt.sm_count)
            err = rel_err(run(), ref)
            if not err < GEMM_TOL[self.dtype]:
                raise RuntimeError(f"signalled GEMM wrong before timing (relative error {err:.2e})")
            comm = collective_call(
                self.collective,
                self.size,
                torch_dtype(self.dtype),
                ctx.device,
                ctx.world_size,
                rt.comm_group(cap),
            )
            dist.barrier()
            gemm_alone = time_region(run, ctx.device, reps=self.reps)
            comm_alone = time_region(comm, ctx.device, reps=self.reps, agree=True)
            # every rank must launch the same number of collectives: agree on the ratio first
            ratio = torch.tensor([gemm_alone.median_ms / max(comm_alone.median_ms, 1e-6)], device=ctx.device)
            dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
            contended = self._together(ctx, run, comm, float(ratio))
            out.append(
                dict(sms_free=sms_free, cap=cap, gemm_alone=gemm_alone, comm_alone=comm_alone, **contended)
            )
        return out

    def _together(self, ctx: RankContext, gemm: Callable, comm: Callable, ratio: float) -> dict[str, Any]:
        """GEMM on this stream, back-to-back collectives covering it on the high-priority stream."""
        if ctx.device.type != "cuda":  # no streams on the CPU: one after the other
            g = time_region(gemm, ctx.device, reps=self.reps)
            c = time_region(comm, ctx.device, reps=self.reps, agree=True)
            return dict(
                gemm_with=g.median_ms, comm_with=c.median_ms, comm_during_gemm=False, concurrent=False
            )
        side = runtime_for(ctx.device, None).comm_stream
        main = torch.cuda.current_stream(ctx.device)
        count = max(1, round(ratio))
        gemm_ms, comm_ms, during = [], [], []
        for _ in range(self.reps + 1):
            dist.barrier()
            torch.cuda.synchronize(ctx.device)
            g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            marks = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(count)
            ]
            g0.record(main)
            gemm()
            g1.record(main)
            with torch.cuda.stream(side):
                side.wait_event(g0)
                for c0, c1 in marks:
                    c0.record(side)
                    comm()
                    c1.record(side)
            torch.cuda.synchronize(ctx.device)
            gemm_ms.append(g0.elapsed_time(g1))
            end = g0.elapsed_time(g1)
            started = [c0.elapsed_time(c1) for c0, c1 in marks if g0.elapsed_time(c0) < end] or [
                marks[0][0].elapsed_time(marks[0][1])
            ]
            comm_ms.append(sorted(started)[len(started) // 2])
            during.append(g0.elapsed_time(marks[0][1]) < end)
        gemm_ms, comm_ms, during = gemm_ms[1:], comm_ms[1:], during[1:]  # the first round warms up
        return dict(
            gemm_with=sorted(gemm_ms)[len(gemm_ms) // 2],
            comm_with=sorted(comm_ms)[len(comm_ms) // 2],
            comm_during_gemm=sum(during) * 2 > len(during),
            concurrent=True,
        )


def _collective_fp32(collective: str, full: torch.Tensor, world: int) -> torch.Tensor:
    """The float32 reference collective of a full (M, N) product (default process group)."""
    if collective == "all_reduce":
        dist.all_reduce(full)
        return full
    out = torch.empty((full.shape[0] // world, full.shape[1]), dtype=full.dtype, device=full.device)
    reduce_scatter_tensor(out, full)
    return out


def _gathered(shard: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's (rows, K) ``shard`` gathered on dim 0, rank r's at rows [r*rows, (r+1)*rows)."""
    out = torch.empty((shard.shape[0] * world, shard.shape[1]), dtype=shard.dtype, device=shard.device)
    _all_gather(out, shard.contiguous())
    return out


def call_operands(
    collective: str, m: int, n: int, k: int, dtype: str, device: torch.device, seed: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's operands of one call on (m, n, k): A (M, K), or for all_gather this rank's
    (M/w, K) shard; B (K, N) (``gemm_operands``)."""
    return gemm_operands(m // world if collective == "all_gather" else m, n, k, dtype, device, seed)


def reference(collective: str, a: torch.Tensor, b: torch.Tensor, world: int) -> torch.Tensor:
    """The op's result in float32 (the module docstring); every rank calls it at once."""
    if collective == "all_gather":
        return _gathered(a.float(), world) @ b.float()
    return _collective_fp32(collective, a.float() @ b.float(), world)


# Operand sets each schedule is checked on before it is timed: the op allocates its output with
# torch.empty, which can hand back a block still holding the previous correct result; a second,
# different input set makes such a stale result fail the check.
CHECK_INPUT_SETS = 2


def _op(collective: str) -> Callable[..., torch.Tensor]:
    from fo_kernels.overlap import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter

    ops = {
        "all_reduce": gemm_all_reduce,
        "reduce_scatter": gemm_reduce_scatter,
        "all_gather": all_gather_gemm,
    }
    return ops[collective]


def _check_schedule(ctx: RankContext, s: Schedule, m: int, n: int, k: int, seed: int) -> float:
    """The worst relative error of ``s`` over ``CHECK_INPUT_SETS`` fresh inputs (inf on NaN),
    the max over ranks (every rank learns whether to time it). Each output is poisoned with NaN
    once checked: a later call handed the same block that writes nothing then reads NaN."""
    op = _op(s.collective)
    worst = 0.0
    for i in range(CHECK_INPUT_SETS):
        a, b = call_operands(
            s.collective, m, n, k, s.dtype, ctx.device, (seed * 1009 + i) * 1009 + ctx.rank, ctx.world_size
        )
        out = op(a, b, schedule=s)
        ref = reference(s.collective, a, b, ctx.world_size)
        worst = max(worst, math.inf if bool(out.isnan().any()) else rel_err(out, ref))
        out.fill_(math.nan)
        del out
    flag = torch.tensor([worst], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item())


def _sequential_call(
    collective: str, a: torch.Tensor, b: torch.Tensor, world: int
) -> Callable[[], torch.Tensor]:
    """cuBLAS GEMM, then the collective on NCCL's default communicator (all_gather: the gather of
    the shard ``a``, then the GEMM)."""
    m, n = a.shape[0], b.shape[1]
    if collective == "all_gather":
        return lambda: _gathered(a, world) @ b

    def run() -> torch.Tensor:
        out = a @ b
        if collective == "all_reduce":
            dist.all_reduce(out)
            return out
        part = torch.empty((m // world, n), dtype=out.dtype, device=out.device)
        reduce_scatter_tensor(part, out)
        return part

    return run


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
    rounds: int = 15

    def run(self, ctx: RankContext) -> dict[str, Any]:
        s0 = self.schedules[0]
        errs = [_check_schedule(ctx, s, self.m, self.n, self.k, self.seed) for s in self.schedules]
        ok = [e < GEMM_TOL[s0.dtype] for e in errs]
        fallback = Schedule(
            collective=s0.collective,
            dtype=s0.dtype,
            world_size=ctx.world_size,
            problem=Problem(m=self.m, n=self.n, k=self.k),
        )
        fallback_ok = _check_schedule(ctx, fallback, self.m, self.n, self.k, self.seed) < GEMM_TOL[s0.dtype]
        a, b = call_operands(
            s0.collective,
            self.m,
            self.n,
            self.k,
            s0.dtype,
            ctx.device,
            self.seed * 1009 + ctx.rank,
            ctx.world_size,
        )
        fns: dict[str, Callable[[], Any]] = {
            "sequential": _sequential_call(s0.collective, a, b, ctx.world_size)
        }
        if fallback_ok:
            fns["fallback"] = lambda: _op(fallback.collective)(a, b, schedule=fallback)
        for i, s in enumerate(self.schedules):
            if ok[i]:
                fns[str(i)] = lambda s=s: _op(s.collective)(a, b, schedule=s)
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
        worst = _check_schedule(ctx, s, self.m, self.n, self.k, self.seed)
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
                self.seed * 1009 + ctx.rank,
                ctx.world_size,
            )
            op = _op(s.collective)
            timing = time_region(
                lambda: op(a, b, schedule=s), ctx.device, warmup=self.warmup, reps=self.reps, agree=True
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
            self.seed * 1009 + ctx.rank,
            world,
        )
        gemm_a = _gathered(a, world) if self.collective == "all_gather" else a
        moved = gemm_a if self.collective == "all_gather" else gemm_a @ b  # what the collective moves
        comm = collective_call(
            self.collective, moved.numel() * moved.element_size(), moved.dtype, ctx.device, world, None
        )

        sequential = _sequential_call(self.collective, a, b, world)
        got = sequential()
        err = rel_err(got, reference(self.collective, a, b, world))
        kw = dict(warmup=self.warmup, reps=self.reps)
        return dict(
            rel_err=err,
            has_nan=bool(got.isnan().any()),
            gemm=time_region(lambda: gemm_a @ b, ctx.device, **kw),
            comm=time_region(comm, ctx.device, agree=True, **kw),
            sequential=time_region(sequential, ctx.device, agree=True, **kw),
        )


@dataclass(frozen=True)
class CopyEngineProbeTask:
    """Whether these ranks can run ``engine: copy_engine``: "" when they can, else why not (the
    same answer on every rank). The cheap local checks are agreed on before the symmetric buffers
    are made, so a rank that cannot make them does not leave the other waiting in the rendezvous."""

    def run(self, ctx: RankContext) -> str:
        from fo_kernels.engines.copy_engine import copy_engine_blocker
        from fo_kernels.errors import EnvironmentMismatchError

        why = copy_engine_blocker(ctx.device, ctx.world_size)
        bad = torch.tensor([1 if why else 0], device=ctx.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if int(bad.item()):
            return f"engine copy_engine {why or 'cannot run on another rank'}"
        try:
            runtime_for(ctx.device, None).copy_engine()
        except EnvironmentMismatchError as exc:
            return str(exc)
        return ""
