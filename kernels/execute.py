"""``execute``: one eager call of an op, the path under both the custom ops and the direct calls.

It checks the operands and the group, resolves the schedule (the caller's, else
``lookup_schedule``) and runs it: ``overlap: false`` through the runtime's fallback
(``fo_kernels.fallback``: GEMM then the collective, or the gather then the GEMM), otherwise
through the engine the schedule names (``fo_kernels.engines``). Every check runs before the first
collective. fp8 operands come with ``scale_a``, ``scale_b`` and ``out_dtype``
(``fo_kernels.scaling``); their schedule is looked up under the operands' dtype, ``float8_e4m3fn``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fo_kernels.engines import EngineResult, check_collective, get_engine
from fo_kernels.errors import ScheduleError, ShapeError
from fo_kernels.fallback import one_rank
from fo_kernels.gemm import BOperand
from fo_kernels.groups import check_group, require_initialized
from fo_kernels.runtime import runtime_for
from fo_kernels.scaling import Scales, check_scales
from fo_kernels.schedule import TORCH_DTYPES, Schedule, dtype_name
from fo_kernels.table import lookup_schedule


def check_tensors(a: object, b: object) -> None:
    """``ShapeError`` naming an operand that is not a tensor (a list, a number)."""
    for what, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{what} must be a torch.Tensor (a 2-D matrix), got a {type(t).__name__}")


# What check_local suggests beside ``.to_local()`` for the dense ops, the fused ops and the layers:
# the styles are the way in for a model whose parameters are DTensors.
STYLES_HINT = ", or shard the module with fo_kernels.parallel's styles (DTensors)"


def check_local(hint: str = STYLES_HINT, /, **tensors: torch.Tensor) -> None:
    """``ShapeError`` naming an operand that is a DTensor: the ops take this rank's local tensors
    (torch's DTensor dispatch has no rule for them and raises its own error). ``hint`` follows the
    ``.to_local()`` remedy ("" where the styles do not apply, as for the MoE FFN)."""
    from torch.distributed.tensor import DTensor

    for what, t in tensors.items():
        if isinstance(t, DTensor):
            raise ShapeError(
                f"{what} is a DTensor ({t.placements}); the op takes this rank's local tensors: pass "
                f"{what}.to_local(){hint}"
            )


def check_shapes(a: torch.Tensor, b: torch.Tensor) -> None:
    """``ShapeError`` unless ``a`` is (M, K) and ``b`` (K, N)."""
    if a.dim() != 2 or b.dim() != 2:
        raise ShapeError(f"a must be (M, K) and b (K, N); got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ShapeError(
            f"K mismatch: a is {tuple(a.shape)} and b is {tuple(b.shape)} (a.shape[1] != b.shape[0])"
        )


def check_rows(collective: str, m: int, world: int) -> None:
    """``ShapeError`` for a ReduceScatter whose M the world size does not divide."""
    if collective == "reduce_scatter" and m % world:
        raise ShapeError(f"reduce_scatter needs M divisible by the world size {world}, got M={m}")


def _check_operands(
    collective: str,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[BOperand, Scales | None]:
    check_tensors(a, b)
    check_shapes(a, b)
    if 0 in a.shape or b.shape[1] == 0:
        raise ShapeError(
            f"empty operand: a {tuple(a.shape)}, b {tuple(b.shape)}; the ops run no empty GEMM: skip "
            "the call (no rows or outputs give an empty result, no features zeros), or call the layers "
            "or fo_kernels.symm_mem, which give torch's result for it"
        )
    scales = check_scales(collective, a, b, scale_a, scale_b, out_dtype)
    if a.dtype not in TORCH_DTYPES.values():
        raise ShapeError(
            f"dtype {a.dtype} is not supported; use bfloat16, float16, float32, or float8_e4m3fn with "
            "scale_a and scale_b"
        )
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
    return operand, scales


def _resolve_schedule(
    collective: str, a: torch.Tensor, n: int, schedule: Schedule | None, world: int
) -> Schedule:
    m, k = a.shape
    if collective == "all_gather":
        m *= world  # an all_gather's problem is its GEMM's: the gathered M
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
        gathered = ""
        if collective == "all_gather":  # (a caller may have given the shard's rows as M)
            gathered = f" (an all_gather's M is the gathered rows: {a.shape[0]} per rank x {world} ranks)"
        raise ScheduleError(
            f"problem: the schedule is for {schedule.problem.describe()}, called with {m}x{n}x{k}{gathered}"
        )
    return schedule


def check_meta_call(
    collective: str,
    a: torch.Tensor,
    b: torch.Tensor,
    schedule: Schedule | None,
    group: dist.ProcessGroup | None,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> None:
    """``execute``'s checks, for an eager call on meta tensors (a model built on the meta device,
    run for its shapes), which runs the op's fake implementation: no runtime, no collective."""
    _check_operands(collective, a, b, scale_a, scale_b, out_dtype)
    require_initialized()
    check_group(group)
    world = dist.get_world_size(group)
    check_rows(collective, a.shape[0], world)
    if schedule is not None:
        _resolve_schedule(collective, a, b.shape[1], schedule, world)


def execute(
    collective: str,
    a: torch.Tensor,
    b: torch.Tensor,
    schedule: Schedule | None,
    group: dist.ProcessGroup | None,
    *,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    own_graphs: bool = True,
) -> EngineResult:
    """One call of ``collective``'s op, eagerly: checks, schedule, then the fallback or the engine.
    ``scale_a``, ``scale_b``, ``out_dtype``: an fp8 call's (``fo_kernels.scaling``).
    ``own_graphs=False`` (a call through the custom op: compiled code, autograd) keeps the
    runtime's own CUDA graphs and output pools out of it: its outputs come from the caller's
    allocator, which a caller's CUDA graphs (torch.compile's ``reduce-overhead``) require."""
    operand, scales = _check_operands(collective, a, b, scale_a, scale_b, out_dtype)
    require_initialized()
    check_group(group)
    runtime = runtime_for(a.device, group)
    world = runtime.world_size
    check_rows(collective, a.shape[0], world)
    schedule = _resolve_schedule(collective, a, b.shape[1], schedule, world)
    if schedule.engine is None:
        if world == 1:  # one rank's collective is the identity: the GEMM alone
            return one_rank(collective, a, b, scales)
        if collective == "all_gather":
            return runtime.fallback().all_gather(a, b, scales=scales, own_graphs=own_graphs)
        return runtime.fallback().run(collective, a, b, scales=scales, own_graphs=own_graphs)
    engine = get_engine(schedule.engine)
    check_collective(engine, collective)
    return engine.run(schedule, a, operand, runtime, scales=scales, own_graphs=own_graphs)
