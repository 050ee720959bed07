"""Collective measurement tasks the worker pool runs on every rank: bandwidth sweeps over sizes and
NCCL CTA caps, and the interference of a collective and the signalled GEMM run at once.

Each task is a small frozen dataclass with ``run(ctx)``; it returns this rank's numbers and the
driver takes the max over ranks. Collectives run on the runtime's cached process group for the CTA
cap (``OverlapRuntime.comm_group``), so a sweep over caps builds one communicator per cap for the
whole command.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fo_kernels.collectives import all_gather_tensor, reduce_scatter_tensor
from fo_kernels.runtime import runtime_for
from fo_kernels.scaling import DEFAULT_OUT_DTYPE, is_fp8
from fo_kernels.schedule import torch_dtype
from fo_kernels.tile import Tile
from fo_tune.ranks.gemm import GEMM_TOL, gemm_operands, gemm_runner, rel_err
from fo_tune.ranks.pool import RankContext
from fo_tune.ranks.timing import Timing, time_region


def collective_call(
    collective: str, size: int, dtype: torch.dtype, device: torch.device, world: int, group: Any
) -> Callable[[], Any]:
    """A closure running ``collective`` on a ``size``-byte buffer (nccl-tests sizing). fp8 moves as
    bytes where the runtime moves it (a gather: ``fo_kernels.scaling.wire``); the sums of an fp8
    call are of its bfloat16 output."""
    if is_fp8(dtype):
        dtype = torch.uint8 if collective in ("all_gather", "all_to_all") else DEFAULT_OUT_DTYPE
    elem = torch.tensor([], dtype=dtype).element_size()
    count = max(world, size // elem // world * world)
    full = (
        torch.randn(count, device=device).to(dtype)
        if dtype.is_floating_point
        else torch.ones(count, dtype=dtype, device=device)
    )
    part = torch.empty(count // world, device=device, dtype=dtype)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if collective == "reduce_scatter":
        return lambda: reduce_scatter_tensor(part, full, group=group)
    if collective == "all_gather":
        return lambda: all_gather_tensor(full, part, group=group)
    if collective == "all_to_all":
        send, recv = uneven_splits(count, world, dist.get_rank(group))
        out = torch.empty(sum(recv), device=device, dtype=dtype)
        return lambda: dist.all_to_all_single(out, full, recv, send, group=group)
    raise ValueError(f"unknown collective {collective!r}")


def uneven_splits(count: int, world: int, rank: int) -> tuple[list[int], list[int]]:
    """(send, receive) splits of an All-to-All of ``count`` elements per rank, uneven as an MoE
    dispatch is: rank r sends peer (r + j) mod w a share in proportion to j + 1 (itself the
    smallest, the rank before it the largest), so every rank sends ``count`` elements, receives
    about as many (the cuts round down), and the pairs of ranks move different amounts."""
    weights = [(d - rank) % world + 1 for d in range(world)]
    total = sum(weights)
    cuts = [count * sum(weights[:d]) // total for d in range(world + 1)]
    send = [cuts[d + 1] - cuts[d] for d in range(world)]
    # what peer s sends me: its share for the distance (rank - s) mod w, cut the same way
    recv = []
    for s in range(world):
        theirs = [(d - s) % world + 1 for d in range(world)]
        edges = [count * sum(theirs[:d]) // total for d in range(world + 1)]
        recv.append(edges[rank + 1] - edges[rank])
    return send, recv


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
