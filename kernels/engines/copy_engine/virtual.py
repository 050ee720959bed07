"""Virtual ranks: N ranks of the copy engine in one process, on one GPU.

Two ranks cannot share a GPU through NCCL ("Duplicate GPU detected") or torch's symmetric memory
("detected allocations from overlapping devices"); one process can hold every rank's buffers on one
device instead (docs/design.md#virtual-ranks). ``VirtualRanks`` is N ranks of the engine there:

    per rank r   its streams (main, alt, side, local, notify), its int32 flag cells and tile
                 counters, its data regions: plain allocations on the device that every rank's
                 executor (a ``gpu.GpuExecutor`` of rank r) addresses as a peer's
    plan         each rank's operation list from the mode (``modes.plan_call``, as a real rank
                 builds it), compiled by that rank's executor
    warm-up      on the first call of a plan with these operands' alignments: every kernel the
                 plans launch runs once, the device synchronized around it (``warmup.py``)
    issue        every rank's main stream waits for the caller's stream; the ranks' steps go out
                 in ``issue_order``; the caller's stream waits for every rank's main stream

``issue_order`` interleaves the ranks' lists, each in its own order, so that every flag wait is
issued after the writes it waits for: a sequential run of all ranks' operations in that order
completes. One host issues all of them, and the streams of N ranks share the GPU's hardware queues;
a wait queued ahead of its writer on a shared queue would block the writer. The persistent Triton
kernels of the tiled mode get ``sms // N`` SMs each, so every rank's kernel can be resident while
its tiles wait for a peer's flags.

The lists are the ones a real run issues, so a virtual run checks the protocol and the GPU executor
on one GPU; its time is N ranks' work on one GPU, not a rank's time on N GPUs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fo_kernels.engines.copy_engine.buffers import (
    Dtypes,
    Regions,
    data_bytes,
    region_bytes_for,
    scale_bytes_for,
)
from fo_kernels.engines.copy_engine.gpu import Compiled, GpuExecutor
from fo_kernels.engines.copy_engine.layout import COUNTER_SLOTS, Cell, FlagLayout, shifted
from fo_kernels.engines.copy_engine.modes import plan_call
from fo_kernels.engines.copy_engine.ops import (
    ALT,
    LOCAL,
    NOTIFY,
    SIDE,
    CallPlan,
    Clear,
    Reset,
    Signal,
    TiledGemm,
    Wait,
)
from fo_kernels.engines.copy_engine.warmup import SCRATCH_ALIGN
from fo_kernels.errors import EnvironmentMismatchError, ProtocolError, ScheduleError, ShapeError, install_hint
from fo_kernels.fingerprint import resolve_device
from fo_kernels.gemm import BOperand
from fo_kernels.scaling import Scales
from fo_kernels.tile import Tile

# Stream priorities, as ``CopyEnginePeers`` makes them: the copy and flag streams high (-1), the
# chunk GEMMs' second stream and each rank's main stream at the caller's default (0).
HIGH_PRIORITY, DEFAULT_PRIORITY = -1, 0


@dataclass(frozen=True)
class VirtualDevice:
    """What the virtual ranks use of a device: the CUDA driver module (cuda-bindings), a stream
    factory (priority -> stream), the caller's current stream, whether it is capturing, a device
    synchronization and the SM count (``cuda_device`` gives a GPU's; CPU tests pass fakes)."""

    device: torch.device
    driver: Any
    new_stream: Callable[[int], Any]
    current_stream: Callable[[], Any]
    capturing: Callable[[], bool]
    synchronize: Callable[[], None]
    sms: int


def cuda_device(device: torch.device | int | str = "cuda") -> VirtualDevice:
    """``device``'s ``VirtualDevice``; ``ArgumentError`` for what is not a device,
    ``EnvironmentMismatchError`` without a CUDA GPU or cuda-bindings (``resolve_device``)."""
    from fo_kernels.wait import driver_module

    device = resolve_device(device)
    if device.type != "cuda":
        raise EnvironmentMismatchError(f"virtual ranks run on a CUDA GPU; got {device}")
    driver = driver_module()
    if driver is None:
        raise EnvironmentMismatchError(f"virtual ranks need cuda-bindings ({install_hint('cuda')})")
    return VirtualDevice(
        device=device,
        driver=driver,
        new_stream=lambda priority: torch.cuda.Stream(device, priority=priority),
        current_stream=lambda: torch.cuda.current_stream(device),
        capturing=torch.cuda.is_current_stream_capturing,
        synchronize=lambda: torch.cuda.synchronize(device),
        sms=torch.cuda.get_device_properties(device).multi_processor_count,
    )


def issue_order(plans: Sequence[Any], guards: Iterable[Cell] | None = None) -> tuple[tuple[int, int], ...]:
    """(rank, operation index) of every rank's operations (``plans[r].ops``), each rank's in list
    order, such that running them one after another in that order completes: every ``Wait`` (and
    every tiled kernel's in-kernel wait on its ``ready`` cells) comes after the writes that satisfy
    it, the flags starting as a call finds them: ``guards`` set (left out: the dense protocol's).
    ``ProtocolError`` when no such order exists (the lists would hang on one shared queue)."""
    world = len(plans)
    cells: dict[Cell, int] = defaultdict(int)
    if guards is None:
        layout = FlagLayout(world)
        guards = [cell for q in range(world) for cell in layout.guards(q)]
    for cell in guards:
        cells[cell] = 1
    ops = [plan.ops for plan in plans]
    at = [0] * world
    order: list[tuple[int, int]] = []

    def blocked(op) -> bool:
        if isinstance(op, Wait):
            return cells[op.cell] < op.target
        if isinstance(op, TiledGemm) and op.ready is not None:
            return any(cells[shifted(op.ready, c)] < 1 for c in range(len(op.chunks)))
        return False

    def run(op) -> None:
        if isinstance(op, Signal):
            cells[op.cell] = 1
        elif isinstance(op, Reset):
            cells[op.cell] = 0
        elif isinstance(op, Clear):
            for c in range(op.count):
                cells[shifted(op.cell, c)] = 0
        elif isinstance(op, TiledGemm) and op.counters is not None:
            for c, tiles in enumerate(op.tiles):
                cells[shifted(op.counters, c)] += tiles

    while any(at[r] < len(ops[r]) for r in range(world)):
        moved = False
        for r in range(world):
            while at[r] < len(ops[r]) and not blocked(ops[r][at[r]]):
                run(ops[r][at[r]])
                order.append((r, at[r]))
                at[r] += 1
                moved = True
        if not moved:
            stuck = "; ".join(
                f"rank {r} at op {at[r]} {ops[r][at[r]]}" for r in range(world) if at[r] < len(ops[r])
            )
            raise ProtocolError(f"the ranks' operation lists have no issue order that completes: {stuck}")
    return tuple(order)


@dataclass(frozen=True)
class VirtualPlan:
    """Every rank's plan of one call shape, compiled, and the order their steps are issued in
    (``eager``: (rank, index into ``Compiled.eager``); ``captured``: into ``Compiled.captured``)."""

    key: tuple
    plans: tuple[CallPlan, ...]
    compiled: tuple[Compiled, ...]
    dtypes: Dtypes
    eager: tuple[tuple[int, int], ...]
    captured: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class VirtualResult:
    """Every rank's output of one call (and all_gather's gathered A), in rank order."""

    outs: list[torch.Tensor]
    gathered: list[torch.Tensor] | None


class VirtualRanks:
    """``world`` ranks of the copy engine on one device (see the module docstring)."""

    def __init__(self, world: int, device: VirtualDevice) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 2:
            raise ShapeError(f"virtual ranks: the copy engine runs between at least 2 ranks, got {world!r}")
        self.world, self.dev = world, device
        self.layout = FlagLayout(world)
        self._ok = device.driver.CUresult.CUDA_SUCCESS
        self._broken = ""
        flags = {
            q: torch.zeros(self.layout.slots, dtype=torch.int32, device=device.device) for q in range(world)
        }
        for q in range(world):
            flags[q][[self.layout.slot(c) for c in self.layout.guards(q)]] = 1
        self._mains = [device.new_stream(DEFAULT_PRIORITY) for _ in range(world)]
        share = max(1, device.sms // world)  # every rank's persistent kernel resident at once
        self._executors = []
        for r in range(world):
            streams = {name: device.new_stream(HIGH_PRIORITY) for name in (SIDE, LOCAL, NOTIFY)}
            streams[ALT] = device.new_stream(DEFAULT_PRIORITY)
            counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device.device)
            self._executors.append(
                GpuExecutor(device.driver, r, self.layout, streams, flags, counters, share, self._check)
            )
        self._plans: dict[tuple, VirtualPlan] = {}
        self._warm: set[tuple] = set()
        self._capacity = self._scale_capacity = 0
        self._captured = False
        device.synchronize()

    # ------------------------------------------------------------------ plans
    def plan(
        self,
        collective: str,
        m: int,
        n: int,
        k: int,
        dtypes: Dtypes,
        *,
        mode: str = "ring",
        weights: tuple[int, ...] = (1, 1),
        tile: Tile | None = None,
        row_scales: bool = False,
    ) -> VirtualPlan:
        """Every rank's compiled plan of this call (made once per shape; the regions grow to hold
        it, which a captured graph forbids)."""
        key = (collective, mode, m, n, k, dtypes, tuple(weights), tile, row_scales)
        got = self._plans.get(key)
        if got is not None:
            return got
        plans = tuple(
            plan_call(mode, collective, self.world, r, m, n, k, tuple(weights), tile, row_scales)
            for r in range(self.world)
        )
        eager = issue_order(plans)
        skip = plans[0].prologue
        captured = tuple((r, i - skip) for r, i in eager if i >= skip)
        self._reserve(max(region_bytes_for(p, dtypes) for p in plans), max(scale_bytes_for(p) for p in plans))
        compiled = tuple(ex.compile(p, dtypes) for ex, p in zip(self._executors, plans, strict=True))
        got = self._plans[key] = VirtualPlan(key, plans, compiled, dtypes, eager, captured)
        return got

    def _reserve(self, region_bytes: int, scale_bytes: int) -> None:
        """Every rank's regions at least ``region_bytes`` each (and the scales region)."""
        if region_bytes <= self._capacity and scale_bytes <= self._scale_capacity:
            return
        if self._captured:
            raise ScheduleError(
                "virtual ranks: this call needs larger peer buffers than a captured CUDA graph uses; run "
                "the largest shape eagerly before capturing any graph (the buffers cannot move under it)"
            )
        region_bytes, scale_bytes = max(region_bytes, self._capacity), max(scale_bytes, self._scale_capacity)
        self.dev.synchronize()  # no call still reads the old regions
        self._plans.clear()
        self._warm.clear()
        nbytes = data_bytes(self.world, region_bytes, scale_bytes)
        data = {q: torch.zeros(nbytes, dtype=torch.uint8, device=self.dev.device) for q in range(self.world)}
        regions = Regions(self.world, region_bytes, data, scale_bytes)
        for ex in self._executors:
            ex.regions = regions
        self._capacity, self._scale_capacity = region_bytes, scale_bytes

    # ------------------------------------------------------------------ calls
    def run(
        self,
        collective: str,
        a: Sequence[torch.Tensor],
        b: Sequence[torch.Tensor],
        *,
        mode: str = "ring",
        weights: tuple[int, ...] = (1, 1),
        tile: Tile | None = None,
        scales: Sequence[Scales] | None = None,
    ) -> VirtualResult:
        """``collective(a[r] @ b[r])`` over the virtual ranks, each rank's output new (as
        ``CopyEnginePeers.run``: all_gather's ``a[r]`` is rank r's (M / N, K) shard)."""
        if len(a) != self.world or len(b) != self.world:
            raise ShapeError(f"virtual ranks: expected {self.world} operands each, got {len(a)} and {len(b)}")
        gather = collective == "all_gather"
        rows, k = a[0].shape
        n = b[0].shape[1]
        if (
            any(t.shape != a[0].shape for t in a)
            or any(t.shape != b[0].shape for t in b)
            or b[0].shape[0] != k
        ):
            raise ShapeError("virtual ranks: every rank's A must be (M, K) and its B (K, N), the same shapes")
        m = rows * self.world if gather else rows
        if tile is not None or gather:  # (read by the kernel, or copied: as CopyEnginePeers does)
            a = [t.contiguous() for t in a]
        out_dtype = scales[0].out_dtype if scales else a[0].dtype
        if scales:  # K-major B, as torch._scaled_mm reads it
            b = [t if t.stride(0) == 1 else t.t().contiguous().t() for t in b]
        row_scales = gather and bool(scales) and scales[0].rowwise
        vp = self.plan(
            collective, m, n, k, Dtypes(a[0].dtype, out_dtype),
            mode=mode, weights=weights, tile=tile, row_scales=row_scales,
        )  # fmt: skip
        device = self.dev.device
        outs = [torch.empty((p.out_rows, n), dtype=out_dtype, device=device) for p in vp.plans]
        gathered = [torch.empty((m, k), dtype=a[0].dtype, device=device) for _ in a] if gather else None
        self.issue(vp, a, b, outs, gathered, scales=scales)
        return VirtualResult(outs, gathered)

    def issue(
        self,
        vp: VirtualPlan,
        a: Sequence[torch.Tensor],
        b: Sequence[torch.Tensor],
        outs: Sequence[torch.Tensor],
        gathered: Sequence[torch.Tensor] | None = None,
        *,
        scales: Sequence[Scales] | None = None,
    ) -> None:
        """Issue one call of ``vp`` into the given tensors on the caller's stream (inside a
        capture: recorded into the caller's graph, which a first eager call of the same tensors'
        alignments must precede)."""
        if self._broken:
            raise EnvironmentMismatchError(
                f"virtual ranks: an earlier call failed ({self._broken}); the ranks' flags are out of step"
            )
        tile, row_scales = vp.plans[0].spec.tile, vp.plans[0].spec.row_scales
        calls = []
        for r, ex in enumerate(self._executors):
            rows_scale = None  # an fp8 all_gather's gathered rowwise scales
            if row_scales:
                rows_scale = torch.empty((vp.plans[r].spec.m, 1), dtype=torch.float32, device=self.dev.device)
            operand = BOperand.of(b[r]) if tile is not None else None
            mine = None if not scales else scales[r]
            got = None if gathered is None else gathered[r]
            main = self._mains[r]
            calls.append(
                ex.bind(a[r], b[r], outs[r], main, got, operand, mine, rows_scale, main_current=False)
            )
        if tile is not None and any(c.operand is None for c in calls):
            raise ShapeError(
                "virtual ranks with a tile: every B must be row-major (K, N) or an (N, K) weight's .t()"
            )
        capturing = self.dev.capturing()
        tensors = [*a, *outs, *(gathered or ())]
        signature = (
            vp.key,
            tuple(t.data_ptr() % SCRATCH_ALIGN for t in tensors),
            tuple((t.data_ptr() % SCRATCH_ALIGN, t.stride()) for t in b),
        )
        if signature not in self._warm:
            if capturing:
                raise ScheduleError(
                    "virtual ranks: call this shape eagerly with these tensors once before capturing it "
                    "(the first call loads every kernel it launches)"
                )
            self.dev.synchronize()  # no stream waits on a flag while a kernel loads
            for ex, compiled, call in zip(self._executors, vp.compiled, calls, strict=True):
                ex.warm_up(compiled.eager, call)
            self.dev.synchronize()
            self._warm.add(signature)
        steps = [c.captured if capturing else c.eager for c in vp.compiled]
        order = vp.captured if capturing else vp.eager
        caller = self.dev.current_stream()
        for main in self._mains:
            main.wait_stream(caller)
        for r, i in order:
            fn, args = steps[r][i]
            fn(calls[r], *args)
        for main in self._mains:
            caller.wait_stream(main)
        self._captured |= capturing

    def _check(self, err: object, what: str) -> None:
        if err != self._ok:
            self._broken = f"{what} failed ({err})"
            raise EnvironmentMismatchError(f"virtual ranks: {self._broken}")
