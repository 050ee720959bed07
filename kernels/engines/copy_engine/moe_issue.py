"""One rank's MoE operation list issued on GPU streams, operation by operation: what the real ranks
(``moe_gpu.MoePeers``, one per process) and the virtual ranks (``moe_virtual``, N in one process)
share.

    Copy        cuMemcpyDtoDAsync(dst, src, bytes)              (a push when dst is a peer's slot)
    Signal      cuStreamWriteValue32(cell, 1)       (with its memory barrier: the data lands first)
    Wait        cuStreamWaitValue32(cell, target, GEQ)          (the GPU front end; no SM used)
    Reset       cuStreamWriteValue32(cell, 0)
    Record / WaitEvent / Join                                   torch events and stream waits
    Phase       stage.first / stage.second on the operation's stream (torch's grouped GEMMs)

``MoeMemory`` is what a rank's list addresses: every rank's flag cells (``protocol.MoeFlags``) and
slots (``inbox``, ``outbox``: world x S rows each of the widest rows a call sends that way,
``grown_capacity``), as the real ranks map their peers' symmetric memory or the virtual ranks hold
plain allocations. ``MoeIssuer.steps`` is a generator that issues one operation per step, so the
virtual ranks can interleave N ranks' lists in an order that completes (``virtual.issue_order``).
A Phase may block the host (a synchronizing torch op, a kernel's first load under CUDA's lazy
module loading); every rank issues its pushes before its first Phase, so no rank's blocked host
holds back what a peer waits for (the CPU executor checks it: ``CpuOptions.host_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fo_kernels.engines.copy_engine.layout import Cell, Rows
from fo_kernels.engines.copy_engine.moe_protocol import (
    CALLER,
    OUTGOING,
    MoeFlags,
    MoePlan,
    Phase,
    slot_span,
)
from fo_kernels.engines.copy_engine.ops import (
    MAIN,
    Copy,
    Join,
    Record,
    Reset,
    Signal,
    Wait,
    WaitEvent,
)
from fo_kernels.errors import ProtocolError
from fo_kernels.moe.exchange import row_bytes
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.moe.stages import Stage

# The widest float32 part a row carries (the backward's routing weight, and its gradient back).
WEIGHT_BYTES = 4
# An int32 flag cell's bytes.
CELL_BYTES = 4


def grown_capacity(
    have: tuple[int, int, int], schedule: MoeSchedule, stage: Stage
) -> tuple[int, int, int] | None:
    """The slots' capacity (S rows, inbox row bytes, outbox row bytes) a call of ``stage`` under
    ``schedule`` needs, grown from ``have`` (never shrunk); None when ``have`` holds it. S is the
    token bound x k; the rows are the widest either direction sends, the backward's (x, dy and a
    float32 weight out; dx and its weight's gradient back), whichever direction this call is."""
    item = stage.dtype.itemsize
    hidden = stage.shape.hidden
    need = (
        schedule.problem.tokens_max * stage.shape.top_k,
        2 * hidden * item + WEIGHT_BYTES,
        hidden * item + WEIGHT_BYTES,
    )
    if all(n <= h for n, h in zip(need, have, strict=True)):
        return None
    return tuple(max(n, h) for n, h in zip(need, have, strict=True))


@dataclass(frozen=True)
class MoeMemory:
    """What a rank's list addresses: ``flags[q]`` rank q's int32 cells; ``slots[name][q]`` rank
    q's ``inbox`` / ``outbox`` slots, flat bytes; ``capacity`` (S rows a slot, inbox row bytes,
    outbox row bytes), the same on every rank."""

    flags: Mapping[int, torch.Tensor]
    slots: Mapping[str, Mapping[int, torch.Tensor]]
    capacity: tuple[int, int, int]


def call_tensors(stage: Stage) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """A call's own tensors (``send``: the stage's outgoing rows, made on the current stream;
    ``back`` and ``ret``, new) and the row widths of its symmetric buffers."""
    send = stage.outgoing()
    widths = {"inbox": row_bytes(stage.out_parts), "outbox": row_bytes(stage.back_parts)}
    lay = stage.layout
    tensors = {
        "send": send,
        "back": send.new_empty((lay.recv_offsets[-1], widths["outbox"])),
        "ret": send.new_empty((send.shape[0], widths["outbox"])),
    }
    return tensors, widths


class MoeIssuer:
    """Issues one rank's MoE lists: its side streams, its events and the driver calls."""

    def __init__(
        self,
        driver: Any,
        layout: MoeFlags,
        streams: Mapping[str, Any],
        check: Callable[[object, str], None],
    ) -> None:
        self.driver, self.layout, self.streams, self._check = driver, layout, dict(streams), check
        self.events: list = []
        self._handles: dict[int, object] = {}
        self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._write_flag = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT

    def _handle(self, stream: Any) -> object:
        got = self._handles.get(stream.cuda_stream)
        if got is None:
            got = self._handles[stream.cuda_stream] = self.driver.CUstream(stream.cuda_stream)
        return got

    def _view(self, rows: Rows, memory: MoeMemory, tensors: dict, widths: dict) -> torch.Tensor:
        if rows.buffer in CALLER:
            return tensors[rows.buffer][rows.r0 : rows.r1]
        width = widths[rows.buffer]
        slot_width = memory.capacity[1 if rows.buffer == "inbox" else 2]
        b0, b1 = slot_span(rows, memory.capacity[0], slot_width, width)
        return memory.slots[rows.buffer][rows.owner][b0:b1].view(rows.count, width)

    def _cell(self, memory: MoeMemory, cell: Cell) -> object:
        flags = memory.flags[cell.owner]
        return self.driver.CUdeviceptr(flags.data_ptr() + CELL_BYTES * self.layout.slot(cell))

    def steps(
        self, plan: MoePlan, stage: Stage, memory: MoeMemory, tensors: dict, widths: dict, main: Any
    ) -> Iterator[None]:
        """Issue ``plan`` for ``stage``, one operation per step; ``main`` is the rank's main stream
        (the caller's, for a real rank)."""
        drv = self.driver
        streams = dict(self.streams)
        streams[MAIN] = main
        while len(self.events) < 1 + sum(isinstance(op, Record) for op in plan.ops):
            self.events.append(torch.cuda.Event())
        for op in plan.ops:
            s = op.stream
            if isinstance(op, Phase):
                piece = (op.slot, *op.experts)
                with torch.cuda.stream(streams[s]):
                    rows = self._view(op.rows, memory, tensors, widths)
                    if op.phase == 1:
                        stage.first([piece], rows)
                    else:
                        rows.copy_(stage.second([piece]))
            elif isinstance(op, Copy):
                if (op.dst.buffer in OUTGOING) != (op.src.buffer in OUTGOING):
                    raise ProtocolError(f"copy of {op.src} into {op.dst}: rows of another width")
                dst = self._view(op.dst, memory, tensors, widths)
                src = self._view(op.src, memory, tensors, widths)
                dst_ptr, src_ptr = drv.CUdeviceptr(dst.data_ptr()), drv.CUdeviceptr(src.data_ptr())
                (err,) = drv.cuMemcpyDtoDAsync(dst_ptr, src_ptr, dst.numel(), self._handle(streams[s]))
                self._check(err, "cuMemcpyDtoDAsync")
            elif isinstance(op, (Signal, Reset)):
                value = 1 if isinstance(op, Signal) else 0
                cell = self._cell(memory, op.cell)
                (err,) = drv.cuStreamWriteValue32(self._handle(streams[s]), cell, value, self._write_flag)
                self._check(err, "cuStreamWriteValue32")
            elif isinstance(op, Wait):
                cell = self._cell(memory, op.cell)
                (err,) = drv.cuStreamWaitValue32(self._handle(streams[s]), cell, op.target, self._geq)
                self._check(err, "cuStreamWaitValue32")
            elif isinstance(op, Record):
                self.events[op.event].record(streams[s])
            elif isinstance(op, WaitEvent):
                streams[s].wait_event(self.events[op.event])
            elif isinstance(op, Join):
                streams[s].wait_stream(streams[op.other])
            else:  # pragma: no cover - every kind the protocol builds is handled above
                raise TypeError(f"unknown operation {op!r}")
            yield
