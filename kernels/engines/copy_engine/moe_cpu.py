"""The CPU executor of the MoE protocol: ``protocol.build``'s lists run by thread-ranks, on the
copy engine's CPU executor (``fo_kernels.engines.copy_engine.cpu``: one FIFO worker per stream,
random delays, a timeout on every wait, lost signals and unjoined streams refused).

Each thread-rank runs a real ``Stage`` (the same torch GEMMs as the no-overlap path), so a run
checks both that the list completes and that its result is right. The symmetric ``inbox`` and
``outbox`` are byte tensors every thread reads; ``send``, ``back`` and ``ret`` are the rank's own.
Used by the tests (N = 2 .. 8 ranks) and by nothing at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from fo_kernels.engines.copy_engine.cpu import CpuOptions, CpuRank, ProtocolError, run_ranks
from fo_kernels.engines.copy_engine.cpu_run import CpuRun
from fo_kernels.engines.copy_engine.moe_issue import call_tensors
from fo_kernels.engines.copy_engine.moe_protocol import (
    CALLER,
    OUTGOING,
    MoePlan,
    Phase,
    guard_cells,
    slot_span,
)
from fo_kernels.moe.stages import Stage

T = TypeVar("T")


@dataclass(frozen=True)
class Slots:
    """Every rank's symmetric slots: ``slot_rows`` rows a peer, rows of up to ``out_bytes``
    (``inbox``) and ``back_bytes`` (``outbox``), in flat bytes as the GPU's: a call's rows are
    packed from its slot's first byte (``protocol.slot_span``)."""

    world: int
    slot_rows: int
    out_bytes: int
    back_bytes: int

    def make(self) -> dict[int, dict[str, torch.Tensor]]:
        rows = self.slot_rows * self.world
        return {
            q: {
                "inbox": torch.zeros(rows * self.out_bytes, dtype=torch.uint8),
                "outbox": torch.zeros(rows * self.back_bytes, dtype=torch.uint8),
            }
            for q in range(self.world)
        }

    def width(self, buffer: str) -> int:
        """The bytes of a row of ``buffer``'s slots."""
        return self.out_bytes if buffer == "inbox" else self.back_bytes


class MoeRank:
    """A thread-rank of the MoE protocol and its calls (``call``)."""

    def __init__(self, rank: CpuRank, shared: dict[int, dict[str, torch.Tensor]], slots: Slots) -> None:
        self.rank, self.shared, self.slots = rank, shared, slots
        world = rank.world
        # (a peer sets one of these only after it has read what this rank pushed, so setting them
        # when the rank starts is in time)
        with world.locks[rank.rank]:
            for cell in guard_cells(rank.rank, world.size):
                world.cells[cell] = 1

    def call(self, plan: MoePlan, stage: Stage) -> torch.Tensor | None:
        """Run ``plan`` for ``stage`` and return ``stage.finish``'s result."""
        r = self.rank.rank
        if plan.call.rank != r or plan.call.world != self.rank.world.size:
            raise ProtocolError(f"rank {r} was given the plan of rank {plan.call.rank} of {plan.call.world}")
        if plan.call.slot_rows != self.slots.slot_rows:
            # a slot numbered by another S sits elsewhere: a push there could land on another
            # source's rows of the previous call that a peer has not read yet
            raise ProtocolError(
                f"rank {r}: the plan numbers slots of {plan.call.slot_rows} rows; the slots hold "
                f"{self.slots.slot_rows} (a plan takes the slots as made)"
            )
        tensors, widths = call_tensors(stage)
        if widths["inbox"] > self.slots.out_bytes or widths["outbox"] > self.slots.back_bytes:
            raise ProtocolError(f"rank {r}: the call needs larger slots than {self.slots}")
        world = self.rank.world
        self.rank.run_ops(
            plan.ops,
            lambda where: _MoeRun(world, r, tensors, self.shared, widths, stage, where, self.slots),
        )
        return stage.finish(tensors["ret"])


class _MoeRun(CpuRun):
    """Runs one operation of a MoE list (``Phase``, and the dense protocol's copies and flags)."""

    def __init__(
        self,
        world,
        rank: int,
        tensors: dict,
        shared: dict,
        widths: dict,
        stage: Stage,
        where: str,
        slots: Slots,
    ) -> None:
        super().__init__(world, rank, None, tensors, None, where)
        self.shared, self.widths, self.stage, self.slots = shared, widths, stage, slots

    def view(self, rows) -> torch.Tensor:
        if rows.buffer in CALLER:
            if rows.owner != self.rank:
                raise ProtocolError(f"{self.where}: reads {rows}, another rank's own tensor")
            return self.tensors[rows.buffer][rows.r0 : rows.r1]
        width = self.widths[rows.buffer]
        b0, b1 = slot_span(rows, self.slots.slot_rows, self.slots.width(rows.buffer), width)
        return self.shared[rows.owner][rows.buffer][b0:b1].view(rows.count, width)

    def copy(self, op) -> None:
        if (op.dst.buffer in OUTGOING) != (op.src.buffer in OUTGOING):
            raise ProtocolError(f"{self.where}: copies {op.src} into {op.dst}, rows of another width")
        super().copy(op)

    def phase(self, op: Phase) -> None:
        piece = (op.slot, *op.experts)
        if op.phase == 1:
            self.stage.first([piece], self.view(op.rows))
        else:
            self.view(op.rows).copy_(self.stage.second([piece]))


def run_moe_ranks(
    slots: Slots, body: Callable[[MoeRank], T], *, options: CpuOptions | None = None
) -> list[T]:
    """Run ``body(rank)`` on ``slots.world`` MoE thread-ranks whose symmetric slots are made
    first (as a real group's are, collectively); the results in rank order. The first failure
    of any thread is raised once every thread has stopped."""
    shared = slots.make()
    return run_ranks(
        slots.world, lambda rank: body(MoeRank(rank, shared, slots)), region_bytes=0, options=options
    )
