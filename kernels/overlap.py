"""The public overlapped ops: GEMM + AllReduce and GEMM + ReduceScatter, tile-wise overlapped.

    main stream:  [wait comm (previous call)] -> signalled GEMM -------------------> [restore]
    comm stream:  wait main (inputs ready) -> for each group g:                ^
                      wait counter[g] >= target[g]; collective(chunk g)  ------+ (main waits comm)

The GEMM runs on the caller's stream and signals each group's counter as its tiles land; the
high-priority communication stream waits per group and runs the collective on that group's
contiguous chunk through torch.distributed (NCCL on GPUs, gloo on the CPU, where the interpreter
has finished the GEMM before the first wait). Tile-major layouts are restored to row-major at the
end. On return the caller's stream is ordered after all of it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .collectives import reduce_scatter_tensor
from .errors import ScheduleError, ShapeError
from .gemm import BOperand, restore_tile_major, signalled_gemm
from .plan import Plan, make_plan
from .runtime import OverlapRuntime, runtime_for
from .schedule import COPY_ENGINE_WORLD, TORCH_DTYPES, Schedule, dtype_name
from .table import lookup_schedule


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> BOperand:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ShapeError("a and b must be torch tensors")
    if a.dim() != 2 or b.dim() != 2:
        raise ShapeError(f"a must be (M, K) and b (K, N); got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ShapeError(
            f"K mismatch: a is {tuple(a.shape)} and b is {tuple(b.shape)} (a.shape[1] != b.shape[0])"
        )
    if 0 in a.shape or b.shape[1] == 0:
        raise ShapeError(f"empty operand: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.dtype not in TORCH_DTYPES.values():
        raise ShapeError(f"dtype {a.dtype} is not supported; use bfloat16, float16 or float32")
    if b.dtype != a.dtype:
        raise ShapeError(f"a is {a.dtype} but b is {b.dtype}; both must have the same dtype")
    if a.device != b.device:
        raise ShapeError(f"a is on {a.device} but b is on {b.device}")
    operand = BOperand.of(b)
    if operand is None:
        raise ShapeError(
            "b must be row-major (K, N) or the transposed view of a contiguous (N, K) weight "
            f"(got strides {b.stride()}); call .contiguous() on it"
        )
    return operand


def _resolve_schedule(
    collective: str, a: torch.Tensor, n: int, schedule: Schedule | None, world: int
) -> Schedule:
    m, k = a.shape
    dtype = dtype_name(a.dtype)
    if schedule is None:
        return lookup_schedule(collective, m, n, k, dtype=dtype, world_size=world, device=a.device)
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"schedule: expected a fo_kernels.Schedule, got {type(schedule).__name__}")
    for name, want in (("collective", collective), ("dtype", dtype), ("world_size", world)):
        if getattr(schedule, name) != want:
            raise ScheduleError(
                f"{name}: the schedule says {getattr(schedule, name)!r}, this call needs {want!r}"
            )
    if not schedule.problem.covers(m, n, k):
        raise ScheduleError(
            f"problem: the schedule is for {schedule.problem.describe()}, called with {m}x{n}x{k}"
        )
    return schedule


def _overlapped(
    collective: str,
    a: torch.Tensor,
    b: BOperand,
    schedule: Schedule,
    runtime: OverlapRuntime,
    trace: list | None = None,
) -> torch.Tensor:
    """The overlapped call. ``trace`` (benchmarks only): a list that receives (name, cuda.Event)
    pairs recorded at the start, after the GEMM (main stream) and after each group's collective."""
    m, n = a.shape[0], b.tensor.shape[1]
    plan: Plan = make_plan(schedule, m, n, a.shape[1], sm_count=runtime.sm_count)
    tile = schedule.tile
    assert tile is not None
    dev = a.device
    comm_group = runtime.comm_group(schedule.nccl_max_ctas)
    waiter = runtime.waiter(schedule.wait_mode)
    unit_group, group_info = runtime.plan_tables(plan)

    in_place = collective == "all_reduce" and plan.layout == "row_band"
    out_rows = m if collective == "all_reduce" else plan.rows_per_shard
    out = torch.empty((out_rows, n), dtype=a.dtype, device=dev)
    buf = out.view(-1) if in_place else torch.empty(plan.buffer_numel(), dtype=a.dtype, device=dev)
    if collective == "all_reduce":
        parts = buf  # all_reduce is in place
    elif plan.layout == "row_band":
        parts = out.view(-1)
    else:
        parts = torch.empty(plan.tiles_per_shard * tile.block_m * tile.block_n, dtype=a.dtype, device=dev)

    comm = runtime.comm_stream
    main = torch.cuda.current_stream(dev) if comm is not None else None
    mark = _tracer(trace)
    mark("start", main)
    if comm is not None:
        main.wait_stream(comm)  # the previous call's collectives are done before this GEMM signals
        comm.wait_stream(main)  # and everything before the GEMM (inputs, buffers) precedes ours
    targets = runtime.reserve_targets(plan)
    signalled_gemm(
        a, b, buf, plan, tile, counters=runtime.counters, unit_group=unit_group, group_info=group_info
    )
    mark("gemm", main)
    with torch.cuda.stream(comm) if comm is not None else contextlib.nullcontext():
        for g in range(plan.num_groups):
            waiter.wait(runtime.counters, g, targets[g])
            mark(f"ready{g}", comm)
            c0, c1 = plan.chunk_range(g)
            if collective == "all_reduce":
                dist.all_reduce(buf[c0:c1], group=comm_group)
            else:
                p0, p1 = plan.part_range(g)
                reduce_scatter_tensor(parts[p0:p1], buf[c0:c1], group=comm_group)
            mark(f"group{g}", comm)
    if comm is not None:
        main.wait_stream(comm)
    if plan.layout == "tile_major":
        restore_tile_major(parts, out, plan, tile)
    return out


def _tracer(trace: list | None):
    """A function recording a timing event on a stream into ``trace``, or a no-op."""
    if trace is None:
        return lambda name, stream: None

    def mark(name: str, stream) -> None:
        if stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            trace.append((name, event))

    return mark


def _run(collective: str, a: torch.Tensor, b: torch.Tensor, schedule: Schedule | None, group) -> torch.Tensor:
    operand = _check_operands(a, b)
    if not dist.is_available() or not dist.is_initialized():
        raise ScheduleError("torch.distributed is not initialized; call dist.init_process_group first")
    runtime = runtime_for(a.device, group)
    world = runtime.world_size
    m = a.shape[0]
    if collective == "reduce_scatter" and m % world:
        raise ShapeError(f"reduce_scatter needs M divisible by the world size {world}, got M={m}")
    schedule = _resolve_schedule(collective, a, b.shape[1], schedule, world)
    if not schedule.overlap:
        return runtime.fallback().run(collective, a, b)
    if schedule.engine == "copy_engine":
        if m < COPY_ENGINE_WORLD:  # a rank would own no row (an M-range row reaching M = 1)
            return runtime.fallback().run(collective, a, b)
        engine = runtime.copy_engine()
        mode = "ring" if schedule.tile is None else "tiled"
        return engine.run(collective, a, b, mode=mode, weights=schedule.groups, tile=schedule.tile)
    if not a.is_contiguous():
        a = a.contiguous()
    return _overlapped(collective, a, operand, schedule, runtime)


def gemm_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    schedule: Schedule | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``all_reduce(a @ b)`` over ``group``, with the GEMM and the AllReduce overlapped tile-wise.

    ``a`` is (M, K); ``b`` is (K, N), row-major or the transposed view of an (N, K) ``nn.Linear``
    weight. ``schedule=None`` looks one up (``lookup_schedule``). Returns the (M, N) sum.
    """
    return _run("all_reduce", a, b, schedule, group)


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    schedule: Schedule | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``reduce_scatter_tensor(a @ b)`` on dim 0: rank r gets rows [r*M/w, (r+1)*M/w) of the sum.

    Same operands as ``gemm_all_reduce``; M must be divisible by the world size. Returns (M/w, N).
    """
    return _run("reduce_scatter", a, b, schedule, group)
