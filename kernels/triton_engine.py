"""The ``triton`` engine: the signalled persistent Triton GEMM, NCCL per group as its tiles land.

    main stream:  [wait comm (previous call)] -> signalled GEMM -------------------> [restore]
    comm stream:  wait main (inputs ready) -> for each group g:                ^
                      wait counter[g] >= target[g]; collective(chunk g)  ------+ (main waits comm)

The GEMM (``fo_kernels.gemm.signalled_gemm``) runs on the caller's stream and signals each group's
counter as its tiles land; the high-priority communication stream waits per group
(``fo_kernels.wait``) and runs the collective on that group's contiguous chunk through
torch.distributed (NCCL on GPUs, with the schedule's CTA cap; gloo on the CPU, where the interpreter
has finished the GEMM before the first wait). Tile-major layouts are restored to row-major at the
end. On return the caller's stream is ordered after all of it. Geometry: ``fo_kernels.plan``.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch
import torch.distributed as dist

from .collectives import reduce_scatter_tensor
from .engines import Engine
from .gemm import BOperand, restore_tile_major, signalled_gemm
from .plan import make_plan
from .runtime import OverlapRuntime
from .schedule import Schedule, TritonSettings


class TritonEngine(Engine):
    """Engine ``triton`` (see the module docstring)."""

    name: ClassVar[str] = "triton"

    def blocker(self, device: torch.device, world_size: int) -> str:
        return ""  # the Triton GEMM and torch.distributed run on any device and backend

    def run(self, schedule: Schedule, a: torch.Tensor, b: BOperand, runtime: OverlapRuntime) -> torch.Tensor:
        if not a.is_contiguous():
            a = a.contiguous()
        return _overlapped(schedule, a, b, runtime)


def _overlapped(schedule: Schedule, a: torch.Tensor, b: BOperand, runtime: OverlapRuntime) -> torch.Tensor:
    st = schedule.settings
    assert isinstance(st, TritonSettings)
    collective = schedule.collective
    m, n = a.shape[0], b.tensor.shape[1]
    plan = make_plan(schedule, m, n, a.shape[1], sm_count=runtime.sm_count)
    tile = st.tile
    dev = a.device
    comm_group = runtime.comm_group(st.nccl_max_ctas)
    waiter = runtime.waiter(st.wait_mode)
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
    if comm is not None:
        main.wait_stream(comm)  # the previous call's collectives are done before this GEMM signals
        comm.wait_stream(main)  # and everything before the GEMM (inputs, buffers) precedes ours
    targets = runtime.reserve_targets(plan)
    signalled_gemm(
        a, b, buf, plan, tile, counters=runtime.counters, unit_group=unit_group, group_info=group_info
    )
    with torch.cuda.stream(comm) if comm is not None else contextlib.nullcontext():
        for g in range(plan.num_groups):
            waiter.wait(runtime.counters, g, targets[g])
            c0, c1 = plan.chunk_range(g)
            if collective == "all_reduce":
                dist.all_reduce(buf[c0:c1], group=comm_group)
            else:
                p0, p1 = plan.part_range(g)
                reduce_scatter_tensor(parts[p0:p1], buf[c0:c1], group=comm_group)
    if comm is not None:
        main.wait_stream(comm)
    if plan.layout == "tile_major":
        restore_tile_major(parts, out, plan, tile)
    return out
