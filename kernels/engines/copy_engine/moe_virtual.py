"""Virtual ranks of the MoE copy engine: N ranks' expert-parallel calls in one process, on one GPU.

Two ranks cannot share a GPU through NCCL or torch's symmetric memory (``virtual``'s docstring), so
the MoE path's GPU executor runs its N ranks here as the dense copy engine's virtual ranks do:

    per rank r   its main, side and local streams, its int32 flag cells (``protocol.MoeFlags``)
                 and its inbox and outbox slots: plain allocations on the device that every rank's
                 ``moe_issue.MoeIssuer`` addresses as a peer's
    a call       each rank's tensors, checked as ``expert_parallel_ffn`` checks them; the counts
                 every rank would exchange, read from all ranks' routings on the host; each rank's
                 stage and its list (``protocol.build``, as a real rank builds it)
    issue        every rank's main stream waits for the caller's stream; the ranks' operations go
                 out in ``virtual.issue_order`` (each wait after the writes it waits for); the
                 caller's stream waits for every rank's main stream; then each rank's weighted sum

One host issues every rank's operations, so a wait issued before its writer would stop the host
(a Phase's synchronizing torch op) or the writer's hardware queue; the issue order rules both out,
and with it a kernel's first load under lazy module loading. The lists are the ones a real run
issues, so a run checks the protocol, the executor's addresses and copy sizes, and the stages on a
GPU; its time is N ranks' work on one GPU, not a rank's time on N GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fo_kernels.engines.copy_engine.moe_issue import MoeIssuer, MoeMemory, call_tensors, grown_capacity
from fo_kernels.engines.copy_engine.moe_protocol import MoeCall, MoeFlags, build, guard_cells
from fo_kernels.engines.copy_engine.ops import LOCAL, SIDE
from fo_kernels.engines.copy_engine.virtual import (
    DEFAULT_PRIORITY,
    HIGH_PRIORITY,
    VirtualDevice,
    issue_order,
)
from fo_kernels.errors import EnvironmentMismatchError, ScheduleError, ShapeError
from fo_kernels.moe.exchange import Layout
from fo_kernels.moe.routing import check_call, route
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.moe.stages import BackwardStage, ForwardStage, Stage

ENGINE = "copy_engine"  # the engine whose MoE lists these ranks run


class MoeVirtualRanks:
    """``world`` ranks of the MoE copy engine on one device (see the module docstring)."""

    def __init__(self, world: int, device: VirtualDevice) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 2:
            raise ShapeError(f"virtual ranks: the copy engine runs between at least 2 ranks, got {world!r}")
        self.world, self.dev = world, device
        self.layout = MoeFlags(world)
        self._ok = device.driver.CUresult.CUDA_SUCCESS
        self._broken = ""
        self.flags = {
            q: torch.zeros(self.layout.slots, dtype=torch.int32, device=device.device) for q in range(world)
        }
        for q in range(world):
            self.flags[q][[self.layout.slot(c) for c in guard_cells(q, world)]] = 1
        self._guards = [c for q in range(world) for c in guard_cells(q, world)]
        self._mains = [device.new_stream(DEFAULT_PRIORITY) for _ in range(world)]
        self._issuers = [
            MoeIssuer(
                device.driver,
                self.layout,
                {name: device.new_stream(HIGH_PRIORITY) for name in (SIDE, LOCAL)},
                self._check,
            )
            for _ in range(world)
        ]
        self.memory = MoeMemory(self.flags, {}, (0, 0, 0))
        device.synchronize()

    # ------------------------------------------------------------------ calls
    def forward(
        self,
        x: Sequence[torch.Tensor],
        topk_ids: Sequence[torch.Tensor],
        topk_weights: Sequence[torch.Tensor],
        w13: Sequence[torch.Tensor],
        w2: Sequence[torch.Tensor],
        schedule: MoeSchedule,
    ) -> list[torch.Tensor]:
        """Every rank's ``expert_parallel_ffn`` output (rank r's tensors at index r of each
        argument; its experts [r x E_local, (r + 1) x E_local)), in rank order."""
        stages = self._stages(x, topk_ids, topk_weights, w13, w2, schedule, None)
        return self._run(stages, schedule)

    def backward(
        self,
        dy: Sequence[torch.Tensor],
        x: Sequence[torch.Tensor],
        topk_ids: Sequence[torch.Tensor],
        topk_weights: Sequence[torch.Tensor],
        w13: Sequence[torch.Tensor],
        w2: Sequence[torch.Tensor],
        schedule: MoeSchedule,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every rank's gradients (dx, d topk_weights, dw13, dw2) for the output gradients ``dy``."""
        stages = self._stages(x, topk_ids, topk_weights, w13, w2, schedule, dy)
        self._run(stages, schedule)
        return [stage.grads() for stage in stages]

    def _stages(self, x, topk_ids, topk_weights, w13, w2, schedule, dy) -> list[BackwardStage | ForwardStage]:
        n = self.world
        named = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "w13": w13, "w2": w2}
        if dy is not None:
            named["dy"] = dy
        for name, seq in named.items():
            if isinstance(seq, torch.Tensor) or len(seq) != n:
                raise ShapeError(f"virtual ranks: {name} must be a sequence of {n} tensors, one a rank")
        if not isinstance(schedule, MoeSchedule) or schedule.engine != ENGINE:
            raise ScheduleError(
                f"virtual ranks run the MoE copy engine: pass a MoeSchedule with engine: {ENGINE}"
            )
        shapes = [check_call(x[r], topk_ids[r], topk_weights[r], w13[r], w2[r], n) for r in range(n)]
        for r, shape in enumerate(shapes):
            schedule.check_call(shape, x[r].dtype)
            if dy is not None and tuple(dy[r].shape) != tuple(x[r].shape):
                raise ShapeError(f"dy must have x's shape on every rank; rank {r}: {tuple(dy[r].shape)}")
        tokens = tuple(s.tokens for s in shapes)
        schedule.check_tokens(tokens)
        routings = [route(topk_ids[r], shapes[r]) for r in range(n)]
        stages: list[BackwardStage | ForwardStage] = []
        for r in range(n):
            recv = tuple(routings[s].host_counts[r] for s in range(n))
            common = (shapes[r], routings[r], Layout(r, routings[r].host_counts, recv, tokens), w13[r], w2[r])
            if dy is None:
                stages.append(ForwardStage(x[r], topk_weights[r], *common))
            else:
                stages.append(BackwardStage(dy[r], x[r], topk_weights[r], *common))
        return stages

    def _reserve(self, schedule: MoeSchedule, stage: Stage) -> None:
        """Every rank's slots for ``stage`` under ``schedule`` (grown, never shrunk)."""
        need = grown_capacity(self.memory.capacity, schedule, stage)
        if need is None:
            return
        self.dev.synchronize()  # no call still reads the old slots
        self.memory = MoeMemory(self.flags, {}, (0, 0, 0))
        rows, device = need[0] * self.world, self.dev.device
        slots = {
            name: {q: torch.zeros(rows * width, dtype=torch.uint8, device=device) for q in range(self.world)}
            for name, width in (("inbox", need[1]), ("outbox", need[2]))
        }
        self.memory = MoeMemory(self.flags, slots, need)

    def _run(self, stages: Sequence[Stage], schedule: MoeSchedule) -> list[torch.Tensor | None]:
        if self._broken:
            raise EnvironmentMismatchError(
                f"virtual ranks: an earlier call failed ({self._broken}); the ranks' flags are out of step"
            )
        self._reserve(schedule, stages[0])
        plans = [
            build(MoeCall(r, st.layout.send, st.layout.recv, schedule.chunks, self.memory.capacity[0]))
            for r, st in enumerate(stages)
        ]
        order = issue_order(plans, self._guards)
        calls = [call_tensors(st) for st in stages]  # on the caller's stream
        caller = self.dev.current_stream()
        for main in self._mains:
            main.wait_stream(caller)
        steps = [
            issuer.steps(plan, st, self.memory, tensors, widths, main)
            for issuer, plan, st, (tensors, widths), main in zip(
                self._issuers, plans, stages, calls, self._mains, strict=True
            )
        ]
        for r, _ in order:
            next(steps[r])
        for main in self._mains:
            caller.wait_stream(main)
        return [st.finish(tensors["ret"]) for st, (tensors, _) in zip(stages, calls, strict=True)]

    def _check(self, err: object, what: str) -> None:
        if err != self._ok:
            self._broken = f"{what} failed ({err})"
            raise EnvironmentMismatchError(f"virtual ranks: {self._broken}")
