"""Rank functions for the multi-process tests (spawned processes import this module by name).

Every rank draws its own random operands from a seed that every other rank can recompute, so each
rank builds the float64 reference (sum over ranks of a_r @ b_r, then its dim-0 shard for
ReduceScatter) without any extra collective.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fo_kernels import (
    HeuristicScheduleWarning,
    Problem,
    RowParallelLinear,
    Schedule,
    ScheduleError,
    ShapeError,
    gemm_all_reduce,
    gemm_reduce_scatter,
)
from fo_kernels.schedule import torch_dtype

TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 1e-2}


@dataclass(frozen=True)
class Case:
    collective: str
    m: int
    n: int
    k: int
    dtype: str
    kmajor: bool
    schedule: dict | None  # Schedule.to_dict(), or None to look one up
    seed: int


def operands(case: Case, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed * 1009 + rank)
    dtype = torch_dtype(case.dtype)
    a = torch.randn(case.m, case.k, generator=gen).to(dtype)
    if case.kmajor:
        b = torch.randn(case.n, case.k, generator=gen).to(dtype).t()
    else:
        b = torch.randn(case.k, case.n, generator=gen).to(dtype)
    return a.to(device), b.to(device)


def reference(case: Case, rank: int, world: int) -> torch.Tensor:
    total = None
    for r in range(world):
        a, b = operands(case, r, torch.device("cpu"))
        prod = a.double() @ b.double()
        total = prod if total is None else total + prod
    assert total is not None
    if case.collective == "reduce_scatter":
        rows = case.m // world
        total = total[rank * rows : (rank + 1) * rows]
    return total


def poison_allocator(device: torch.device, numel: int, dtype: torch.dtype) -> None:
    """Leave NaN-filled memory of the output's size behind, for the op's allocation to reuse."""
    junk = torch.full((numel,), float("nan"), dtype=dtype, device=device)
    del junk


def prepared(case: Case, ctx):
    """(a, b, call) for ``case`` on this rank: ``call(a, b)`` runs the op with the case's schedule,
    or a lookup when it has none."""
    a, b = operands(case, ctx.rank, ctx.device)
    sched = Schedule.from_dict(case.schedule) if case.schedule is not None else None
    op = gemm_all_reduce if case.collective == "all_reduce" else gemm_reduce_scatter
    return a, b, functools.partial(op, schedule=sched)


def error(case: Case, got: torch.Tensor, ctx) -> tuple[float, torch.Tensor]:
    """(relative error against the float64 reference, the reference) of ``got`` on this rank."""
    ref = reference(case, ctx.rank, ctx.world_size)
    return ((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item(), ref


def refill(case: Case, seed: int, a: torch.Tensor, b: torch.Tensor, ctx) -> Case:
    """``case`` at another seed, its operands on this rank copied into a and b in place (the
    addresses a graph captured, or the runtime's graph keys on, stay the same)."""
    fresh = dataclasses.replace(case, seed=seed)
    new_a, new_b = operands(fresh, ctx.rank, ctx.device)
    a.copy_(new_a)
    b.copy_(new_b)
    return fresh


def check_then_poison(case: Case, got: torch.Tensor, ctx) -> tuple[float, bool]:
    """(relative error, whether it holds NaN) of ``got``, then ``got`` filled with NaN: the next
    call's output reuses its block, so a replay that wrote nothing would leave NaN there."""
    err, _ = error(case, got, ctx)
    nan = bool(got.isnan().any())
    got.fill_(float("nan"))
    return err, nan


def run_cases(ctx, cases: list[Case]) -> list[dict]:
    out = []
    for case in cases:
        a, b, op = prepared(case, ctx)
        poison_allocator(ctx.device, case.m * case.n * 2, a.dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = op(a, b)
        err, ref = error(case, got, ctx)
        out.append(
            dict(
                case=case,
                shape=tuple(got.shape),
                want_shape=tuple(ref.shape),
                err=err,
                nan=bool(got.isnan().any()),
                dtype_ok=got.dtype == a.dtype,
                heuristic_warnings=sum(issubclass(w.category, HeuristicScheduleWarning) for w in caught),
            )
        )
    return out


def bad_inputs(ctx, _payload) -> dict[str, str]:
    """Each bad call must raise a ValueError subclass with a message; returns name -> message."""
    dev, world = ctx.device, ctx.world_size
    a = torch.randn(4 * world, 8, device=dev)
    b = torch.randn(8, 6, device=dev)

    def no_overlap(collective: str, m: int) -> Schedule:  # an overlap: false row for (m, 6, 8)
        problem = dict(m=m, n=6, k=8)
        return Schedule.from_dict(
            dict(collective=collective, dtype="float32", world_size=world, problem=problem, overlap=False)
        )

    calls = {
        "k_mismatch": lambda: gemm_all_reduce(a, torch.randn(7, 6, device=dev)),
        "dtype_int": lambda: gemm_all_reduce(a.to(torch.int32), b.to(torch.int32)),
        "dtype_mixed": lambda: gemm_all_reduce(a, b.half()),
        "m_not_divisible": lambda: gemm_reduce_scatter(torch.randn(4 * world + 1, 8, device=dev), b),
        "not_2d": lambda: gemm_all_reduce(a[None], b),
        "b_strided": lambda: gemm_all_reduce(a, torch.randn(8, 12, device=dev)[:, ::2]),
        "schedule_other_shape": lambda: gemm_all_reduce(a, b, schedule=no_overlap("all_reduce", 99)),
        "schedule_other_collective": lambda: gemm_all_reduce(
            a, b, schedule=no_overlap("reduce_scatter", 4 * world)
        ),
    }
    msgs = {}
    for name, call in calls.items():
        try:
            call()
        except (ShapeError, ScheduleError) as exc:
            assert isinstance(exc, ValueError)
            msgs[name] = str(exc)
        else:
            msgs[name] = "NO ERROR"
    return msgs


def module_vs_linear(ctx, payload) -> list[float]:
    """RowParallelLinear.from_linear on every rank equals the full nn.Linear on the full input."""
    errs = []
    for collective in ("all_reduce", "reduce_scatter"):
        torch.manual_seed(1234)  # same full layer and input on every rank
        full = torch.nn.Linear(payload["in"], payload["out"], bias=True)
        x = torch.randn(payload["batch"], payload["seq"], payload["in"])
        want = full(x).detach()
        layer = RowParallelLinear.from_linear(full, sequence_parallel=collective == "reduce_scatter")
        cols = payload["in"] // ctx.world_size
        mine = x[..., ctx.rank * cols : (ctx.rank + 1) * cols]
        got = layer(mine).detach()
        if collective == "reduce_scatter":
            rows = payload["batch"] // ctx.world_size
            want = want[ctx.rank * rows : (ctx.rank + 1) * rows]
        assert got.shape == want.shape, (got.shape, want.shape)
        errs.append(((got - want).norm() / want.norm()).item())
    return errs


def table_dir_env(ctx, payload) -> str:
    return os.environ.get("FO_TUNE_TABLE_DIR", "")


def barrier_ok(ctx, _payload) -> bool:
    dist.barrier()
    return True


def run_back_to_back(ctx, cases: list[Case]) -> list[dict]:
    """Every case called once after another with no synchronisation in between (each on its own
    operands), then every output checked: a buffer that one call rewrites while the peer still reads
    the previous call's data shows up as a wrong output."""
    calls = []
    for case in cases:
        a, b, op = prepared(case, ctx)
        calls.append((case, op(a, b)))
    out = []
    for case, got in calls:
        err, ref = error(case, got, ctx)
        out.append(
            dict(
                case=case, err=err, nan=bool(got.isnan().any()), shape_ok=tuple(got.shape) == tuple(ref.shape)
            )
        )
    return out


def copy_engine_refusal(ctx, _payload) -> str:
    """The message an ``engine: copy_engine`` call gives where it cannot run (here: the CPU)."""
    from fo_kernels.errors import EnvironmentMismatchError

    schedule = Schedule.from_dict(
        dict(
            collective="all_reduce",
            dtype="float32",
            world_size=ctx.world_size,
            problem=dict(m=8, n=6, k=4),
            engine="copy_engine",
            settings=dict(mode="ring", weights=[1, 1]),
        )
    )
    try:
        gemm_all_reduce(torch.randn(8, 4), torch.randn(4, 6), schedule=schedule)
    except EnvironmentMismatchError as exc:
        return str(exc)
    return "no error"


def copy_engine_m1(ctx, _payload) -> float:
    """The relative error of an ``engine: copy_engine`` AllReduce called with M = 1."""
    case = Case(
        "all_reduce",
        1,
        6,
        4,
        "float32",
        False,
        dict(
            collective="all_reduce",
            dtype="float32",
            world_size=ctx.world_size,
            problem=dict(m_min=1, m_max=64, n=6, k=4),
            engine="copy_engine",
            settings=dict(mode="ring", weights=[1, 1]),
        ),
        13,
    )
    a, b, op = prepared(case, ctx)
    return error(case, op(a, b), ctx)[0]


def copy_engine_graph(ctx, cases: list[Case]) -> list[dict]:
    """Each ``engine: copy_engine`` case called once eagerly, then captured in a CUDA graph and
    replayed on new operands copied into the captured inputs, with an eager call of other operands
    between replays (the flags must come back to the same state after every call). Every replay's
    output is poisoned first and checked."""
    out = []
    for case in cases:
        a, b, op = prepared(case, ctx)
        op(a, b)  # the eager call that makes the buffers and checks the ranks agree
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = op(a, b)
        for step in range(3):
            fresh = refill(case, case.seed + 101 * (step + 1), a, b, ctx)
            captured.fill_(float("nan"))
            graph.replay()
            other = dataclasses.replace(case, seed=case.seed + 7919 * (step + 1))
            oa, ob, _ = prepared(other, ctx)
            eager = op(oa, ob)
            for what, got, which in (("replay", captured, fresh), ("eager", eager, other)):
                err, _ = error(which, got, ctx)
                out.append(dict(case=case, step=step, what=what, err=err, nan=bool(got.isnan().any())))
        del graph
    return out


def copy_engine_auto_graph(ctx, cases: list[Case]) -> list[dict]:
    """Eager ``engine: copy_engine`` calls whose addresses repeat run from the engine's own graph.

    Each case is called ``CALLS`` times on operands refreshed in place (the same addresses), each
    output checked, poisoned and freed (so the next call's output reuses its block): pass 0 with
    both ranks graphing, pass 1 with rank 1 issuing every call eagerly while rank 0 replays (the
    two ways must stay in step), then a larger shape grows the buffers (dropping the graphs) and
    the first case runs again. Returns one row per call, with the rank's replays during it."""
    from fo_kernels.engines.copy_engine import GRAPH_AFTER_CALLS
    from fo_kernels.runtime import runtime_for

    calls = GRAPH_AFTER_CALLS + 3
    peers = runtime_for(ctx.device, None).copy_engine()
    first = cases[0]
    bigger = {**first.schedule, "problem": {**first.schedule["problem"], "m": first.m * 4}}
    big = dataclasses.replace(first, m=first.m * 4, seed=first.seed + 1, schedule=bigger)
    plan = [(0, c) for c in cases] + [(1, c) for c in cases] + [(2, big), (3, first)]
    out = []
    for phase, case in plan:
        peers.graph_after = 0 if (phase == 1 and ctx.rank == 1) else GRAPH_AFTER_CALLS
        a, b, op = prepared(case, ctx)
        for step in range(calls):
            fresh = refill(case, case.seed + 31 * (step + 1), a, b, ctx)
            before = peers.call_counts()[1]
            got = op(a, b)
            err, nan = check_then_poison(fresh, got, ctx)
            del got
            replayed = peers.call_counts()[1] - before
            out.append(dict(case=case, phase=phase, step=step, err=err, nan=nan, replayed=replayed))
    peers.graph_after = GRAPH_AFTER_CALLS
    return out


def copy_engine_all_gather(ctx, cases: list[tuple[int, int, int, str, int, int]]) -> list[dict]:
    """The copy engine's AllGather + GEMM (``CopyEnginePeers.run_all_gather``) for (M, N, K,
    dtype, chunks, seed) cases: rank r's (M / w, K) shard of A and its own (K, N) B from seeds
    every rank can recompute, each case called ``GRAPH_AFTER_CALLS + 3`` times on operands
    refreshed in place (the engine's own graphs replay by the last calls) with the outputs checked
    and poisoned: the gathered A against every rank's shard, the product against float64."""
    from fo_kernels.engines.copy_engine import GRAPH_AFTER_CALLS
    from fo_kernels.runtime import runtime_for

    peers = runtime_for(ctx.device, None).copy_engine()
    w, out = ctx.world_size, []
    for m, n, k, dtype, chunks, seed in cases:

        def shard(q: int, step: int, m=m, k=k, dtype=dtype, seed=seed) -> torch.Tensor:
            gen = torch.Generator().manual_seed((seed * 1009 + step) * 31 + q)
            return torch.randn(m // w, k, generator=gen).to(torch_dtype(dtype))

        a = shard(ctx.rank, 0).to(ctx.device)
        b = torch.randn(k, n, generator=torch.Generator().manual_seed(seed + ctx.rank)).to(torch_dtype(dtype))
        b = b.to(ctx.device)
        for step in range(GRAPH_AFTER_CALLS + 3):
            a.copy_(shard(ctx.rank, step))
            before = peers.call_counts()[1]
            gathered, got = peers.run_all_gather(a, b, mode="ring", weights=(1,) * chunks)
            whole = torch.cat([shard(q, step) for q in range(w)]).double()
            ref = whole @ b.double().cpu()
            err = ((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            same = bool(torch.equal(gathered.cpu(), whole.to(gathered.dtype)))
            nan = bool(got.isnan().any())
            got.fill_(float("nan"))
            gathered.fill_(float("nan"))
            del got, gathered
            replayed = peers.call_counts()[1] - before
            out.append(dict(case=(m, n, k, dtype), step=step, err=err, same=same, nan=nan, replayed=replayed))
    return out


def fallback_auto_graph(ctx, cases: list[Case]) -> list[dict]:
    """``overlap: false`` calls whose addresses repeat run from the runtime's own graphs (on GPUs
    with NCCL; on the CPU every call is eager and this checks the results only).

    As ``copy_engine_auto_graph``, each case is called ``GRAPH_AFTER_CALLS + 3`` times on operands
    refreshed in place, each output checked, poisoned and freed. Phases: 0 both ranks graphing; 1
    rank 1 issuing eagerly while rank 0 replays (NCCL from a graph and eagerly, in step); 2 on
    another stream; 3 a bigger case (a ReduceScatter's scratch grows, dropping the graphs); 4 the
    first case again; 5 the first case inside the caller's own CUDA graph, replayed on new operands.
    Returns one row per call, with the rank's replays during it."""
    import contextlib

    from fo_kernels.graphs import GRAPH_AFTER_CALLS
    from fo_kernels.runtime import runtime_for

    calls = GRAPH_AFTER_CALLS + 3
    graphs = runtime_for(ctx.device, None).fallback().graphs
    on_gpu = graphs is not None
    side = torch.cuda.Stream(ctx.device) if on_gpu else None
    first = cases[0]
    bigger = {**first.schedule, "problem": {**first.schedule["problem"], "m": first.m * 4}}
    big = dataclasses.replace(first, m=first.m * 4, seed=first.seed + 1, schedule=bigger)
    plan = [(0, c) for c in cases] + [(1, c) for c in cases] + [(2, first), (3, big), (4, first)]
    out = []
    for phase, case in plan:
        if on_gpu:
            graphs.after = 0 if (phase == 1 and ctx.rank == 1) else GRAPH_AFTER_CALLS
        a, b, op = prepared(case, ctx)
        stream = torch.cuda.stream(side) if phase == 2 and on_gpu else contextlib.nullcontext()
        for step in range(calls):
            with stream:
                fresh = refill(case, case.seed + 31 * (step + 1), a, b, ctx)
                before = graphs.replays if on_gpu else 0
                got = op(a, b)
                err, nan = check_then_poison(fresh, got, ctx)
                del got
            replayed = (graphs.replays - before) if on_gpu else 0
            out.append(dict(case=case, phase=phase, step=step, err=err, nan=nan, replayed=replayed))
    if on_gpu:  # phase 5: the caller's own graph records the call (eagerly issued into it)
        a, b, op = prepared(first, ctx)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = op(a, b)
        for step in range(2):
            fresh = refill(first, first.seed + 97 * (step + 1), a, b, ctx)
            got.fill_(float("nan"))
            graph.replay()
            err, _ = error(fresh, got, ctx)
            out.append(dict(case=first, phase=5, step=step, err=err, nan=bool(got.isnan().any()), replayed=0))
        graphs.after = GRAPH_AFTER_CALLS
    return out


def fallback_cases(first_seed: int) -> list:
    """Two ``overlap: false`` cases, the ReduceScatter first (its bigger case grows the scratch)."""
    specs = [
        ("reduce_scatter", 256, 640, 256, "float16", False),
        ("all_reduce", 512, 768, 512, "bfloat16", True),
    ]
    cases = []
    for i, (collective, m, n, k, dtype, kmajor) in enumerate(specs):
        row = Schedule(collective=collective, dtype=dtype, world_size=2, problem=Problem(m=m, n=n, k=k))
        cases.append(Case(collective, m, n, k, dtype, kmajor, row.to_dict(), first_seed + i))
    return cases
