"""The GPU executor: a call's operation list issued through the CUDA driver, cuBLAS and Triton.

Each operation kind is one call, on its stream:

    Gemm        torch.mm(a, B, out=dst) (beta 0) | dst.addmm_(a, B) (beta 1)       (cuBLAS)
                fp8: torch._scaled_mm(a, B, its rows' scales, out=dst) (beta 0) |
                rows_gemm(..., ready set): dst += in the Triton rows GEMM's epilogue (beta 1)
    TiledGemm   fo_kernels.gemm.rows_gemm(...)                       (the persistent Triton GEMM)
    Copy        cuMemcpyDtoDAsync(dst, src, bytes)                     (the copy engine; NVLink)
    Signal      cuStreamWriteValue32(cell, 1)       (after a system fence: the data lands first)
    Wait        cuStreamWaitValue32(cell, target, GEQ)           (the GPU front end; no SM used)
    Reset       cuStreamWriteValue32(cell, 0)
    Clear       cuMemsetD32Async(cell, 0, count)
    Record / WaitEvent / Join   event.record / stream.wait_event / stream.wait_stream

A call's host time bounds small shapes (docs/design.md#host-time), so ``compile`` resolves a plan
once: the symmetric regions' views and addresses, the flag cells' addresses, the tiled kernel's
row groups; ``issue`` then adds only the call's own tensors' addresses. The executor issues the
list exactly as it stands (``eager=False`` leaves out the eager-only prologue), so an eager call,
a captured one and the CPU executor's run of the same list agree operation by operation.
``bind`` gives a call's tensors and streams to the steps, so another issuer (the virtual ranks of
``virtual.py``) can interleave the steps of several ranks. ``warm_up`` runs each distinct kernel of
a plan once before its first flag wait (``warmup.py``: the kernel-loading rule).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fo_kernels.engines.copy_engine.buffers import Dtypes, Regions, dtypes_of, width_of
from fo_kernels.engines.copy_engine.layout import CALLER_BUFFERS, SCALES_OF, Cell, FlagLayout, Rows
from fo_kernels.engines.copy_engine.ops import (
    MAIN,
    CallPlan,
    Clear,
    Copy,
    Gemm,
    Join,
    Record,
    Reset,
    Signal,
    TiledGemm,
    Wait,
    WaitEvent,
)
from fo_kernels.engines.copy_engine.warmup import launch_key, scratch_like
from fo_kernels.gemm import BOperand, rows_gemm
from fo_kernels.plan import cdiv
from fo_kernels.scaling import Scales, is_fp8, scaled_mm
from fo_kernels.tile import FP8_TILE, DeviceLimits

# An fp8 chunk GEMM onto a partial sum (beta 1) runs in the persistent rows GEMM with FP8_TILE,
# which adds the partial in its epilogue: torch._scaled_mm has no beta, and its product then a
# fused add cost 1.15-1.30x the GEMM alone on 8 chunk shapes of TP=2/4/8 layers, the rows GEMM
# 1.01-1.20x (one H100; docs/perf-notes.md, "fp8 partial sums").


@dataclass(frozen=True)
class Compiled:
    """A plan's steps, (function, arguments) each: ``eager`` for an eager call, ``captured``
    (without the eager-only prologue) for a capture."""

    eager: tuple[tuple, ...]
    captured: tuple[tuple, ...]


@dataclass
class _Call:
    """One call's own tensors and its main stream, as the compiled steps read them."""

    a: torch.Tensor
    b: torch.Tensor
    operand: BOperand | None
    scales: Scales | None
    tensors: dict[str, torch.Tensor | None]
    streams: dict[str, object]
    handles: dict[str, object]
    main_current: bool = True  # the call's main stream is the current stream


class GpuExecutor:
    """Issues ``CallPlan`` operations of rank ``rank``. ``streams``: the side streams by name (the
    call's main stream comes with each call); ``flags[q]``: rank q's flag cells (int32, mine or a
    peer's view); ``counters``: my tile counters; ``check(err, what)`` raises on a driver error."""

    def __init__(
        self,
        driver,
        rank: int,
        layout: FlagLayout,
        streams: Mapping[str, torch.cuda.Stream],
        flags: Mapping[int, torch.Tensor],
        counters: torch.Tensor,
        sms: int,
        check: Callable[[object, str], None],
    ) -> None:
        self.driver, self.rank, self.layout, self.sms, self.check = driver, rank, layout, sms, check
        self.flags, self.counters = flags, counters
        self.regions: Regions | None = None
        self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._fence = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self._handles: dict[int, object] = {}
        self._streams = dict(streams)
        self._stream_handles = {name: self.handle(s) for name, s in streams.items()}
        self._events: list = []
        # The rows GEMM's ready flag for an fp8 sum: always set (the partial is in place when the
        # step runs: its stream waited for the copy that brought it).
        self._ready = torch.ones(1, dtype=torch.int32, device=counters.device)

    def handle(self, stream: torch.cuda.Stream) -> object:
        """The driver's handle object of a CUDA stream (made once per stream)."""
        wrapped = self._handles.get(stream.cuda_stream)
        if wrapped is None:
            wrapped = self._handles[stream.cuda_stream] = self.driver.CUstream(stream.cuda_stream)
        return wrapped

    # ------------------------------------------------------------------ compile
    def compile(self, plan: CallPlan, dtypes: Dtypes | torch.dtype) -> Compiled:
        """``plan``'s steps with every address that does not depend on the call's own tensors
        resolved (``regions`` must hold the plan's rows); ``dtypes`` of its buffers."""
        steps = []
        spec, kinds = plan.spec, dtypes_of(dtypes)
        while len(self._events) < plan.events:
            self._events.append(torch.cuda.Event())

        def place(rows: Rows) -> tuple:
            """A Rows as (caller buffer, byte offset) or (None, absolute address)."""
            row_bytes = width_of(rows.buffer, spec.n, spec.k) * kinds.of(rows.buffer).itemsize
            if rows.buffer in CALLER_BUFFERS:
                return rows.buffer, rows.r0 * row_bytes
            return None, self.regions.address(rows, row_bytes)

        def view(rows: Rows | None):
            if rows is None or rows.buffer in CALLER_BUFFERS:
                return rows
            return self.regions.view(rows, width_of(rows.buffer, spec.n, spec.k), kinds.of(rows.buffer))

        for op in plan.ops:
            s = op.stream
            if isinstance(op, Gemm):
                groups = None  # an fp8 sum's row groups (every tile row in group 0: self._ready)
                if op.beta and is_fp8(kinds.operand):
                    tiles_m = cdiv(op.out.count, FP8_TILE.block_m)
                    groups = torch.zeros(max(1, tiles_m), dtype=torch.int32, device=self.counters.device)
                steps.append((self._gemm, (s, view(op.a), view(op.out), op.beta, groups)))
            elif isinstance(op, Copy):
                dst = op.dst.buffer
                nbytes = op.dst.count * width_of(dst, spec.n, spec.k) * kinds.of(dst).itemsize
                steps.append((self._copy, (s, place(op.dst), place(op.src), nbytes)))
            elif isinstance(op, Signal):
                peer = op.cell.owner != self.rank
                what = "cuStreamWriteValue32 to the peer" if peer else "cuStreamWriteValue32"
                steps.append((self._write, (s, self._address(op.cell), 1, what)))
            elif isinstance(op, Wait):
                steps.append((self._wait, (s, self._address(op.cell), op.target)))
            elif isinstance(op, Reset):
                steps.append((self._write, (s, self._address(op.cell), 0, "cuStreamWriteValue32")))
            elif isinstance(op, Clear):
                steps.append((self._clear, (s, self._address(op.cell), op.count)))
            elif isinstance(op, Record):
                steps.append((self._record, (s, self._events[op.event])))
            elif isinstance(op, WaitEvent):
                steps.append((self._wait_event, (s, self._events[op.event])))
            elif isinstance(op, Join):
                steps.append((self._join, (s, op.other)))
            elif isinstance(op, TiledGemm):
                steps.append((self._tiled, (s, self._tiled_args(op, view))))
            else:  # pragma: no cover - every kind of ops.Op is handled above
                raise TypeError(f"unknown operation {op!r}")
        return Compiled(eager=tuple(steps), captured=tuple(steps[plan.prologue :]))

    def _address(self, cell: Cell):
        return self.driver.CUdeviceptr(self._cell_tensor(cell).data_ptr())

    def _cell_tensor(self, cell: Cell) -> torch.Tensor:
        """``cell``'s int32 and the cells after it (the kernel's counters and ready arguments)."""
        cells = self.counters if cell.name == "counter" else self.flags[cell.owner]
        return cells[self.layout.slot(cell) :]

    def _tiled_args(self, op: TiledGemm, view) -> tuple:
        groups = [c for c, (c0, c1) in enumerate(op.chunks) for _ in range(-(-(c1 - c0) // op.tile.block_m))]
        row_group = torch.tensor(groups, dtype=torch.int32, device=self.counters.device)
        kw = {}
        if op.counters is not None:
            kw["counters"] = self._cell_tensor(op.counters)
        if op.ready is not None or op.copy_to is not None:
            kw["ready"] = None if op.ready is None else self._cell_tensor(op.ready)
            kw["out2"] = view(op.copy_to)
            kw["remote_counters"] = op.counters is not None and op.counters.owner != self.rank
        return view(op.a), view(op.out), op.tile, row_group, kw

    # ------------------------------------------------------------------ issue
    def bind(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        main: torch.cuda.Stream,
        gathered: torch.Tensor | None = None,
        operand: BOperand | None = None,
        scales: Scales | None = None,
        gathered_scale: torch.Tensor | None = None,
        *,
        main_current: bool = True,
    ) -> _Call:
        """One call's tensors and streams as the compiled steps read them, ``main`` being the
        call's stream (``main_current``: it is the current stream, as a rank's own call has it);
        ``scales`` an fp8 call's, ``gathered_scale`` the (M, 1) float32 buffer of an all_gather's
        rowwise scales."""
        streams = dict(self._streams, main=main)
        handles = dict(self._stream_handles, main=self.handle(main))
        tensors = {"a": a, "out": out, "gathered": gathered, "gathered_scale": gathered_scale}
        if scales is not None and scales.rowwise:
            tensors["scale_a"] = scales.a.view(-1, 1)
        return _Call(a, b, operand, scales, tensors, streams, handles, main_current)

    def issue(self, steps: tuple[tuple, ...], *args: Any, **kwargs: Any) -> None:
        """Issue ``steps`` (``Compiled.eager`` or ``.captured``) for one call (``bind``'s
        arguments)."""
        call = self.bind(*args, **kwargs)
        for fn, step_args in steps:
            fn(call, *step_args)

    def warm_up(self, steps: tuple[tuple, ...], call: _Call) -> int:
        """Run each distinct kernel of ``steps`` once on scratch tensors, and one small copy and
        memset on each stream that issues them, with no flag waited for or written
        (``fo_kernels.engines.copy_engine.warmup``); the number of kernels run. On a GPU the device
        is synchronized first (no stream waits on a flag while a module loads), after the scratch
        tensors are filled, and at the end (they are freed only once nothing uses them). A tiled
        kernel whose tile the GPU cannot load raises ``DeviceLimitError`` here, the first place it
        launches: the call's own launches of it come after."""
        self._synchronize()
        scratch = dict.fromkeys(call.tensors)
        # (zeros: a kernel run on uninitialized floats computes on garbage; the interpreter warns)
        scratch.update({name: scratch_like(t, fill=0) for name, t in call.tensors.items() if t is not None})
        fake = dataclasses.replace(call, tensors=scratch)
        seen: set = set()
        runs: list[tuple] = []
        drivers: set = set()
        for fn, args in steps:
            kind = getattr(fn, "__func__", None)
            if kind in (GpuExecutor._copy, GpuExecutor._clear):
                drivers.add((kind.__name__, args[0]))
            if kind is GpuExecutor._gemm:
                s, a, out, beta, groups = args
                key = (kind, s, launch_key(self._rows(call, a)), launch_key(self._rows(call, out)), beta)
                if key not in seen:
                    runs.append((fn, (s, self._scratch(a), self._scratch(out), beta, groups), None))
            elif kind is GpuExecutor._tiled:
                s, (a, out, tile, row_group, kw) = args
                kw_keys = tuple(
                    (name, launch_key(self._rows(call, v)) if not isinstance(v, bool) else v)
                    for name, v in sorted(kw.items())
                )
                shapes = (launch_key(self._rows(call, a)), launch_key(self._rows(call, out)))
                key = (kind, s, *shapes, tile, kw_keys)
                if key not in seen:  # (the ready cells set: the kernel's tiles wait for them)
                    kw = {name: self._scratch(v, fill=1 if name == "ready" else 0) for name, v in kw.items()}
                    limits = DeviceLimits(tile, f"{self._rows(call, a).dtype} rows of the copy engine")
                    runs.append(
                        (fn, (s, (self._scratch(a), self._scratch(out), tile, row_group, kw)), limits)
                    )
            else:
                continue
            seen.add(key)
        cell = scratch_like(self.counters[:4], fill=0)
        self._synchronize()  # (the fills above ran on the current stream, the kernels run on theirs)
        for fn, args, limits in runs:
            with limits or contextlib.nullcontext():
                fn(fake, *args)
        for kind, s in sorted(drivers):
            if kind == GpuExecutor._copy.__name__:
                self._copy(fake, s, (None, cell.data_ptr()), (None, cell.data_ptr() + 8), 8)
            else:
                self._clear(fake, s, self.driver.CUdeviceptr(cell.data_ptr()), 1)
        self._synchronize()
        return len(runs)

    def _synchronize(self) -> None:
        """Wait for the device (a GPU executor's; the CPU tests' fakes have none)."""
        if self.counters.is_cuda:
            torch.cuda.synchronize(self.counters.device)

    def _scratch(self, x, fill: int = 0):
        """A region view's or a cell array's scratch twin, zeros (cells: ``fill``; a caller
        buffer's ``Rows`` stays: the warm-up's call holds scratch caller tensors); booleans and None
        as they are."""
        if isinstance(x, torch.Tensor):
            return scratch_like(x, fill=fill if x.dtype == torch.int32 else 0)
        return x

    def wait_cells(self, cells: list[Cell], stream: torch.cuda.Stream) -> None:
        """``stream`` waits until each of my ``cells`` is set, leaving it set (no reset)."""
        handle = self.handle(stream)
        for cell in cells:
            (err,) = self.driver.cuStreamWaitValue32(handle, self._address(cell), 1, self._geq)
            self.check(err, "cuStreamWaitValue32")

    def _rows(self, call: _Call, rows) -> torch.Tensor:
        if isinstance(rows, Rows):
            return call.tensors[rows.buffer][rows.r0 : rows.r1]
        return rows

    def _scales(self, call: _Call, rows) -> Scales | None:
        """The fp8 scales of A's ``rows`` (a caller buffer's ``Rows``; rowwise: their rows of the
        matching scale buffer)."""
        scales = call.scales
        if scales is None or not scales.rowwise:
            return scales
        return scales.with_rows(call.tensors[SCALES_OF[rows.buffer]][rows.r0 : rows.r1].view(-1))

    def _gemm(self, call: _Call, s: str, a, out, beta: int, groups: torch.Tensor | None) -> None:
        scales = self._scales(call, a)
        a, out = self._rows(call, a), self._rows(call, out)
        with torch.cuda.stream(call.streams[s]):
            if scales is not None:
                if beta:  # (torch._scaled_mm has no beta: the sum in the rows GEMM's epilogue)
                    operand = call.operand or BOperand.of(call.b)
                    rows_gemm(
                        a, operand, out, FP8_TILE, grid=self.sms, row_group=groups, ready=self._ready,
                        scales=scales,
                    )  # fmt: skip
                else:
                    scaled_mm(a, call.b, scales, out)
            elif beta:
                out.addmm_(a, call.b)
            else:
                torch.mm(a, call.b, out=out)

    def _tiled(self, call: _Call, s: str, args: tuple) -> None:
        a, out, tile, row_group, kw = args
        kw, scales = dict(kw), self._scales(call, a)
        if scales is not None:
            kw["scales"] = scales
        if "out2" in kw:
            kw["out2"] = self._rows(call, kw["out2"]) if kw["out2"] is not None else None
        a, out = self._rows(call, a), self._rows(call, out)
        if s == MAIN and call.main_current:  # (no stream switch: it costs host time)
            rows_gemm(a, call.operand, out, tile, grid=self.sms, row_group=row_group, **kw)
            return
        with torch.cuda.stream(call.streams[s]):
            rows_gemm(a, call.operand, out, tile, grid=self.sms, row_group=row_group, **kw)

    def _copy(self, call: _Call, s: str, dst: tuple, src: tuple, nbytes: int) -> None:
        drv = self.driver
        d = dst[1] if dst[0] is None else call.tensors[dst[0]].data_ptr() + dst[1]
        f = src[1] if src[0] is None else call.tensors[src[0]].data_ptr() + src[1]
        (err,) = drv.cuMemcpyDtoDAsync(drv.CUdeviceptr(d), drv.CUdeviceptr(f), nbytes, call.handles[s])
        self.check(err, "cuMemcpyDtoDAsync")

    def _write(self, call: _Call, s: str, address, value: int, what: str) -> None:
        (err,) = self.driver.cuStreamWriteValue32(call.handles[s], address, value, self._fence)
        self.check(err, what)

    def _wait(self, call: _Call, s: str, address, target: int) -> None:
        (err,) = self.driver.cuStreamWaitValue32(call.handles[s], address, target, self._geq)
        self.check(err, "cuStreamWaitValue32")

    def _clear(self, call: _Call, s: str, address, count: int) -> None:
        (err,) = self.driver.cuMemsetD32Async(address, 0, count, call.handles[s])
        self.check(err, "cuMemsetD32Async")

    def _record(self, call: _Call, s: str, event) -> None:
        event.record(call.streams[s])

    def _wait_event(self, call: _Call, s: str, event) -> None:
        call.streams[s].wait_event(event)

    def _join(self, call: _Call, s: str, other: str) -> None:
        call.streams[s].wait_stream(call.streams[other])
