"""Collectives issued straight through the process group, on the caller's stream.

``all_reduce_now``, ``reduce_scatter_now`` and ``all_gather_now`` skip torch.distributed's Python
wrappers, whose host time a small GEMM + collective does not hide; ``reduce_scatter_tensor`` and
``all_gather_tensor`` are torch's wrappers under the names this torch has; ``summed`` is the
traceable sum an autograd formula runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions  # (torch.distributed does not re-export it)

# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns);
# torch 2.11 (the GPU machines) has only the old one.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Likewise all_gather_into_tensor became all_gather_single.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _blocking(options):
    """``options`` for a collective the caller's stream waits for, as ``async_op=False`` asks
    (torch >= 2.8 then runs NCCL on the caller's stream; older torch has no such field)."""
    if hasattr(options, "asyncOp"):
        options.asyncOp = False
    return options


def all_reduce_now(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """``dist.all_reduce(tensor, group=group)`` (sum, in place) through the process group itself.

    Skips torch.distributed's Python wrappers (logging, coalescing and membership checks), about
    20 us of host time a call (docs/design.md#fallback), which the GPU time of a small GEMM + AllReduce
    does not hide. The caller must be a member of ``group`` and not inside a coalescing manager;
    torch function modes (Dynamo, export) do not see the call, unlike ``dist.all_reduce``.
    """
    pg = group if group is not None else dist.group.WORLD
    work = pg.allreduce([tensor], _blocking(dist.AllreduceOptions()))
    if work is not None:
        work.wait()


def reduce_scatter_now(out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """``reduce_scatter_tensor(out, full, group=group)`` (sum, dim 0) through the process group
    itself, as ``all_reduce_now``."""
    pg = group if group is not None else dist.group.WORLD
    call = getattr(pg, "reduce_scatter_single", None) or pg._reduce_scatter_base  # torch 2.13 / 2.11
    work = call(out, full, _blocking(dist.ReduceScatterOptions()))
    if work is not None:
        work.wait()


def all_gather_now(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """``all_gather_into_tensor(out, shard, group=group)`` (rank r's ``shard`` at rows
    [r*rows, (r+1)*rows) of ``out``, both contiguous) through the process group itself, as
    ``all_reduce_now``."""
    pg = group if group is not None else dist.group.WORLD
    call = getattr(pg, "all_gather_single", None) or pg._allgather_base  # torch 2.13 / 2.11
    work = call(out, shard, _blocking(AllgatherOptions()))
    if work is not None:
        work.wait()


def summed(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """``tensor`` summed over the group named ``group_name`` ("" for the default group), through
    torch's functional collectives: a new tensor, traced by torch.compile in an autograd formula."""
    name = group_name or dist.group.WORLD.group_name
    out = torch.ops._c10d_functional.all_reduce(tensor.contiguous(), "sum", name)
    return torch.ops._c10d_functional.wait_tensor(out)
