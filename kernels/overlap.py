"""The public overlapped ops: GEMM + AllReduce, GEMM + ReduceScatter and AllGather + GEMM.

Each public function is a call of its custom op (``torch.ops.fo_kernels.*``, ``fo_kernels.ops``:
what torch.compile and autograd see), or, where nothing needs the dispatcher (eager, plain
tensors, no gradient to record: ``fo_kernels.ops.direct_call``), a plain call of ``execute``.
``fo_kernels.execute.execute`` (the one eager path under both) checks the operands, resolves the
schedule and runs it. On return the caller's stream is ordered after all of the call's work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fo_kernels import ops
from fo_kernels.engines import EngineResult
from fo_kernels.execute import execute
from fo_kernels.groups import group_name
from fo_kernels.schedule import Schedule


def _call(
    collective: str, a: torch.Tensor, b: torch.Tensor, schedule: Schedule | None, group
) -> EngineResult:
    if ops.direct_call(a, b):
        return execute(collective, a, b, schedule, group)
    return ops.op(collective)(a, b, group_name(group), ops.schedule_text(schedule))


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
    Differentiable: the gradients are two local GEMMs (``fo_kernels.ops``).
    """
    return _call("all_reduce", a, b, schedule, group)


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    schedule: Schedule | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``reduce_scatter_tensor(a @ b)`` on dim 0: rank r gets rows [r*M/w, (r+1)*M/w) of the sum.

    Same operands as ``gemm_all_reduce``; M must be divisible by the world size. Returns (M/w, N).
    Differentiable: the backward is ``all_gather_gemm`` of the output's gradient.
    """
    return _call("reduce_scatter", a, b, schedule, group)


def all_gather_gemm(
    a_shard: torch.Tensor,
    b: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    schedule: Schedule | None = None,
) -> torch.Tensor:
    """``all_gather(a_shard) @ b``: every rank's (M/w, K) ``a_shard`` gathered on dim 0 (rank r's
    at rows [r*M/w, (r+1)*M/w)), then multiplied by ``b`` (K, N), the gathers overlapped with the
    GEMM chunk by chunk. A schedule's problem is the GEMM's, (M, N, K) with M the gathered rows.
    Returns (M, N). Differentiable: the backward is ``gemm_reduce_scatter`` of the output's gradient.
    """
    return _call("all_gather", a_shard, b, schedule, group)[0]
