"""``fo-tune calibrate --only copy_engine_n``: the copy engine at N peers, measured on one GPU.

Machines with 4 or 8 GPUs are not always at hand; what of the copy engine at N peers one GPU can
measure is measured here (docs/design.md#virtual-ranks):

- ``HostNTask``: a call's host time per rank at N = 2 .. 8 peers (``HOST_WORLDS``), each
  collective, with N virtual ranks in this process (``fo_kernels.engines.copy_engine.virtual``:
  every rank's operation list issued through the CUDA driver, as N processes would issue them),
  while the GPU is held busy so the host never waits for it:

      eager    one host issues every rank's list: its time per call / N
      replayed every rank's call captured in one CUDA graph: a replay's host time / N

  -> ``HostPoint``s; the copy engine's model takes its host term's growth with N from them
  (``fo_tune.engines.copy_engine.model``). The replays are measured in a task of their own after
  the eager times: one graph holds every rank's flag waits, and where the graph's executor cannot
  run them (a hang, ended by the task's time limit) the eager times and the GEMMs stay, the
  replayed ones NaN.
- The chunk GEMMs at TP=4/8 layer shapes (``TP_LAYERS``): each layer's whole GEMM (beta 0) and
  the engine's chunk GEMMs of M / N rows cut into ``LAYER_CHUNKS`` chunks, beta 0 and 1 (the sum
  in the epilogue), paced and sustained (``calibrate.LibraryGemmTask``) -> ``LibraryGemmPoint``s,
  which the model reads for those exact chunks at N > 2.

``merge_points`` adds both to a calibration's copy-engine section (its TP=2 points and parameters
stay). Measured on a sibling GPU of the calibration's (same die, compute capability and SM count;
``fo-tune calibrate --into-sibling``), the points merged record its device key in ``measured_on``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from fo_kernels.errors import install_hint
from fo_tune.calibrate.calibration import EngineCalibration, HostPoint, Quantity
from fo_tune.engines.copy_engine.calibrate import LibraryGemmTask, chunk_shapes
from fo_tune.ranks.pool import RankContext

# The world sizes whose host time is measured: TP=2 (the packaged calibration's, the base the model
# adds the growth to) up to TP=8, one NVLink switch domain's usual maximum.
HOST_WORLDS = tuple(range(2, 9))
HOST_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# Equal chunks per shard of the measured calls (HostTask's at TP=2; the model scales eager time per
# operation, so the count does not matter beyond giving every step more than one chunk).
HOST_CHUNKS = 2
# A small GEMM (rows per rank, N, K): the host is measured, not the GPU.
HOST_SHAPE = (512, 512, 512)
# Samples of one call (eager) or one replay each, every one issued under its own hold of the GPU
# (ms): one call of 8 ranks issues ~1,700 operations (all_reduce, 2 chunks), ~7 ms of host time.
# One call a hold: while the GPU is held every issued operation waits in its queue, and on one H100
# five eager calls of 8 ranks' all_reduce (~8,400 operations) or twenty replays of 5 ranks' filled
# it: the host then waited for the hold to end, and that wait read as host time (~HOLD / calls).
HOST_SAMPLES = 5
HOST_HOLD_MS = 50.0
# The replays' task ends a hang after this many seconds (its 21 points take a few seconds).
GRAPH_TASK_TIMEOUT_S = 60.0
# TP=4/8 row-parallel layers (M x N x K of one rank's GEMM, N peers): the MLP's down projection
# (K = intermediate size / TP, N = hidden size) and the attention output (K = hidden size / TP), M
# tokens per step. Hidden / intermediate sizes from the models' public configs: Llama-3 8B 4096 /
# 14336, Llama-3 70B 8192 / 28672, Qwen2.5 72B 8192 / 29568.
TP_LAYERS = (
    (8192, 8192, 3584, 8),  # Llama-3 70B down_proj, TP=8
    (8192, 8192, 7168, 4),  # Llama-3 70B down_proj, TP=4
    (8192, 8192, 1024, 8),  # Llama-3 70B o_proj, TP=8
    (8192, 8192, 3696, 8),  # Qwen2.5 72B down_proj, TP=8
    (4096, 4096, 3584, 4),  # Llama-3 8B down_proj, TP=4
    (4096, 4096, 1792, 8),  # Llama-3 8B down_proj, TP=8
)
# The same on the CPU (torch.mm; the pipeline runs, the numbers describe the CPU).
CPU_TP_LAYERS = ((64, 48, 32, 4), (64, 48, 16, 8))
# Chunks per shard the chunk GEMMs are measured at (the search space's ring chunks on Hopper).
LAYER_CHUNKS = (1, 2, 4)


def layer_gemm_shapes(cpu: bool) -> tuple[tuple[int, int, int, int], ...]:
    """(rows, N, K, beta) of every GEMM the copy engine runs for ``TP_LAYERS`` (``CPU_TP_LAYERS``
    on the CPU) at their world sizes, each layer's whole GEMM first."""
    out: list[tuple[int, int, int, int]] = []
    for m, n, k, world in CPU_TP_LAYERS if cpu else TP_LAYERS:
        out += chunk_shapes([(m, n, k)], LAYER_CHUNKS, world)
    return tuple(dict.fromkeys(out))


def _held_ms(fn: Any, device: torch.device) -> float:
    """Host ms of one call of ``fn`` issued while the GPU sleeps (``HOST_HOLD_MS``), median of
    ``HOST_SAMPLES``; NaN when a sample's hold ended before its call returned (the host may have
    waited for the GPU: not a host time)."""
    clock = torch.cuda.get_device_properties(device).clock_rate  # kHz: cycles per ms
    samples = []
    for _ in range(HOST_SAMPLES):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(int(HOST_HOLD_MS * clock))
        held = torch.cuda.Event()
        held.record()  # done when the hold ends
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
        if held.query():
            torch.cuda.synchronize(device)
            return math.nan
    torch.cuda.synchronize(device)
    return statistics.median(samples)


def _virtual_call(world: int, collective: str, device: torch.device, dtype: str) -> tuple[Any, float]:
    """(a call of ``world`` virtual ranks on ``device``, as a function; the operations one rank's
    eager call issues, mean over the ranks), its kernels loaded and three calls made."""
    from fo_kernels.engines.copy_engine.buffers import Dtypes
    from fo_kernels.engines.copy_engine.virtual import VirtualRanks, cuda_device

    rows, n, k = HOST_SHAPE
    kind = getattr(torch, dtype)
    gather = collective == "all_gather"
    m = rows * world
    ranks = VirtualRanks(world, cuda_device(device))
    a = [torch.randn(rows if gather else m, k, dtype=kind, device=device) for _ in range(world)]
    b = [torch.randn(k, n, dtype=kind, device=device) for _ in range(world)]
    vp = ranks.plan(collective, m, n, k, Dtypes(kind, kind), weights=(1,) * HOST_CHUNKS)
    outs = [torch.empty(p.out_rows, n, dtype=kind, device=device) for p in vp.plans]
    gathered = [torch.empty(m, k, dtype=kind, device=device) for _ in range(world)] if gather else None

    def call() -> None:
        ranks.issue(vp, a, b, outs, gathered)

    for _ in range(3):  # the first loads the kernels (the warm-up); then steady state
        call()
    torch.cuda.synchronize(device)
    return call, sum(len(p.ops) for p in vp.plans) / world


def eager_host(world: int, collective: str, device: torch.device, dtype: str) -> dict[str, Any]:
    """One rank's eager host time at ``world`` peers: every rank's call issued, over ``world``."""
    call, ops = _virtual_call(world, collective, device, dtype)
    eager = _held_ms(call, device)
    return {"world": world, "collective": collective, "ops": ops, "eager_ms": eager / world}


def graph_host(world: int, collective: str, device: torch.device, dtype: str) -> dict[str, Any]:
    """One rank's share of a replay's host time at ``world`` peers: every rank's call captured in
    one CUDA graph, its replay's host time over ``world``."""
    call, _ = _virtual_call(world, collective, device, dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize(device)
    return {
        "world": world,
        "collective": collective,
        "graph_ms": _held_ms(graph.replay, device) / world,
    }


@dataclass(frozen=True)
class HostNTask:
    """Host times at ``worlds`` x ``collectives`` (module docstring), eager or (``graphs``)
    replayed: {"why", "points": [dict per (world, collective)]}."""

    worlds: tuple[int, ...] = HOST_WORLDS
    collectives: tuple[str, ...] = HOST_COLLECTIVES
    dtype: str = "bfloat16"
    graphs: bool = False

    def run(self, ctx: RankContext) -> dict[str, Any]:
        from fo_kernels.wait import driver_module

        if ctx.device.type != "cuda":
            return {"why": f"needs a CUDA GPU; this rank runs on {ctx.device.type}", "points": []}
        if driver_module() is None:
            return {"why": f"needs cuda-bindings ({install_hint('cuda')})", "points": []}
        measure = graph_host if self.graphs else eager_host
        points = [measure(w, c, ctx.device, self.dtype) for w in self.worlds for c in self.collectives]
        return {"why": "", "points": points}


def host_points(eager: list[dict[str, Any]], graphs: list[dict[str, Any]]) -> list[HostPoint]:
    """``HostPoint``s of the eager measurements, with the replayed ones where there are (NaN
    where the replays were not measured)."""
    replayed = {(g["world"], g["collective"]): g["graph_ms"] for g in graphs}
    return [
        HostPoint(
            world=e["world"],
            collective=e["collective"],
            chunks=HOST_CHUNKS,
            ops=e["ops"],
            eager_ms=e["eager_ms"],
            graph_ms=replayed.get((e["world"], e["collective"]), math.nan),
        )
        for e in eager
    ]


def layer_task(cpu: bool, dtype: str) -> LibraryGemmTask:
    """The chunk GEMMs of ``TP_LAYERS`` beside their whole GEMMs (module docstring)."""
    return LibraryGemmTask(layer_gemm_shapes(cpu), dtype)


def merge_points(
    old: EngineCalibration | None, new: EngineCalibration, measured_on: str = ""
) -> EngineCalibration:
    """``old`` with ``new``'s library points and host points added (a point of the same shape, or
    the same world size, collective and chunks, replaced) and its parameters over ``old``'s.

    ``measured_on``: the device key of the GPU that measured ``new`` where it is another model than
    ``old``'s calibration (a sibling of the same die, ``--into-sibling``); each of ``new``'s points
    records it and each of its parameters' sources names it."""
    if measured_on:
        new = from_sibling(new, measured_on)
    if old is None:
        return new
    gemm = {(p.m, p.n, p.k, p.beta): p for p in [*old.library_gemm, *new.library_gemm]}
    host = {(p.world, p.collective, p.chunks): p for p in [*old.host, *new.host]}
    return EngineCalibration(
        params={**old.params, **new.params},
        library_gemm=list(gemm.values()),
        copies=new.copies or old.copies,
        host=sorted(host.values(), key=lambda p: (p.collective, p.world, p.chunks)),
    )


def from_sibling(section: EngineCalibration, measured_on: str) -> EngineCalibration:
    """``section`` as measured on ``measured_on`` (a device key): its library and host points carry
    it, its parameters' sources name it."""
    return EngineCalibration(
        params={
            name: Quantity(value=q.value, source=f"{q.source}; measured on {measured_on}, a sibling GPU")
            for name, q in section.params.items()
        },
        library_gemm=[dataclasses.replace(p, measured_on=measured_on) for p in section.library_gemm],
        copies=section.copies,
        host=[dataclasses.replace(p, measured_on=measured_on) for p in section.host],
    )
