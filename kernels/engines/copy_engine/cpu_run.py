"""What each operation of a copy-engine call does on the CPU executor's thread-ranks: the GEMMs as
torch matmuls (fp8: ``torch._scaled_mm``, each chunk's rows with their scales), copies between the
symmetric regions and the caller's tensors, and the flag cells set, waited for and reset under their
owner's lock. When and on which thread an operation runs is ``fo_kernels.engines.copy_engine.cpu``'s.

A rank that reads another rank's own tensor, waits for or resets a peer's cell, or sets a cell that
is still set raises ``ProtocolError`` naming the operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fo_kernels.engines.copy_engine.buffers import Dtypes, width_of
from fo_kernels.engines.copy_engine.layout import CALLER_BUFFERS, SCALES_OF, Cell, Rows, shifted
from fo_kernels.engines.copy_engine.ops import CallPlan, Clear, Copy, Gemm, Op, Reset, Signal, TiledGemm, Wait
from fo_kernels.errors import ProtocolError
from fo_kernels.scaling import Scales, scaled_mm

if TYPE_CHECKING:  # (annotations only: the executor makes the runners)
    from fo_kernels.engines.copy_engine.cpu import World


class CpuRun:
    """Runs one operation of a call on a FIFO worker (``CpuRank.call``); another protocol's runner
    (``fo_kernels.engines.copy_engine.moe_cpu``) extends it."""

    def __init__(
        self, world: World, rank: int, plan: CallPlan, tensors: dict, b: torch.Tensor, where: str
    ) -> None:
        self.world, self.rank, self.plan, self.tensors, self.b, self.where = (
            world,
            rank,
            plan,
            tensors,
            b,
            where,
        )

    def __call__(self, op: Op) -> None:
        getattr(self, type(op).__name__.lower())(op)

    def view(self, rows: Rows) -> torch.Tensor:
        spec = self.plan.spec
        if rows.buffer in CALLER_BUFFERS:
            if rows.owner != self.rank:
                raise ProtocolError(f"{self.where}: reads {rows}, another rank's own tensor")
            return self.tensors[rows.buffer][rows.r0 : rows.r1]
        width = width_of(rows.buffer, spec.n, spec.k)
        dtypes = Dtypes(self.tensors["a"].dtype, self.tensors["out"].dtype)
        return self.world.regions.view(rows, width, dtypes.of(rows.buffer))

    def scales(self, rows: Rows) -> Scales | None:
        """The fp8 scales of A's ``rows`` (rowwise: their rows of the matching scale buffer)."""
        scales = self.tensors["scales"]
        if scales is None or not scales.rowwise:
            return scales
        mine = Rows(SCALES_OF[rows.buffer], rows.owner, rows.r0, rows.r1)
        return scales.with_rows(self.view(mine).view(-1))

    def _mine(self, cell: Cell) -> None:
        if cell.owner != self.rank:
            raise ProtocolError(f"{self.where}: waits for or resets {cell}, which is not this rank's")

    def gemm(self, op: Gemm) -> None:
        a, out, scales = self.view(op.a), self.view(op.out), self.scales(op.a)
        if scales is not None:  # (the sum in a fused add after the scaled GEMM, as on GPUs)
            if op.beta:
                out.add_(scaled_mm(a, self.b, scales))
            else:
                scaled_mm(a, self.b, scales, out)
        elif op.beta:
            out.addmm_(a, self.b)
        else:
            torch.mm(a, self.b, out=out)

    def copy(self, op: Copy) -> None:
        self.view(op.dst).copy_(self.view(op.src))

    def signal(self, op: Signal) -> None:
        owner = op.cell.owner
        with self.world.locks[owner]:
            if self.world.cells[op.cell]:
                raise ProtocolError(f"{self.where}: sets {op.cell} while it is still set (a signal lost)")
            self.world.cells[op.cell] = 1
            self.world.changed(owner)

    def wait(self, op: Wait) -> None:
        self._mine(op.cell)
        cells = self.world.cells
        self.world.wait_until(
            self.rank,
            lambda: cells[op.cell] >= op.target,
            lambda: f"{self.where} waited for {op.cell} to reach {op.target} (it is {cells[op.cell]})",
        )

    def reset(self, op: Reset) -> None:
        self.clear(Clear(op.stream, op.cell, 1))

    def clear(self, op: Clear) -> None:
        self._mine(op.cell)
        with self.world.locks[self.rank]:
            for c in range(op.count):
                self.world.cells[shifted(op.cell, c)] = 0

    def tiledgemm(self, op: TiledGemm) -> None:
        """The persistent kernel, chunk by chunk: [wait ready(c)]; out[c] = a[c] @ B (+ out[c],
        summed in float32); [copy_to[c] = out[c]]; [counters(c) += tiles of c]."""
        a, out, scales = self.view(op.a), self.view(op.out), self.scales(op.a)
        copy = self.view(op.copy_to) if op.copy_to is not None else None
        for c, (c0, c1) in enumerate(op.chunks):
            if op.ready is not None:
                self.wait(Wait(op.stream, shifted(op.ready, c)))
            acc = a[c0:c1].float() @ self.b.float()
            if scales is not None:  # (the kernel's epilogue: the scales before the pulled sum)
                acc *= scales.rows(c0, c1).scale_a() * scales.scale_b()
            if op.ready is not None:
                acc += out[c0:c1].float()
            out[c0:c1] = acc.to(out.dtype)
            if copy is not None:
                copy[c0:c1].copy_(out[c0:c1])
            if op.counters is not None:
                cell = shifted(op.counters, c)
                with self.world.locks[cell.owner]:
                    self.world.cells[cell] += op.tiles[c]
                    self.world.changed(cell.owner)
