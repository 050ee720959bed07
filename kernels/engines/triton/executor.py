"""The ``triton`` engine's executor: runs one call of a schedule (see ``fo_kernels.engines.triton``
for the streams and the order)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from fo_kernels.collectives import all_gather_now, reduce_scatter_tensor
from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.gemm import BOperand, restore_tile_major, rows_gemm, signalled_gemm
from fo_kernels.plan import cdiv, make_plan
from fo_kernels.runtime import OverlapRuntime
from fo_kernels.scaling import Scales, gather_scales, out_dtype_of, wire
from fo_kernels.schedule import Schedule


def kmajor_fp8(b: BOperand) -> BOperand:
    """An fp8 B as the GPU's fp8 GEMM reads it: K-major (``b`` itself when it is the transposed view
    of an (N, K) weight, else a K-major copy; see ``fo_kernels.engines.triton``). The interpreter
    takes either layout."""
    if b.kmajor or not b.tensor.is_cuda:
        return b
    return BOperand(b.tensor.t().contiguous().t(), True)


def overlapped(
    schedule: Schedule,
    a: torch.Tensor,
    b: BOperand,
    runtime: OverlapRuntime,
    scales: Scales | None = None,
) -> torch.Tensor:
    """GEMM + AllReduce or ReduceScatter (``schedule.collective``): the signalled GEMM writes each group's
    chunk, and the comm stream runs the collective on a chunk as soon as its counter is complete; returns
    the (M, N) sum, or this rank's rows of it."""
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
    dtype = out_dtype_of(a, scales)
    out = torch.empty((out_rows, n), dtype=dtype, device=dev)
    buf = out.view(-1) if in_place else torch.empty(plan.buffer_numel(), dtype=dtype, device=dev)
    if collective == "all_reduce":
        parts = buf  # all_reduce is in place
    elif plan.layout == "row_band":
        parts = out.view(-1)
    else:
        parts = torch.empty(plan.tiles_per_shard * tile.block_m * tile.block_n, dtype=dtype, device=dev)

    comm = runtime.comm_stream
    main = torch.cuda.current_stream(dev) if comm is not None else None
    if comm is not None:
        main.wait_stream(comm)  # the previous call's collectives are done before this GEMM signals
        comm.wait_stream(main)  # and everything before the GEMM (inputs, buffers) precedes ours
    signalled_gemm(
        a, b, buf, plan, tile, counters=runtime.counters, unit_group=unit_group, group_info=group_info,
        scales=scales,
    )  # fmt: skip
    # (after the launch: a launch that raises, a tile too large for the GPU, leaves the totals as
    # the counters are)
    targets = runtime.reserve_targets(plan)
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


def gathered(
    schedule: Schedule,
    a: torch.Tensor,
    b: BOperand,
    runtime: OverlapRuntime,
    scales: Scales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AllGather + GEMM (see the module docstring): ``(gathered @ b, gathered)``; fp8: the shard's
    bytes gathered, rowwise its scale rows first."""
    st = schedule.settings
    assert isinstance(st, TritonSettings)
    world = runtime.world_size
    ms, k = a.shape
    m, n = ms * world, b.tensor.shape[1]
    plan = make_plan(schedule, m, n, k, sm_count=runtime.sm_count)
    dev = a.device
    comm_group = runtime.comm_group(st.nccl_max_ctas)
    staged = torch.empty((m, k), dtype=a.dtype, device=dev)  # chunk g at rows [w*i0, w*i1)
    gathered = torch.empty((m, k), dtype=a.dtype, device=dev)
    out = torch.empty((m, n), dtype=out_dtype_of(a, scales), device=dev)
    chunk_rows = max((i1 - i0 for i0, i1 in plan.group_rows), default=0)
    # the GEMM's tile-row groups: unused (nothing signals), but the kernel reads one per tile row
    row_group = torch.zeros(max(1, cdiv(chunk_rows, st.tile.block_m)), dtype=torch.int32, device=dev)
    comm = runtime.comm_stream
    main = torch.cuda.current_stream(dev) if comm is not None else None
    if comm is not None:
        comm.wait_stream(main)  # the shard (and everything before this call) precedes the gathers
    landed = []
    with torch.cuda.stream(comm) if comm is not None else contextlib.nullcontext():
        if scales is not None and scales.rowwise:  # every rank's scale rows, before any chunk's
            scales = gather_scales(scales, world, comm_group)
            if main is not None:  # (allocated on the comm stream, read by the main stream's GEMMs)
                scales.a.record_stream(main)
        for i0, i1 in plan.group_rows:
            chunk = staged[world * i0 : world * i1]
            if i1 > i0:
                all_gather_now(wire(chunk), wire(a[i0:i1]), comm_group)
            event = torch.cuda.Event() if comm is not None else None
            if event is not None:
                event.record(comm)
            landed.append(event)
            gathered.view(world, ms, k)[:, i0:i1].copy_(chunk.view(world, i1 - i0, k))
    for (i0, i1), event in zip(plan.group_rows, landed, strict=True):
        if i1 == i0:
            continue
        if event is not None:
            main.wait_event(event)
        rows = i1 - i0
        for s in range(world):
            src = staged[world * i0 + s * rows : world * i0 + (s + 1) * rows]
            mine = None if scales is None else scales.rows(s * ms + i0, s * ms + i1)
            rows_gemm(
                src, b, out[s * ms + i0 : s * ms + i1], st.tile, grid=plan.grid, row_group=row_group,
                scales=mine,
            )  # fmt: skip
    if comm is not None:
        main.wait_stream(comm)
    return out, gathered
