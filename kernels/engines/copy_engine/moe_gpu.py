"""The ``copy_engine`` MoE path on GPUs: ``protocol.build``'s list issued operation by operation,
the rows pushed into the peers' symmetric slots by the copy engines (no SM, no NCCL).

    Copy        cuMemcpyDtoDAsync(dst, src, bytes)              (a push when dst is a peer's slot)
    Signal      cuStreamWriteValue32(cell, 1)       (with its memory barrier: the data lands first)
    Wait        cuStreamWaitValue32(cell, target, GEQ)          (the GPU front end; no SM used)
    Reset       cuStreamWriteValue32(cell, 0)
    Record / WaitEvent / Join                                   torch events and stream waits
    Phase       stage.first / stage.second on the caller's stream (torch's grouped GEMMs)

``MoePeers`` (one per device and group, in the runtime's ``engine_state``) owns the symmetric flag
cells (``protocol.MoeFlags``) and the slots: ``inbox`` and ``outbox``, each world x S rows for S =
the largest token bound x k a call has needed, of the widest rows either direction sends (the
backward's: 2H elements + a float32). Every call's plan numbers the slots by that S and a call's
rows are packed from its slot's first byte (``protocol.slot_span``), so the slots never move
between calls of other bounds, k or row widths; a schedule with a larger bound grows them once,
collectively (every rank synchronizes, then all allocate). The plan comes from the counts the call exchanged
(on the host), so the path runs eagerly: a CUDA graph cannot hold a call whose copies' sizes
change with the routing.

Needs two or more GPUs with peer access (NVLink), cuda-bindings and torch's symmetric memory
(``fo_kernels.engines.copy_engine.peers.copy_engine_blocker``). Not run on GPUs yet: its list is
what the CPU executor runs in CI (``fo_kernels.engines.copy_engine.moe_cpu``) on 2 .. 8 thread-ranks.
Its Phases' kernels (the stage's grouped GEMMs, their shapes set by each call's routing) are not
loaded before the call's first flag wait, which the dense copy engine's warm-up does
(docs/design.md#kernel-loading): under CUDA's lazy module loading a first launch behind a pending
wait can block the host, so ``MoePeers`` warns unless ``CUDA_MODULE_LOADING=EAGER`` is set.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from fo_kernels.engines.copy_engine.layout import Cell, Rows
from fo_kernels.engines.copy_engine.moe_protocol import (
    CALLER,
    OUTGOING,
    MoeCall,
    MoeFlags,
    MoePlan,
    Phase,
    build,
    guard_cells,
    slot_span,
)
from fo_kernels.engines.copy_engine.ops import (
    LOCAL,
    SIDE,
    Copy,
    Join,
    Record,
    Reset,
    Signal,
    Wait,
    WaitEvent,
)
from fo_kernels.engines.copy_engine.peers import copy_engine_blocker, symmetric
from fo_kernels.errors import EnvironmentMismatchError
from fo_kernels.moe.exchange import row_bytes
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.moe.stages import Stage
from fo_kernels.runtime import runtime_for
from fo_kernels.wait import driver_module

STATE = "moe.copy_engine"  # the runtime's engine_state key
# What the path needs CUDA's module loading to be (the module docstring says why).
EAGER_LOADING = "EAGER"
# The widest float32 part a row carries (the backward's routing weight, and its gradient back).
_WEIGHT_BYTES = 4


def blocker(device: torch.device, world: int) -> str:
    """Why this rank cannot run the path ("" when it can): the copy engine's needs."""
    return copy_engine_blocker(device, world)


def run(stage: Stage, schedule: MoeSchedule, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """One call of ``stage`` through the copy engine (see the module docstring)."""
    runtime = runtime_for(stage.w13.device, group)
    peers = runtime.engine_state.get(STATE)
    if peers is None:
        peers = runtime.engine_state[STATE] = MoePeers(stage.w13.device, group)
    return peers.run(stage, schedule)


class MoePeers:
    """The MoE copy engine of one (GPU, process group): flags, slots, side streams, events."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.device, self.group = device, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        why = copy_engine_blocker(device, self.world)
        if why:
            raise EnvironmentMismatchError(f"engine copy_engine {why}")
        if os.environ.get("CUDA_MODULE_LOADING", "").upper() != EAGER_LOADING:
            warnings.warn(
                "engine copy_engine (MoE): its grouped GEMMs' kernels are not loaded before its first "
                "flag wait, and under CUDA's lazy module loading such a launch can block the host; "
                f"set CUDA_MODULE_LOADING={EAGER_LOADING} before the process starts CUDA",
                RuntimeWarning,
                stacklevel=3,
            )
        self.driver = driver_module()
        self.layout = MoeFlags(self.world)
        self.flags = symmetric(self.layout.slots, torch.int32, device, group, self.rank, self.world)
        mine = self.flags[self.rank]
        mine.zero_()
        mine[[self.layout.slot(c) for c in guard_cells(self.rank, self.world)]] = 1
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[device.index])
        self.streams = {name: torch.cuda.Stream(device, priority=-1) for name in (SIDE, LOCAL)}
        self.events: list[torch.cuda.Event] = []
        self.slots: dict[str, dict[int, torch.Tensor]] = {}
        self.capacity = (0, 0, 0)  # (S, out bytes, back bytes) the slots hold
        drv = self.driver
        self._geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._write_flag = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT

    def _reserve(self, slot_rows: int, hidden: int, dtype: torch.dtype) -> None:
        """Slots of ``slot_rows`` rows for calls of width ``hidden`` (both directions), grown
        collectively when a call needs more (every rank asks for the same: one schedule)."""
        need = (
            slot_rows,
            2 * hidden * dtype.itemsize + _WEIGHT_BYTES,
            hidden * dtype.itemsize + _WEIGHT_BYTES,
        )
        if all(n <= have for n, have in zip(need, self.capacity, strict=True)):
            return
        need = tuple(max(n, have) for n, have in zip(need, self.capacity, strict=True))
        if self.slots:  # every peer is done with the old slots (every call has ended everywhere)
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group, device_ids=[self.device.index])
        self.slots = {}
        rows = need[0] * self.world
        for name, width in (("inbox", need[1]), ("outbox", need[2])):
            self.slots[name] = symmetric(
                rows * width, torch.uint8, self.device, self.group, self.rank, self.world
            )
        self.capacity = need

    def run(self, stage: Stage, schedule: MoeSchedule) -> torch.Tensor | None:
        """``stage`` over the group (the caller checked the call against ``schedule``)."""
        shape = stage.shape
        self._reserve(schedule.problem.tokens_max * shape.top_k, shape.hidden, stage.dtype)
        lay = stage.layout
        # the slots as made, not this call's bound: they stay put between calls (protocol's S)
        plan = build(MoeCall(self.rank, lay.send, lay.recv, schedule.chunks, self.capacity[0]))
        send = stage.outgoing()
        widths = {"inbox": row_bytes(stage.out_parts), "outbox": row_bytes(stage.back_parts)}
        tensors = {
            "send": send,
            "back": send.new_empty((lay.recv_offsets[-1], widths["outbox"])),
            "ret": send.new_empty((send.shape[0], widths["outbox"])),
        }
        self._issue(plan, stage, tensors, widths)
        return stage.finish(tensors["ret"])

    # ------------------------------------------------------------------ issue
    def _view(self, rows: Rows, tensors: dict, widths: dict) -> torch.Tensor:
        if rows.buffer in CALLER:
            return tensors[rows.buffer][rows.r0 : rows.r1]
        width = widths[rows.buffer]
        slot_width = self.capacity[1 if rows.buffer == "inbox" else 2]
        b0, b1 = slot_span(rows, self.capacity[0], slot_width, width)
        return self.slots[rows.buffer][rows.owner][b0:b1].view(rows.count, width)

    def _cell(self, cell: Cell):
        return self.driver.CUdeviceptr(self.flags[cell.owner][self.layout.slot(cell) :].data_ptr())

    def _check(self, err, what: str) -> None:
        if err != self.driver.CUresult.CUDA_SUCCESS:
            why = f"{what} failed ({err})"
            raise EnvironmentMismatchError(f"engine copy_engine (MoE): {why}; restart the processes")

    def _issue(self, plan: MoePlan, stage: Stage, tensors: dict, widths: dict) -> None:
        drv = self.driver
        streams = dict(self.streams, main=torch.cuda.current_stream(self.device))
        handles = {name: drv.CUstream(s.cuda_stream) for name, s in streams.items()}
        while len(self.events) < 1 + sum(isinstance(op, Record) for op in plan.ops):
            self.events.append(torch.cuda.Event())
        for op in plan.ops:
            s = op.stream
            if isinstance(op, Phase):
                piece = (op.slot, *op.experts)
                with torch.cuda.stream(streams[s]):
                    if op.phase == 1:
                        stage.first([piece], self._view(op.rows, tensors, widths))
                    else:
                        self._view(op.rows, tensors, widths).copy_(stage.second([piece]))
            elif isinstance(op, Copy):
                if (op.dst.buffer in OUTGOING) != (op.src.buffer in OUTGOING):
                    raise EnvironmentMismatchError(f"copy of {op.src} into {op.dst}: rows of another width")
                dst, src = self._view(op.dst, tensors, widths), self._view(op.src, tensors, widths)
                (err,) = drv.cuMemcpyDtoDAsync(
                    drv.CUdeviceptr(dst.data_ptr()), drv.CUdeviceptr(src.data_ptr()), dst.numel(), handles[s]
                )
                self._check(err, "cuMemcpyDtoDAsync")
            elif isinstance(op, (Signal, Reset)):
                value = 1 if isinstance(op, Signal) else 0
                (err,) = drv.cuStreamWriteValue32(handles[s], self._cell(op.cell), value, self._write_flag)
                self._check(err, "cuStreamWriteValue32")
            elif isinstance(op, Wait):
                (err,) = drv.cuStreamWaitValue32(handles[s], self._cell(op.cell), op.target, self._geq)
                self._check(err, "cuStreamWaitValue32")
            elif isinstance(op, Record):
                self.events[op.event].record(streams[s])
            elif isinstance(op, WaitEvent):
                streams[s].wait_event(self.events[op.event])
            elif isinstance(op, Join):
                streams[s].wait_stream(streams[op.other])
            else:  # pragma: no cover - every kind the protocol builds is handled above
                raise TypeError(f"unknown operation {op!r}")
