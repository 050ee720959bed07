"""``fo-tune calibrate``'s copy-engine section: the measurements the copy engine's cost-model term
reads (``fo_tune.engines.copy_engine.model``, ``fo_tune.model.library``), and the parameters fitted to them.

One GPU (``--world-size 1`` measures these alone):

- ``LibraryGemmTask``: the library GEMM (cuBLAS; ``torch.mm`` on the CPU) of every chunk shape
  the engine runs for the space's GEMM shapes, beta 0 (``mm(out=)``) and beta 1 (``addmm_``),
  paced (each call after an idle gap of its own length) and sustained (back to back after
  ``SUSTAIN_WARM_MS`` of the same GEMM: the card at its power limit). Fitted from them:
  ``library_latency_ms`` / ``library_wave_ms`` (least squares through the paced beta-0 points),
  ``library_small_tile_efficiency`` (the best of a grid over the same points),
  ``library_beta1_factor`` (median beta 1 over beta 0) and ``clock_sustained_factor`` (median
  sustained over paced of the points of at least ``LARGE_GEMM_MS``).

Two GPUs (every rank runs the same task; CUDA only, each says why not elsewhere):

- ``PeerCopyTask``: copy-engine copies of the peer's memory (torch symmetric memory) and of local
  memory at ``COPY_SIZES_MIB`` -> ``peer_copy_latency_ms`` / ``peer_copy_gbs``, ``local_copy_*``
  (least squares of latency + bytes / bandwidth);
- ``FlagTask``: a flag ping-pong between the GPUs (``cuStreamWriteValue32`` into the peer's
  memory, ``cuStreamWaitValue32`` for the answer) -> ``flag_ms`` (half a round trip);
- ``HostTask``: host time per call issued while the GPU is held busy: a copy-engine call eager
  (the engine's own graphs off) and replayed from its graphs, the ``overlap: false`` fallback
  replayed, and cuBLAS then NCCL eager -> ``host_eager_op_ms`` (per operation,
  ``fo_tune.engines.copy_engine.model.eager_ops``), ``host_graph_call_ms``, ``fallback_host_ms``,
  ``sequential_host_ms``.

The parameters a measurement cannot give (``fo_tune.engines.copy_engine.fit.COPY_ENGINE_FREE``) keep their
values (fitted to measured rows: ``fo-tune model fit``). Every value records its source.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fo_kernels.errors import install_hint
from fo_kernels.schedule import torch_dtype
from fo_tune.calibrate.calibration import CopyPoint, EngineCalibration, LibraryGemmPoint, Quantity
from fo_tune.engines.copy_engine.fit import fit_library, fit_lines
from fo_tune.engines.copy_engine.model import eager_ops
from fo_tune.model.library import LibraryGemm
from fo_tune.ranks.gemm import gemm_operands
from fo_tune.ranks.pool import RankContext
from fo_tune.ranks.timing import Timing, time_region

# Paced samples per shape (each one call, then an idle gap as long as the call).
PACED_REPS = 15
# Milliseconds of back-to-back calls before the sustained samples, so the card has reached its
# power limit (docs/design.md#power-limit: the clock drops within the first tens of milliseconds
# of a GEMM without pauses and holds at ~1470 MHz); the samples follow at that clock.
SUSTAIN_WARM_MS = 300.0
SUSTAINED_REPS = 10
# Calls queued per synchronization while warming up (the GPU never idles between them).
WARM_BATCH = 16
# The clock factor is taken over GEMMs of at least this long (shorter ones leave the card cooler
# between launches; the three largest suite shapes take 1.2-1.6 ms).
LARGE_GEMM_MS = 0.5
# Copy sizes of PeerCopyTask, MiB (the probe of docs/design.md#copy-engine: 2 MiB to 128 MiB
# spans the latency floor to the bandwidth plateau of a copy-engine copy).
COPY_SIZES_MIB = (2, 8, 32, 128)
# Timed copies per size (a median over them).
COPY_REPS = 20
# Flag round trips per timed sample of FlagTask (the probe of docs/design.md#copy-engine used 200).
ROUND_TRIPS = 200
# Calls HostTask issues per variant behind a held GPU, and how long the GPU is held (ms): long
# enough that the host never waits for the GPU while it issues them (docs/design.md#cuda-graphs:
# a graph with an NCCL call queues at most 28 launches, so fewer calls than that for those).
HOST_CALLS = 20
HOST_HOLD_MS = 200.0
# Chunk weights HostTask's copy-engine call uses (equal chunks; the per-operation host time does not
# depend on the weights).
HOST_CHUNKS = 2
# The grid the small-tile efficiency is fitted over.
EFFICIENCY_GRID = tuple(0.5 + 0.025 * i for i in range(21))


def chunk_shapes(shapes: Sequence[tuple[int, int, int]], chunks: Sequence[int], world: int) -> list[tuple]:
    """(rows, N, K, beta) of every GEMM a copy engine of ``world`` peers runs for ``shapes`` with
    equal ``chunks`` per shard (beta 0 and 1), and each shape's whole GEMM (beta 0, the baseline)."""
    out = []
    for m, n, k in shapes:
        out.append((m, n, k, 0))
        for c in chunks:
            rows = -(-m // world // c)
            out += [(rows, n, k, 0), (rows, n, k, 1)]
    return list(dict.fromkeys(out))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _paced_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median time of one call with the device idle before it for as long as the call took."""
    samples = []
    for _ in range(PACED_REPS + 1):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        samples.append(ms)
        time.sleep(ms / 1e3)  # the idle gap
    return statistics.median(samples[1:])


def _sustained_ms(fn: Callable[[], Any], device: torch.device) -> Timing:
    """Back-to-back calls for ``SUSTAIN_WARM_MS``, then timed samples of back-to-back calls."""
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < SUSTAIN_WARM_MS:
        for _ in range(WARM_BATCH):  # queued back to back; one synchronization per batch
            fn()
        _sync(device)
    return time_region(fn, device, warmup=0, reps=SUSTAINED_REPS)


@dataclass(frozen=True)
class LibraryGemmTask:
    """The library GEMM of ``shapes`` ((rows, N, K, beta)), paced and sustained (module docstring)."""

    shapes: tuple[tuple[int, int, int, int], ...]
    dtype: str

    def run(self, ctx: RankContext) -> list[dict[str, Any]]:
        out = []
        for m, n, k, beta in self.shapes:
            a, b = gemm_operands(m, n, k, self.dtype, ctx.device, seed=m + n + k)
            c = torch.zeros(m, n, dtype=torch_dtype(self.dtype), device=ctx.device)
            if beta:
                fn = lambda a=a, b=b, c=c: c.addmm_(a, b)  # what the engine's beta = 1 chunks run
            else:
                fn = lambda a=a, b=b, c=c: torch.mm(a, b, out=c)
            fn()
            out.append(
                dict(
                    shape=(m, n, k, beta),
                    paced=_paced_ms(fn, ctx.device),
                    sustained=_sustained_ms(fn, ctx.device).median_ms,
                )
            )
        return out


def library_points(per_rank: list[list[dict[str, Any]]]) -> list[LibraryGemmPoint]:
    """The slowest rank's times of each shape."""
    points = []
    for i, row in enumerate(per_rank[0]):
        m, n, k, beta = row["shape"]
        paced = max(r[i]["paced"] for r in per_rank)
        sustained = max(r[i]["sustained"] for r in per_rank)
        points.append(LibraryGemmPoint(m=m, n=n, k=k, beta=beta, paced_ms=paced, sustained_ms=sustained))
    return points


def fit_library_params(points: Sequence[LibraryGemmPoint], sm_count: int, source: str) -> dict[str, Quantity]:
    """The library model's parameters from measured points (module docstring)."""
    whole = {(p.m, p.n, p.k): p.paced_ms for p in points if p.beta == 0}
    latency, wave = fit_library(whole, sm_count)

    def error(eff: float) -> float:
        lib = LibraryGemm(
            {
                "library_latency_ms": latency,
                "library_wave_ms": wave,
                "library_small_tile_efficiency": eff,
                "library_beta1_factor": 1.0,
                "clock_sustained_factor": 1.0,
                "clock_context": 0.0,
            },
            sm_count,
        )
        return sum(abs(lib.paced_ms(m, n, k) - t) / t for (m, n, k), t in whole.items())

    efficiency = min(EFFICIENCY_GRID, key=error)
    pairs = {(p.m, p.n, p.k): p for p in points if p.beta == 0}
    beta1 = [
        p.paced_ms / pairs[(p.m, p.n, p.k)].paced_ms
        for p in points
        if p.beta == 1 and (p.m, p.n, p.k) in pairs
    ]
    large = [p.sustained_ms / p.paced_ms for p in points if p.beta == 0 and p.paced_ms >= LARGE_GEMM_MS]
    how = f"fitted to the library_gemm points measured by {source}"
    out = {
        "library_latency_ms": Quantity(value=latency, source=f"{how} (least squares, paced, beta 0)"),
        "library_wave_ms": Quantity(value=wave, source=f"{how} (least squares, paced, beta 0)"),
        "library_small_tile_efficiency": Quantity(value=efficiency, source=f"{how} (grid, paced, beta 0)"),
    }
    if beta1:
        out["library_beta1_factor"] = Quantity(value=statistics.median(beta1), source=f"{how} (median)")
    if large:
        out["clock_sustained_factor"] = Quantity(
            value=statistics.median(large),
            source=f"measured by {source}: median sustained / paced, GEMMs >= {LARGE_GEMM_MS} ms",
        )
    return out


# ----------------------------------------------------------------------------------- two GPUs
def peer_blocker(ctx: RankContext) -> str:
    """Why this rank cannot measure between peers ("" when it can)."""
    if ctx.device.type != "cuda":
        return f"needs CUDA GPUs; this rank runs on {ctx.device.type}"
    if ctx.world_size != 2:
        return f"measures between exactly 2 ranks, this run has {ctx.world_size}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return "needs torch.distributed._symmetric_memory, which this torch lacks"
    return ""


def _symmetric(ctx: RankContext, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(my symmetric buffer, the peer's, mapped into my address space)."""
    from torch.distributed import _symmetric_memory as symm_mem

    group = dist.group.WORLD
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed before torch 2.11
        enable(group.group_name)
    mine = symm_mem.empty((numel,), dtype=dtype, device=ctx.device)
    handle = symm_mem.rendezvous(mine, group)
    return mine, handle.get_buffer(1 - ctx.rank, (numel,), dtype)


def _events_ms(fn: Callable[[], Any], stream: torch.cuda.Stream, reps: int) -> float:
    """Median time of ``fn`` on ``stream`` (CUDA events), after 3 warm-up calls."""
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


@dataclass(frozen=True)
class PeerCopyTask:
    """Copy-engine copies of peer and of local memory (module docstring); "" or why not."""

    def run(self, ctx: RankContext) -> dict[str, Any]:
        why = peer_blocker(ctx)
        if why:
            return {"why": why, "points": []}
        biggest = max(COPY_SIZES_MIB) << 20
        mine, peer = _symmetric(ctx, biggest, torch.uint8)
        mine.fill_(1)
        local = torch.ones(biggest, dtype=torch.uint8, device=ctx.device)
        dst = torch.empty(biggest, dtype=torch.uint8, device=ctx.device)
        side = torch.cuda.Stream(ctx.device)
        torch.cuda.synchronize()
        dist.barrier()
        points = []
        for mib in COPY_SIZES_MIB:
            nbytes = mib << 20
            for kind, src in (("peer", peer), ("local", local)):
                ms = _events_ms(lambda s=src, b=nbytes: dst[:b].copy_(s[:b]), side, COPY_REPS)
                points.append((kind, nbytes, ms))
        dist.barrier()  # the peer has finished reading my buffer before it is freed
        return {"why": "", "points": points}


def _flag_ping_pong(ctx: RankContext, driver: Any) -> float:
    mine, peer = _symmetric(ctx, 4, torch.int32)
    mine.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    stream = torch.cuda.current_stream(ctx.device)
    handle = driver.CUstream(stream.cuda_stream)
    my_flag, peer_flag = driver.CUdeviceptr(mine.data_ptr()), driver.CUdeviceptr(peer.data_ptr())
    geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    default = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT

    def check(result: Any, what: str) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed ({err})")

    def signal() -> None:
        check(driver.cuStreamWriteValue32(handle, peer_flag, 1, default), "cuStreamWriteValue32 to the peer")

    def wait() -> None:
        check(driver.cuStreamWaitValue32(handle, my_flag, 1, geq), "cuStreamWaitValue32")
        check(driver.cuStreamWriteValue32(handle, my_flag, 0, default), "cuStreamWriteValue32 (reset)")

    samples = []
    for _ in range(3):  # the first sample warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record(stream)
        for _ in range(ROUND_TRIPS):
            if ctx.rank == 0:
                signal()
                wait()
            else:
                wait()
                signal()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) / ROUND_TRIPS)
    dist.barrier()
    return statistics.median(samples[1:]) / 2


@dataclass(frozen=True)
class FlagTask:
    """The flag ping-pong (module docstring): {"why", "flag_ms"}."""

    def run(self, ctx: RankContext) -> dict[str, Any]:
        from fo_kernels.wait import driver_module

        why = peer_blocker(ctx)
        driver = driver_module() if not why else None
        if not why and driver is None:
            why = f"needs cuda-bindings ({install_hint('cuda')})"
        bad = torch.tensor([1 if why else 0], device=ctx.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # both ranks ping-pong, or neither does
        if int(bad.item()):
            return {"why": why or "the other rank cannot", "flag_ms": math.nan}
        return {"why": "", "flag_ms": _flag_ping_pong(ctx, driver)}


def _host_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Host time per call of ``fn`` issued while the GPU is held (perf_counter; on the CPU, the
    call itself)."""
    for _ in range(3):
        fn()
    _sync(device)
    if device.type == "cuda":
        clock = torch.cuda.get_device_properties(device).clock_rate  # kHz: cycles per ms
        torch.cuda._sleep(int(HOST_HOLD_MS * clock))
    t0 = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    per_call = (time.perf_counter() - t0) * 1e3 / HOST_CALLS
    _sync(device)
    return per_call


@dataclass(frozen=True)
class HostTask:
    """Host time per call of the copy engine (eager and graphed), the fallback and sequential."""

    m: int
    n: int
    k: int
    collective: str
    dtype: str

    def run(self, ctx: RankContext) -> dict[str, Any]:
        from fo_kernels.collectives import reduce_scatter_tensor
        from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
        from fo_kernels.overlap import gemm_all_reduce, gemm_reduce_scatter
        from fo_kernels.schedule import Problem, Schedule

        op = gemm_all_reduce if self.collective == "all_reduce" else gemm_reduce_scatter
        a, b = gemm_operands(self.m, self.n, self.k, self.dtype, ctx.device, seed=3 + ctx.rank)
        head = dict(
            collective=self.collective,
            dtype=self.dtype,
            world_size=ctx.world_size,
            problem=Problem(m=self.m, n=self.n, k=self.k),
        )
        fallback = Schedule(**head)
        out: dict[str, Any] = {"why": ""}

        def sequential() -> None:
            y = a @ b
            if self.collective == "all_reduce":
                dist.all_reduce(y)
            else:
                part = torch.empty((self.m // ctx.world_size, self.n), dtype=y.dtype, device=y.device)
                reduce_scatter_tensor(part, y)

        out["sequential_host_ms"] = _host_ms(sequential, ctx.device)
        out["fallback_host_ms"] = _host_ms(lambda: op(a, b, schedule=fallback), ctx.device)
        why = peer_blocker(ctx)
        if why:
            out["why"] = why
            return out
        from fo_kernels.runtime import runtime_for

        ce = Schedule(**head, settings=CopyEngineSettings(mode="ring", weights=(1,) * HOST_CHUNKS))
        engine = runtime_for(ctx.device, None).copy_engine()
        saved = getattr(engine, "graph_after", None)
        if saved is None:  # (the attribute README documents for turning the engine's graphs off)
            out["why"] = "the runtime's copy engine has no graph_after setting to time eager calls with"
            return out
        try:
            engine.graph_after = 0  # eager: the engine's own graphs off
            eager = _host_ms(lambda: op(a, b, schedule=ce), ctx.device)
        finally:
            engine.graph_after = saved
        out["host_graph_call_ms"] = _host_ms(lambda: op(a, b, schedule=ce), ctx.device)
        out["host_eager_op_ms"] = eager / eager_ops(self.collective, ctx.world_size, HOST_CHUNKS)
        return out


def host_params(per_rank: list[dict[str, Any]], source: str) -> dict[str, Quantity]:
    """The slowest rank's host times as parameters."""
    out = {}
    for name in ("sequential_host_ms", "fallback_host_ms", "host_graph_call_ms", "host_eager_op_ms"):
        values = [r[name] for r in per_rank if name in r]
        if len(values) == len(per_rank):
            out[name] = Quantity(value=max(values), source=f"measured by {source} (HostTask)")
    return out


def copy_params(per_rank: list[dict[str, Any]], source: str) -> tuple[dict[str, Quantity], list[CopyPoint]]:
    """Peer and local copy parameters and points (the slowest rank's times)."""
    if any(r["why"] for r in per_rank):
        return {}, []
    points = [
        CopyPoint(kind=kind, size_bytes=size, time_ms=max(r["points"][i][2] for r in per_rank))
        for i, (kind, size, _) in enumerate(per_rank[0]["points"])
    ]
    out = {}
    for kind in ("peer", "local"):
        latency, gbs = fit_lines([(p.size_bytes, p.time_ms) for p in points if p.kind == kind])
        how = f"measured by {source}: least squares over its {kind} copies (PeerCopyTask)"
        out[f"{kind}_copy_latency_ms"] = Quantity(value=latency, source=how)
        out[f"{kind}_copy_gbs"] = Quantity(value=gbs, source=how)
    return out, points


def measured_by(device_key: str) -> str:
    """The source text of this run's measurements."""
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return f"`fo-tune calibrate` on {device_key}, {when}"


def merge_section(old: EngineCalibration | None, new: EngineCalibration) -> EngineCalibration:
    """``old`` with ``new``'s parameters and points replacing it where ``new`` has them (the
    parameters no measurement gives keep their fitted values; library GEMM points of shapes
    ``new`` did not measure, such as ``copy_engine_n``'s TP=4/8 chunks, and host points stay)."""
    if old is None:
        return new
    gemm = {(p.m, p.n, p.k, p.beta): p for p in [*old.library_gemm, *new.library_gemm]}
    return EngineCalibration(
        params={**old.params, **new.params},
        library_gemm=list(gemm.values()),
        copies=new.copies or old.copies,
        host=new.host or old.host,
    )
