"""The public overlapped ops: GEMM + AllReduce, GEMM + ReduceScatter and AllGather + GEMM.

Each public function is a call of its custom op (``torch.ops.fo_kernels.*``, ``fo_kernels.ops``:
what torch.compile and autograd see), or, where nothing needs the dispatcher (eager, plain
tensors, no gradient to record: ``fo_kernels.ops.direct_call``), a plain call of ``execute``.
``fo_kernels.execute.execute`` (the one eager path under both) checks the operands, resolves the
schedule and runs it. On return the caller's stream is ordered after all of the call's work.

Every op takes ``float8_e4m3fn`` operands with ``scale_a``, ``scale_b`` and ``out_dtype``, as
``torch._scaled_mm`` does (``fo_kernels.scaling``): tensorwise (0-dim float32 scales) or rowwise
(``scale_a`` (M, 1), ``scale_b`` (1, N)), the result in ``out_dtype`` (bfloat16 by default).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fo_kernels import ops
from fo_kernels.engines import EngineResult
from fo_kernels.errors import ScaleError, SignatureError
from fo_kernels.execute import check_local, check_tensors, execute
from fo_kernels.groups import group_name
from fo_kernels.refusal import refusal, refused, shape_of
from fo_kernels.scaling import DEFAULT_OUT_DTYPE, is_fp8, scale_type_problem
from fo_kernels.schedule import Schedule


def _call(
    collective: str,
    a: torch.Tensor,
    b: torch.Tensor,
    schedule: Schedule | None,
    group,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> EngineResult:
    if ops.direct_call(a, b, scale_a, scale_b):  # (plain tensors: the checks below are the scales')
        problem = scale_type_problem(scale_a, scale_b, out_dtype, a)
        if problem:
            raise ScaleError(problem)
        return execute(
            collective, a, b, schedule, group, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype
        )
    # Off the direct path (a trace, autograd, a DTensor, no tensor): a refused operand, traced, is the
    # refused op's output, which raises the eager call's error when the graph runs (Dynamo would
    # make its own error of a raise here); a refused group or schedule is the op's to raise.
    _, why = refusal(lambda: _operand_checks(a, b, scale_a, scale_b, out_dtype))
    if why is not None:
        return _refused_call(collective, why, a, b, group, out_dtype)
    name = group_name(group)
    return ops.op(collective)(a, b, name, ops.schedule_text(schedule), scale_a, scale_b, out_dtype)


def _operand_checks(a: object, b: object, scale_a: object, scale_b: object, out_dtype: object) -> None:
    """``_call``'s checks of its operands, scales and out_dtype, in this order: an operand that is no
    tensor (the ops' schema would refuse it with a RuntimeError), a scale or out_dtype the schema
    cannot take, a DTensor (torch's DTensor dispatch has no rule for the ops)."""
    check_tensors(a, b)
    problem = scale_type_problem(scale_a, scale_b, out_dtype, a)
    if problem:
        raise ScaleError(problem)
    check_local(a=a, b=b, scale_a=scale_a, scale_b=scale_b)


def _refused_call(
    collective: str, why: tuple[str, str], a: object, b: object, group: object, out_dtype: object
) -> EngineResult:
    """A traced call's output, of the shapes its op would give (1 for a size of an operand that is
    no matrix), whose op raises ``why`` when the graph runs."""
    m, k = shape_of(a) if len(shape_of(a)) == 2 else (1, 1)
    n = shape_of(b)[-1] if len(shape_of(b)) == 2 else 1
    world = ops.traced_world_size(group_name(group))
    fp8 = isinstance(a, torch.Tensor) and is_fp8(a.dtype)
    dtype = (out_dtype if isinstance(out_dtype, torch.dtype) else DEFAULT_OUT_DTYPE) if fp8 else None
    like = (a, b)
    if collective == "all_reduce":
        return refused(why, like, (m, n), dtype)
    if collective == "reduce_scatter":
        return refused(why, like, (m // world, n), dtype)
    return refused(why, like, (m * world, n), dtype), refused(why, like, (m * world, k))


def gemm_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    schedule: Schedule | None = None,
    group: dist.ProcessGroup | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``all_reduce(a @ b)`` over ``group``, with the GEMM and the AllReduce overlapped tile-wise.

    ``a`` is (M, K); ``b`` is (K, N), row-major or the transposed view of an (N, K) ``nn.Linear``
    weight. ``schedule=None`` looks one up (``lookup_schedule``). Returns the (M, N) sum.
    Differentiable: the gradients are two local GEMMs (``fo_kernels.ops``).

    fp8: ``a`` and ``b`` of dtype ``torch.float8_e4m3fn`` with float32 ``scale_a`` and ``scale_b``
    (0-dim each, or rowwise (M, 1) and (1, N)) give ``all_reduce((a * scale_a) @ (b * scale_b))``
    in ``out_dtype`` (bfloat16 by default; float16, float32), as ``torch._scaled_mm``. N and K
    must be multiples of 16. Inference only: a backward raises ``Fp8TrainingError``.
    """
    return _call("all_reduce", a, b, schedule, group, scale_a, scale_b, out_dtype)


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    schedule: Schedule | None = None,
    group: dist.ProcessGroup | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``reduce_scatter_tensor(a @ b)`` on dim 0: rank r gets rows [r*M/w, (r+1)*M/w) of the sum.

    Same operands (fp8 with its scales too) as ``gemm_all_reduce``; M must be divisible by the
    world size. Returns (M/w, N). Differentiable (not in fp8): the backward is ``all_gather_gemm``
    of the output's gradient.
    """
    return _call("reduce_scatter", a, b, schedule, group, scale_a, scale_b, out_dtype)


def all_gather_gemm(
    a_shard: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    schedule: Schedule | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    a: torch.Tensor | None = None,
) -> torch.Tensor:
    """``all_gather(a_shard) @ b``: every rank's (M/w, K) ``a_shard`` gathered on dim 0 (rank r's
    at rows [r*M/w, (r+1)*M/w)), then multiplied by ``b`` (K, N), the gathers overlapped with the
    GEMM chunk by chunk. A schedule's problem is the GEMM's, (M, N, K) with M the gathered rows.
    Returns (M, N). Differentiable: the backward is ``gemm_reduce_scatter`` of the output's gradient.

    fp8: ``a_shard`` and ``b`` in ``torch.float8_e4m3fn`` with ``scale_a`` (0-dim, the same on
    every rank; or rowwise this rank's (M/w, 1) rows) and ``scale_b`` (0-dim or (1, N)): the fp8
    shard and its scale rows are gathered (fp8 bytes on the wire), the product is in ``out_dtype``.

    ``a=`` names the shard too, as the other two ops name their first operand (give one of the two).
    """
    if (a_shard is None) == (a is None) or b is None:  # (traced: raised when the graph runs)
        _, why = refusal(lambda: _shard_of(a_shard, a, b))
        return _refused_call("all_gather", why, a_shard if a is None else a, b, group, out_dtype)[0]
    shard = a_shard if a_shard is not None else a
    return _call("all_gather", shard, b, schedule, group, scale_a, scale_b, out_dtype)[0]


def _shard_of(a_shard: object, a: object, b: object) -> None:
    """The ``SignatureError`` of an ``all_gather_gemm`` call not given its shard once (as
    ``a_shard`` or ``a=``) and ``b``."""
    if (a_shard is None) == (a is None):
        raise SignatureError("all_gather_gemm() takes this rank's shard once: as a_shard (first) or as a=")
    if b is None:
        raise SignatureError("all_gather_gemm() missing its second operand b (K, N)")
