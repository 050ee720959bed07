"""The ``copy_engine`` MoE path on GPUs: ``protocol.build``'s list issued operation by operation
(``moe_issue.MoeIssuer``), the rows pushed into the peers' symmetric slots by the copy engines (no
SM, no NCCL).

``MoePeers`` (one per device and group, in the runtime's ``engine_state``) owns the symmetric flag
cells (``protocol.MoeFlags``) and the slots: ``inbox`` and ``outbox``, each world x S rows for S =
the largest token bound x k a call has needed, of the widest rows either direction sends (the
backward's: 2H elements + a float32, ``moe_issue.grown_capacity``). Every call's plan numbers the slots
by that S and a call's rows are packed from its slot's first byte (``protocol.slot_span``), so the
slots never move between calls of other bounds, k or row widths; a schedule with a larger bound
grows them once, collectively (every rank synchronizes, then all allocate). The plan comes from the
counts the call exchanged (on the host), so the path runs eagerly: a CUDA graph cannot hold a call
whose copies' sizes change with the routing.

Needs two or more GPUs with peer access (NVLink), cuda-bindings and torch's symmetric memory
(``fo_kernels.engines.copy_engine.peers.copy_engine_blocker``). Its lists run on one GPU as
virtual ranks (``moe_virtual``: the GPU tests, N = 2 .. 8) and on the CPU executor in CI
(``moe_cpu``); their Phases may block the host (``moe_issue`` says why that cannot deadlock).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fo_kernels.engines.copy_engine.moe_issue import MoeIssuer, MoeMemory, call_tensors, grown_capacity
from fo_kernels.engines.copy_engine.moe_protocol import MoeCall, MoeFlags, build, guard_cells
from fo_kernels.engines.copy_engine.ops import LOCAL, SIDE
from fo_kernels.engines.copy_engine.peers import copy_engine_blocker, symmetric
from fo_kernels.errors import EnvironmentMismatchError
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.moe.stages import Stage
from fo_kernels.runtime import runtime_for
from fo_kernels.wait import driver_module

STATE = "moe.copy_engine"  # the runtime's engine_state key


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
        self.layout = MoeFlags(self.world)
        self.flags = symmetric(self.layout.slots, torch.int32, device, group, self.rank, self.world)
        mine = self.flags[self.rank]
        mine.zero_()
        mine[[self.layout.slot(c) for c in guard_cells(self.rank, self.world)]] = 1
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[device.index])
        streams = {name: torch.cuda.Stream(device, priority=-1) for name in (SIDE, LOCAL)}
        self.issuer = MoeIssuer(driver_module(), self.layout, streams, self._check)
        self.memory = MoeMemory(self.flags, {}, (0, 0, 0))

    def _reserve(self, schedule: MoeSchedule, stage: Stage) -> None:
        """Slots for ``stage`` under ``schedule`` (both directions), grown collectively when a call
        needs more (every rank asks for the same: one schedule)."""
        need = grown_capacity(self.memory.capacity, schedule, stage)
        if need is None:
            return
        if self.memory.slots:  # every peer is done with the old slots (every call has ended everywhere)
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group, device_ids=[self.device.index])
        self.memory = MoeMemory(self.flags, {}, (0, 0, 0))  # (the old slots freed first)
        rows = need[0] * self.world
        slots = {
            name: symmetric(rows * width, torch.uint8, self.device, self.group, self.rank, self.world)
            for name, width in (("inbox", need[1]), ("outbox", need[2]))
        }
        self.memory = MoeMemory(self.flags, slots, need)

    def run(self, stage: Stage, schedule: MoeSchedule) -> torch.Tensor | None:
        """``stage`` over the group (the caller checked the call against ``schedule``)."""
        self._reserve(schedule, stage)
        lay = stage.layout
        # the slots as made, not this call's bound: they stay put between calls (protocol's S)
        plan = build(MoeCall(self.rank, lay.send, lay.recv, schedule.chunks, self.memory.capacity[0]))
        tensors, widths = call_tensors(stage)
        main = torch.cuda.current_stream(self.device)
        for _ in self.issuer.steps(plan, stage, self.memory, tensors, widths, main):
            pass
        return stage.finish(tensors["ret"])

    def _check(self, err: object, what: str) -> None:
        if err != self.issuer.driver.CUresult.CUDA_SUCCESS:
            why = f"{what} failed ({err})"
            raise EnvironmentMismatchError(f"engine copy_engine (MoE): {why}; restart the processes")
