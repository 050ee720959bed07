"""The ``triton`` engine's MoE path: NCCL point-to-point ring steps on the communication stream,
the grouped GEMMs on the caller's stream, each slot's rows consumed as they land and sent back as
they finish.

Rank r of w; at ring step j = 1 .. w-1 it sends to r + j and receives from r - j (dispatch), then
sends slot r - j back and receives its own rows from r + j (combine); so step j's peers pair up::

    main: rows = outgoing()       comm: for j: send rows for r+j; recv slot r-j; record landed[j]
    main: phase 1 of my own slot (its rows never leave this rank)
          for j: wait landed[j]; phase 1 of slot r-j      (the AllGather + GEMM pattern)
    main: phase 2 of slots r-1, r-2, ..., r-(w-1), r     (the GEMM + ReduceScatter pattern)
                                  comm: for j: wait slot r-j's rows are done; send them to r-j;
                                              recv my rows from r+j
    main: wait comm; finish (the weighted sum at the source)

The forward runs the Triton kernels (``fo_kernels.moe.kernels``): phase 1 one SwiGLU grouped GEMM
per slot, phase 2 one persistent grouped GEMM over every slot whose tiles count per slot in the
runtime's counters (the wait is ``cuStreamWaitValue32``, or the spin kernel, as the dense engine's).
The backward (and any stage) runs ``pipelined``: the stage's torch GEMMs per slot, each slot's
phase 2 recorded as an event the send waits for. My own slot runs last in phase 2: it sends
nothing, so its GEMM hides the last send. On the CPU there is no stream: the same steps run in
order (gloo point-to-point), which checks the decomposition, not the overlap.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from fo_kernels.moe.exchange import ring_step, row_bytes
from fo_kernels.moe.kernels import grouped_gemm, swiglu_gemm
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.moe.stages import ForwardStage, Stage
from fo_kernels.runtime import OverlapRuntime, runtime_for
from fo_kernels.tile import DeviceLimits

# The runtime's engine_state key of the CTA caps whose process group has run a collective.
READY = "moe.triton.groups"


def blocker(device: torch.device, world: int) -> str:
    """Why this process cannot run the path ("" when it can: any device, any backend with
    point-to-point sends)."""
    return ""


class _Ring:
    """One call's ring: the streams, the process group of the schedule's NCCL cap, the slots."""

    def __init__(self, stage: Stage, schedule: MoeSchedule, group: dist.ProcessGroup | None) -> None:
        self.stage, self.layout = stage, stage.layout
        self.rank, self.world = self.layout.rank, self.layout.world
        self.runtime: OverlapRuntime = runtime_for(stage.w13.device, group)
        self.group = self.runtime.comm_group(schedule.nccl_max_ctas)
        ready = self.runtime.engine_state.setdefault(READY, set())
        if schedule.nccl_max_ctas not in ready:  # once per group: its communicator exists before
            if self.runtime.backend == "nccl":  # a step where some pairs move nothing
                dist.all_reduce(torch.zeros(1, device=stage.w13.device), group=self.group)
            ready.add(schedule.nccl_max_ctas)
        self.comm = self.runtime.comm_stream
        self.main = torch.cuda.current_stream(stage.w13.device) if self.comm is not None else None
        self.steps = range(1, self.world)

    def on_comm(self):
        return torch.cuda.stream(self.comm) if self.comm is not None else contextlib.nullcontext()

    def event(self) -> torch.cuda.Event | None:
        if self.comm is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def source(self, j: int) -> int:
        return (self.rank - j) % self.world

    def dest(self, j: int) -> int:
        return (self.rank + j) % self.world

    def dispatch(self, rows: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Post every dispatch step on the communication stream; (received rows, landed events)."""
        lay = self.layout
        recv = rows.new_empty((lay.recv_offsets[-1], rows.shape[1]))
        send_off, recv_off = lay.send_offsets, lay.recv_offsets
        if self.comm is not None:
            self.comm.wait_stream(self.main)  # the rows (and everything before the call) are ready
        landed = []
        with self.on_comm():
            for j in self.steps:
                d, s = self.dest(j), self.source(j)
                ring_step(
                    [(d, rows[send_off[d] : send_off[d + 1]])],
                    [(s, recv[recv_off[s] : recv_off[s + 1]])],
                    self.group,
                )
                landed.append(self.event())
        return recv, landed

    def wait(self, event) -> None:
        if event is not None:
            self.main.wait_event(event)

    def combine_step(self, j: int, back_slot: torch.Tensor, ret: torch.Tensor) -> None:
        """Step j of the combine (on the communication stream): slot r-j's rows back, mine from r+j."""
        d, s = self.dest(j), self.source(j)
        off = self.layout.send_offsets
        ring_step([(s, back_slot)], [(d, ret[off[d] : off[d + 1]])], self.group)

    def own_rows(self, rows: torch.Tensor) -> torch.Tensor:
        off = self.layout.send_offsets
        return rows[off[self.rank] : off[self.rank + 1]]

    def finish(self, ret: torch.Tensor) -> torch.Tensor | None:
        if self.comm is not None:
            self.main.wait_stream(self.comm)
        return self.stage.finish(ret)


def run(stage: Stage, schedule: MoeSchedule, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """One call of ``stage`` on the Triton engine (see the module docstring)."""
    if isinstance(stage, ForwardStage):
        with DeviceLimits(schedule.tile, f"{stage.dtype} experts"):
            return _forward(stage, schedule, group)
    return pipelined(stage, schedule, group)


def pipelined(stage: Stage, schedule: MoeSchedule, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """Any stage, its torch GEMMs per slot, each slot sent back as its phase 2 ends."""
    ring = _Ring(stage, schedule, group)
    rows = stage.outgoing()
    recv, landed = ring.dispatch(rows)
    stage.first([stage.whole(ring.rank)], ring.own_rows(rows))
    for j, event in zip(ring.steps, landed, strict=True):
        ring.wait(event)
        piece = stage.whole(ring.source(j))
        r0, r1 = stage.piece_rows(piece)
        stage.first([piece], recv[r0:r1])
    ret = rows.new_empty((rows.shape[0], row_bytes(stage.back_parts)))
    for j in ring.steps:
        back = stage.second([stage.whole(ring.source(j))])
        done = ring.event()
        with ring.on_comm():
            if done is not None:
                ring.comm.wait_event(done)
            ring.combine_step(j, back, ret)
            if ring.comm is not None:
                back.record_stream(ring.comm)
    ring.own_rows(ret).copy_(stage.second([stage.whole(ring.rank)]))
    return ring.finish(ret)


def _forward(stage: ForwardStage, schedule: MoeSchedule, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The forward with the signalled grouped GEMM (see the module docstring)."""
    ring = _Ring(stage, schedule, group)
    lay, dtype, tile = stage.layout, stage.dtype, schedule.tile
    hidden, inter = stage.shape.hidden, stage.shape.intermediate
    w13, w2 = stage.w13.contiguous(), stage.w2.contiguous()
    grid = max(1, ring.runtime.sm_count - schedule.sms_free) if w13.is_cuda else 1
    rows = stage.outgoing()
    recv, landed = ring.dispatch(rows)
    x, x_recv = rows.view(dtype), recv.view(dtype)
    h = x.new_empty((lay.recv_offsets[-1], inter))
    experts = range(stage.shape.experts)

    def segments(slot: int, base: int, group: int = 0) -> list:
        at, out = base, []
        for e in experts:
            out.append((at, lay.recv[slot][e], e, group))
            at += lay.recv[slot][e]
        return out

    off = lay.recv_offsets
    r = ring.rank
    own = ring.own_rows(x)
    swiglu_gemm(own, w13, h[off[r] : off[r + 1]], segments(r, 0), tile, grid=grid)
    for j, event in zip(ring.steps, landed, strict=True):
        ring.wait(event)
        s = ring.source(j)
        swiglu_gemm(x_recv[off[s] : off[s + 1]], w13, h[off[s] : off[s + 1]], segments(s, 0), tile, grid=grid)
    # phase 2: every slot in one launch, slot r-1 first and mine last, a counter per slot
    order = [ring.source(j) for j in ring.steps] + [r]
    segs = [seg for s in order for seg in segments(s, off[s], s)]
    back = h.new_empty((off[-1], hidden))
    tiles_n = -(-hidden // tile.block_n)
    per_slot = [0] * ring.world
    for _row0, n, _e, s in segs:
        per_slot[s] += -(-n // tile.block_m) * tiles_n
    counters = ring.runtime.counters
    grouped_gemm(h, w2, back, segs, tile, grid=grid, counters=counters)
    targets = ring.runtime.reserve_tiles(per_slot)  # (after the launch, as the dense path does)
    ret = rows.new_empty((rows.shape[0], hidden * dtype.itemsize))
    waiter = ring.runtime.waiter(schedule.wait_mode) if ring.comm is not None else None
    with ring.on_comm():
        for j in ring.steps:
            s = ring.source(j)
            if waiter is not None:
                waiter.wait(counters, s, targets[s])
            ring.combine_step(j, back[off[s] : off[s + 1]].view(torch.uint8), ret)
    ring.own_rows(ret).copy_(back[off[r] : off[r + 1]].view(torch.uint8))
    return ring.finish(ret)
