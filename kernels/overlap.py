"""The public overlapped ops: GEMM + AllReduce and GEMM + ReduceScatter.

Each call checks its operands, resolves its schedule (the caller's, else ``lookup_schedule``) and
runs it: ``overlap: false`` through the runtime's fallback (``fo_kernels.fallback``: GEMM then the
collective), otherwise through the engine the schedule names (``fo_kernels.engines``). On return
the caller's stream is ordered after all of the call's work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .engines import get_engine
from .errors import ScheduleError, ShapeError
from .gemm import BOperand
from .runtime import runtime_for
from .schedule import TORCH_DTYPES, Schedule, dtype_name
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
    if schedule.engine is None:
        return runtime.fallback().run(collective, a, b)
    return get_engine(schedule.engine).run(schedule, a, operand, runtime)


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
