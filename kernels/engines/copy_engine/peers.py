"""``CopyEnginePeers``: the copy engine of one (GPU, process group), and what a call checks first.

It owns the symmetric flag cells and data regions of every rank (``torch.distributed.
_symmetric_memory``), the side streams, the plans (a mode's operation list, compiled by the GPU
executor once per call shape) and the engine's own CUDA graphs (``fo_kernels.graphs.OwnGraphs``).

    run(collective, a, b, mode=..., weights=...)
        refuse what cannot run (before any collective): a broken engine, an unknown or infeasible
            mode, bad weights, M < world size, inside a capture a shape never called eagerly
        agree: on the first call of each (collective, N, K, dtype, mode, weights, tile) the ranks
            check they cut the same chunks (one small all_reduce), else the flags never match
        plan: the mode's operation list for this rank, the regions grown to hold it (collective;
            the peers first finish reading the old ones), compiled once per shape
        warm up: on a plan's first eager call with these operands' alignments, every kernel it
            launches runs once before its first flag wait (``warmup.py``)
        issue: inside a caller's capture, the list as it stands; else through the engine's own
            graphs: eagerly, or captured once the call's key (shape, operand and output
            addresses) repeats, then replayed (docs/design.md#cuda-graphs)

fp8 calls (``scales``, ``fo_kernels.scaling``) run the same lists: A's buffers in float8_e4m3fn,
the outputs and partial sums in ``out_dtype``, the chunk GEMMs scaled; an all_gather with rowwise
scales moves the shard's scale rows through the small ``scales`` region. B is used K-major (the
transposed view of an (N, K) weight as is; a row-major B is copied so each call).

Every call's flags come back to their starting values, so every call issues the same operations
and a graph of a call can be replayed. The regions must not move under a captured graph: the
largest shape runs eagerly before any capture. Both ranks must make the same calls in the same
order, as with any collective.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
import zlib
from collections import OrderedDict

import torch
import torch.distributed as dist

from fo_kernels.engines.copy_engine.buffers import (
    Dtypes,
    Regions,
    data_bytes,
    region_bytes_for,
    scale_bytes_for,
)
from fo_kernels.engines.copy_engine.gpu import Compiled, GpuExecutor
from fo_kernels.engines.copy_engine.layout import COUNTER_SLOTS, FlagLayout
from fo_kernels.engines.copy_engine.modes import check_weights, plan_call
from fo_kernels.engines.copy_engine.ops import ALT, LOCAL, NOTIFY, SIDE, CallPlan
from fo_kernels.engines.copy_engine.warmup import SCRATCH_ALIGN
from fo_kernels.errors import EnvironmentMismatchError, ScheduleError, ShapeError, install_hint
from fo_kernels.gemm import BOperand
from fo_kernels.graphs import OutputPool, OwnGraphs
from fo_kernels.scaling import Scales, out_dtype_of
from fo_kernels.tile import Tile
from fo_kernels.wait import driver_module

# Plans kept (LRU), one per (collective, mode, M, N, K, dtype, weights, tile): serving sees many M.
PLAN_CACHE_SIZE = 256


def copy_engine_blocker(device: torch.device, world_size: int) -> str:
    """Why this rank cannot run the engine, as a phrase after "engine copy_engine" ("" if it can).
    Local checks only; making the symmetric buffers (a rendezvous of every rank, which needs peer
    access between all their GPUs) can still fail."""
    if device.type != "cuda":
        return f"needs CUDA GPUs with peer access; this call runs on {device.type}"
    if world_size < 2:
        return f"runs between at least 2 ranks, this group has {world_size}"
    if driver_module() is None:
        return f"needs cuda-bindings ({install_hint('cuda')})"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return "needs torch.distributed._symmetric_memory, which this torch lacks"
    return ""


_ADVICE = "use a table row with engine: triton or overlap: false on this machine"


def symmetric(
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
) -> dict[int, torch.Tensor]:
    """A symmetric allocation of ``numel`` elements on every rank of ``group`` (collective): rank
    -> its buffer (mine, or my view of a peer's)."""
    group = group if group is not None else dist.group.WORLD
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before torch 2.11, a deprecated no-op since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group.group_name)
        mine = symm_mem.empty((numel,), dtype=dtype, device=device)
        handle = symm_mem.rendezvous(mine, group)
        return {q: mine if q == rank else handle.get_buffer(q, (numel,), dtype) for q in range(world)}
    except torch.OutOfMemoryError:
        raise
    except (ImportError, RuntimeError, AttributeError) as exc:
        raise EnvironmentMismatchError(
            f"engine copy_engine: symmetric memory between the {world} GPUs failed ({exc}); it "
            "needs peer access (NVLink) between all of them and torch.distributed._symmetric_memory. "
            "Use a table row with engine: triton or overlap: false here (re-run `fo-tune search`)"
        ) from exc


class CopyEnginePeers:
    """The copy engine of ``device`` in ``group`` (see the module docstring). Made collectively:
    every rank of the group makes its own at the same time."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        world = dist.get_world_size(group)
        why = copy_engine_blocker(device, world)
        if why:
            raise EnvironmentMismatchError(f"engine copy_engine {why}; {_ADVICE}")
        self._init_state(device, group, dist.get_rank(group), world)
        drv = self._driver = driver_module()
        self._ok = drv.CUresult.CUDA_SUCCESS
        flags = self._symmetric(self.layout.slots, torch.int32)
        mine = flags[self.rank]
        mine.zero_()
        mine[[self.layout.slot(c) for c in self.layout.guards(self.rank)]] = 1
        torch.cuda.synchronize(device)
        dist.barrier(group=group, device_ids=[device.index])
        streams = {name: torch.cuda.Stream(device, priority=-1) for name in (SIDE, LOCAL, NOTIFY)}
        streams[ALT] = torch.cuda.Stream(device)  # the caller's priority (the default one)
        self._streams = streams
        counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._executor = GpuExecutor(drv, self.rank, self.layout, streams, flags, counters, sms, self._check)
        self._graphs.unwind, self._graphs.after_failure = self._unwind_capture, self._after_failed_capture
        torch.cuda.synchronize(device)

    def _init_state(self, device: torch.device, group, rank: int, world: int) -> None:
        """The engine's bookkeeping (everything but the GPU resources)."""
        self.device, self.group, self.rank, self.world = device, group, rank, world
        self.layout = FlagLayout(world)
        self._plans: OrderedDict = OrderedDict()  # plan key -> (CallPlan, Compiled)
        self._agreed: set = set()
        self._warmed: set = set()  # (plan key, operands' alignments) whose kernels are loaded
        self._capacity = 0  # bytes per region
        self._scale_capacity = 0  # bytes of the scales region
        self._calls = 0
        self._broken = ""  # why an earlier call failed part-way (the ranks' flags are out of step)
        self._captured = False  # a caller's CUDA graph holds the regions' addresses
        self._recording = False  # inside the engine's own capture: nothing issued runs
        self._graphs = OwnGraphs(device, "engine copy_engine")
        self._outputs: OutputPool | None = None
        self._last_main: torch.cuda.Stream | None = None

    @property
    def graph_after(self) -> int:
        """An eager call is captured into a graph of the engine's own after this many calls with
        the same key (shape, operand and output addresses); 0 never (every call issued eagerly)."""
        return self._graphs.after

    @graph_after.setter
    def graph_after(self, calls: int) -> None:
        self._graphs.after = calls

    def call_counts(self) -> tuple[int, int]:
        """(calls run, of which replayed from the engine's own graphs) since it was made."""
        return self._calls, self._graphs.replays

    # ------------------------------------------------------------------ calls
    def run(
        self,
        collective: str,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        mode: str,
        weights: tuple[int, ...],
        tile: Tile | None = None,
        own_graphs: bool = True,
        scales: Scales | None = None,
    ) -> torch.Tensor:
        """``collective(a @ b)`` over the group: all_reduce (M, N); reduce_scatter (M / w, N), rank
        r's rows [r M/w, (r+1) M/w); all_gather: ``a`` is this rank's (M / w, K) shard of the rows
        and the result the (M, N) product of the gathered A. Forward only (no autograd history).
        ``own_graphs=False``: issued eagerly, outputs from the caller's allocator (no graph or
        output pool of the engine's own). ``scales``: an fp8 call's (the output in its
        ``out_dtype``)."""
        return self._call(collective, a, b, mode, weights, tile, own_graphs, scales)[1]

    def run_all_gather(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        mode: str,
        weights: tuple[int, ...],
        tile: Tile | None = None,
        own_graphs: bool = True,
        scales: Scales | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gathered (M, K) A, its (M, N) product with ``b``) for this rank's (M / w, K) shard
        ``a``: rank r's shard at rows [r M/w, (r+1) M/w) (a backward reuses the gathered A).
        ``scales``: an fp8 call's (rowwise: this rank's rows of scale_a, gathered with the rows)."""
        gathered, out = self._call("all_gather", a, b, mode, weights, tile, own_graphs, scales)
        assert gathered is not None
        return gathered, out

    @torch.no_grad()  # (a replayed call issues no torch op: only the eager path needs it)
    def _call(
        self, collective, a, b, mode, weights, tile, own_graphs=True, scales=None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self._broken:
            raise EnvironmentMismatchError(
                f"engine copy_engine failed in an earlier call ({self._broken}) and its peer flags "
                f"are out of step; restart the processes, and {_ADVICE}"
            )
        gather = collective == "all_gather"
        operand = None
        if scales is not None and (b.stride(0) != 1 or b.stride(1) < max(1, b.shape[0])):
            b = b.t().contiguous().t()  # K-major, as torch._scaled_mm and fp8 wgmma read it
        if tile is not None:
            operand = BOperand.of(b)
            if operand is None:
                raise ShapeError(
                    "engine copy_engine with a tile: b must be row-major (K, N) or the transposed view "
                    f"of a contiguous (N, K) weight (got strides {b.stride()}); call .contiguous() on it"
                )
        if (tile is not None or gather) and not a.is_contiguous():  # (read by the kernel, or copied)
            a = a.contiguous()
        m = a.shape[0] * self.world if gather else a.shape[0]
        n, k = b.shape[1], a.shape[1]
        weights = check_weights(weights)
        dtypes = Dtypes(a.dtype, out_dtype_of(a, scales))
        row_scales = gather and scales is not None and scales.rowwise
        scaling = None if scales is None else ("rowwise" if scales.rowwise else "tensorwise")
        key = (collective, mode, m, n, k, dtypes, scaling, weights, tile)
        # M is left out: it changes from call to call in serving (each M would cost a collective)
        signature = (collective, n, k, str(dtypes), scaling, weights, mode, tile)
        capturing = torch.cuda.is_current_stream_capturing()
        entry = self._plans.get(key)
        if entry is None:  # (the checks of what a caller can get wrong come first)
            plan = plan_call(mode, collective, self.world, self.rank, m, n, k, weights, tile, row_scales)
        if capturing:
            self._capturable(entry, signature, collective, m, n, k, a.dtype)
        if entry is None:
            self._agree(signature)
            entry = self._make(key, plan, dtypes)
        else:
            self._plans.move_to_end(key)
        plan, compiled = entry
        if capturing or not own_graphs:  # recorded into the caller's graph, or issued as it stands
            out = torch.empty((plan.out_rows, n), dtype=dtypes.out, device=a.device)
            gathered = torch.empty((m, k), dtype=a.dtype, device=a.device) if gather else None
            rows_scale = torch.empty((m, 1), dtype=torch.float32, device=a.device) if row_scales else None
            main = torch.cuda.current_stream(self.device)
            extra = (gathered, operand) if scales is None else (gathered, operand, scales, rows_scale)
            if capturing:
                self._executor.issue(compiled.captured, a, b, out, main, *extra)
                self._captured = True
            else:
                self._warm_up(key, compiled, a, b, out, main, *extra)
                self._issue_eagerly(compiled, a, b, out, main, *extra)
            self._calls += 1
            return gathered, out
        return self._eager(plan, compiled, a, b, operand, scales, dtypes, key)

    def _capturable(self, entry, signature: tuple, collective: str, m: int, n: int, k: int, dtype) -> None:
        """Inside a caller's capture only a call whose first call ran eagerly can be recorded: the
        first call checks the ranks agree and makes the regions, which a graph cannot hold."""
        why = ""
        if signature not in self._agreed:
            why = "the ranks have not yet agreed on this schedule (the first eager call checks it)"
        elif entry is None:
            why = f"M={m} has no plan yet (its first eager call makes it and grows the buffers)"
        if why:
            raise ScheduleError(
                f"engine copy_engine: call {collective} with this shape ({m}x{n}x{k}, {dtype}) once "
                f"before capturing it in a CUDA graph: {why}"
            )

    def _after_last_call(self, main: torch.cuda.Stream) -> None:
        """Order ``main`` after the previous call when that one ran on another stream."""
        last = self._last_main
        if last is not None and last.cuda_stream != main.cuda_stream:
            main.wait_stream(last)  # the previous call (eager or replayed) ran on another stream

    def _warm_up(self, plan_key: tuple, compiled: Compiled, a, b, out, main, *extra) -> None:
        """Before the first call of a plan with these operands' alignments issues a flag wait,
        every kernel it launches runs once (``warmup.py``: under lazy module loading, a kernel's
        first launch while a stream waits on a flag can block the host), the device synchronized
        around it (by the executor); a replayed graph's calls were warmed before it was captured."""
        signature = (plan_key, a.data_ptr() % SCRATCH_ALIGN, b.data_ptr() % SCRATCH_ALIGN, b.stride())
        if signature in self._warmed:
            return
        self._executor.warm_up(compiled.eager, self._executor.bind(a, b, out, main, *extra))
        self._warmed.add(signature)

    def _issue_eagerly(self, compiled: Compiled, a, b, out, main, *extra) -> None:
        """A call issued operation by operation, outside the engine's own graphs (a call through
        the custom op, whose outputs the caller's allocator holds); ``extra``: the executor's
        optional arguments (gathered, operand, scales, gathered_scale)."""
        self._after_last_call(main)
        self._executor.issue(compiled.eager, a, b, out, main, *extra)
        self._last_main = main

    def _eager(
        self,
        plan: CallPlan,
        compiled: Compiled,
        a,
        b,
        operand,
        scales: Scales | None,
        dtypes: Dtypes,
        plan_key: tuple,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """An eager call through the engine's own graphs (``OwnGraphs``): issued, captured or
        replayed by how often its key has been seen (``plan_key``: its plan's)."""
        main = torch.cuda.current_stream(self.device)
        self._after_last_call(main)
        spec = plan.spec
        if self._outputs is None:
            self._outputs = OutputPool(self.device)
        out = self._outputs.empty((plan.out_rows, spec.n), dtypes.out)
        gathered = self._outputs.empty((spec.m, spec.k), a.dtype) if spec.collective == "all_gather" else None
        rows_scale = self._outputs.empty((spec.m, 1), torch.float32) if spec.row_scales else None
        scale_key = () if scales is None else (scales.rowwise, scales.a.data_ptr(), scales.b.data_ptr())
        key = (
            spec.collective, plan.mode, spec.weights, spec.tile, a.dtype, tuple(a.shape), a.stride(),
            a.data_ptr(), b.dtype, tuple(b.shape), b.stride(), b.data_ptr(), out.data_ptr(),
            0 if gathered is None else gathered.data_ptr(), dtypes.out, scale_key,
            0 if rows_scale is None else rows_scale.data_ptr(),
        )  # fmt: skip
        issue = self._executor.issue
        extra = (gathered, operand) if scales is None else (gathered, operand, scales, rows_scale)
        self._warm_up(plan_key, compiled, a, b, out, main, *extra)

        def record() -> None:
            self._recording = True
            try:
                issue(compiled.captured, a, b, out, torch.cuda.current_stream(self.device), *extra)
            finally:
                self._recording = False

        self._graphs.call(key, lambda: issue(compiled.eager, a, b, out, main, *extra), record)
        self._calls += 1
        self._last_main = main
        return gathered, out

    # ------------------------------------------------------------------ plans and regions
    def _make(self, key: tuple, plan: CallPlan, dtypes: Dtypes) -> tuple[CallPlan, Compiled]:
        self._reserve(region_bytes_for(plan, dtypes), scale_bytes_for(plan))
        entry = self._plans[key] = (plan, self._executor.compile(plan, dtypes))
        while len(self._plans) > PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        return entry

    def _reserve(self, region_bytes: int, scale_bytes: int = 0) -> None:
        """Grow every rank's regions to ``region_bytes`` each and its scales region to
        ``scale_bytes`` (all ranks do it in the same call)."""
        if region_bytes <= self._capacity and scale_bytes <= self._scale_capacity:
            return
        region_bytes = max(region_bytes, self._capacity)
        scale_bytes = max(scale_bytes, self._scale_capacity)
        if self._captured:
            raise ScheduleError(
                f"engine copy_engine: this call needs {region_bytes} bytes per peer buffer, more than "
                f"the {self._capacity} a captured CUDA graph uses; run the largest shape eagerly before "
                "capturing any graph (the buffers cannot move under a graph)"
            )
        if self._calls:  # every peer has finished reading my old regions before they are freed
            torch.cuda.synchronize(self.device)  # (my streams first: no stale reset left queued)
            self._executor.wait_cells(self.layout.guards(self.rank), torch.cuda.current_stream(self.device))
            torch.cuda.synchronize(self.device)
        self._executor.regions = None
        self._plans.clear()  # their views and addresses point into the old regions
        self._warmed.clear()
        self._graphs.clear()  # and so do the engine's own graphs
        self._capacity = self._scale_capacity = 0  # until the new regions exist
        data = self._symmetric(data_bytes(self.world, region_bytes, scale_bytes), torch.uint8)
        self._executor.regions = Regions(self.world, region_bytes, data, scale_bytes)
        self._capacity, self._scale_capacity = region_bytes, scale_bytes

    def _symmetric(self, numel: int, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """A symmetric allocation of ``numel`` elements on every rank: rank -> its buffer (mine, or
        my view of a peer's)."""
        return symmetric(numel, dtype, self.device, self.group, self.rank, self.world)

    # ------------------------------------------------------------------ failures
    def _check(self, err, what: str) -> None:
        """Raise on a driver error; eagerly, part of the call may be queued already, so the ranks'
        flags are out of step and the engine refuses later calls (a capture queues nothing)."""
        if err != self._ok:
            why = f"{what} failed ({err})"
            if not self._recording:
                self._broken = why
            raise EnvironmentMismatchError(f"engine copy_engine: {why}; {_ADVICE}")

    def _unwind_capture(self) -> None:
        """A capture that failed part-way: the side streams it forked join the capture stream (an
        unjoined fork makes ``capture_end`` fail before torch's own cleanup)."""
        here = torch.cuda.current_stream(self.device)
        for side in self._streams.values():
            with contextlib.suppress(RuntimeError):
                here.wait_stream(side)

    def _after_failed_capture(self, exc: BaseException) -> None:
        """A side stream left capturing would record the engine's next operations, never run them:
        the engine refuses to go on."""
        for side in self._streams.values():
            with torch.cuda.stream(side):
                if torch.cuda.is_current_stream_capturing():
                    self._broken = "a failed CUDA graph capture left a side stream capturing"
        if self._broken:
            raise exc

    def _agree(self, signature: tuple) -> None:
        """On the first call of each signature every rank must cut the same chunks, else the flags
        would never match (a hang) or rows would be read before they are written."""
        if signature in self._agreed:
            return
        digest = zlib.crc32(repr(signature).encode())
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if int(both[0]) != digest or int(both[1]) != -digest:
            raise ScheduleError(
                f"engine copy_engine: the ranks called with different schedules (this rank: "
                f"{signature}); every rank must read the same table"
            )
        self._agreed.add(signature)
