"""The copy engine's cost-model term: library GEMM chunks, peer copies, flags, the host.

The engine (``fo_kernels.engines.copy_engine``) runs a ring reduce-scatter over N peers: rank r owns shard
r of the output rows (M/N rows), each shard cut into row chunks by the schedule's weights. In step
s = 0 .. N-1 rank r computes its contribution to shard (r + s + 1) mod N chunk by chunk (beta = 0
at step 0; beta = 1 after, adding the partial pulled from its neighbour), flags each chunk, and its
neighbour pulls it with a copy engine (no SM). Step N - 1 is its own shard: the sums. AllReduce
then pulls the N - 1 final shards from their owners. At N = 2 this is phase 1 (the peer's half,
chunk by chunk) and phase 2 (my half, beta = 1 onto the pulled partial). Every rank runs the same
timeline, so one rank's is simulated; per chunk c of step s::

    start(s, c) = max(GEMMs before it end, pulled(s - 1, c) + flag_ms)         (s > 0)
    end(s, c)   = start + library(rows_c, N, K, beta = s > 0, fill) * copy_contention
                  + chunk_overhead_ms                                           (chunks alternate
                                                                                 on two streams)
    pulled(s, c) = max(end(s, c) + flag_ms, side stream free) + copy(rows_c * N bytes)
    copy(b)     = peer_copy_latency_ms + b / peer_copy_gbs
    AllReduce:  gather(c) = max(end(N - 1, c) + flag_ms, side free) + copy((N - 1) * rows_c * N)
    device      = last GEMM end + gather_exposed * (last gather end - last GEMM end)
                  + call_overhead_ms

``gather_exposed`` is the part of AllReduce's last gather that back-to-back calls do not hide
behind the next call's first GEMMs. The tiled mode (N = 2) runs each phase as one persistent Triton
GEMM on every SM: ``tiled_gemm_factor`` x the calibration's tile profile for (M/2, N, K) (its
nearest profiled point scaled by waves x K, x the library clock), phase 2 slower by
``tiled_remote_store_factor`` for AllReduce (its tiles also store their sums into the peer's
memory); phase 2's tiles of chunk c wait in the kernel, after their K loop, for chunk c's pull (so
a chunk's first wave ends no earlier than its pull; ``chunk_overhead_ms`` per chunk for its
counter, notify and wait), and AllReduce ends with the peer's local copy of the pushed sums. Calls
replayed from the engine's own CUDA graphs (every call whose addresses repeat, as the search and
the bench time them) cost ``host_graph_call_ms`` of host time; eager ones ``host_eager_op_ms`` per
operation issued
(``eager_ops``). A call costs ``max(device, host)``. Both constants were measured through the whole
op at N = 2. Where the calibration has host times at N peers (``copy_engine.host``: virtual ranks
on one GPU, ``fo-tune calibrate --only copy_engine_n``), the host term at N adds what they grew by
from N = 2 (interpolated between measured N, extended linearly past them)::

    replayed  host_graph_call_ms + graph(N) - graph(2)                 graph: a rank's replay
    eager     (host_eager_op_ms + op(N) - op(2)) x operations          op: a rank's eager time per op

Without them the term keeps the N = 2 constants at every N (the growth with N then comes only
from the operation count of an eager call). Chunk GEMMs at N > 2 whose exact shape the
calibration measured (``copy_engine_n``'s TP=4/8 layers) take the measured time over the wave
model (``LibraryGemm.time(measured_fill=True)``); at N = 2 the wave model stays, as the free
parameters were fitted with it.

AllGather + GEMM (ring mode only; unvalidated: no all_gather was ever measured on GPUs, and the
section's free parameters were fitted to AllReduce and ReduceScatter rows). Rank r copies its
(M/N) x K shard into its symmetric buffer (a local copy) and flags its peers; its own rows' GEMM
runs at once; the side stream pulls each peer's shard chunk by chunk (peers in ring order), and
each chunk's GEMM waits only for its pull::

    shard_ready = local copy(M/N x K bytes) + flag_ms
    own         = library(M/N, N, K, fill) * copy_contention + chunk_overhead_ms    (from 0)
    pulled(q, c) = max(shard_ready, side free) + copy(rows_c x K bytes)              (in order)
    end(q, c)   = max(previous GEMM end, pulled(q, c))
                  + library(rows_c, N, K, fill) * copy_contention + chunk_overhead_ms
    device      = last GEMM end + call_overhead_ms

An eager call's operations are counted from the protocol itself (``fo_kernels.engines.copy_engine.modes
.plan_call``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fo_kernels.engines.copy_engine.layout import chunk_bounds, tile_row_bounds
from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
from fo_kernels.plan import cdiv
from fo_kernels.schedule import Schedule
from fo_tune.model.types import Prediction, element_bytes, output_bytes

if TYPE_CHECKING:
    from fo_tune.calibrate.calibration import HostPoint
    from fo_tune.model.core import CostModel

# The parameters the term reads beyond the library model's (fo_tune.model.library.PARAMS).
PARAMS = {
    "peer_copy_latency_ms": "a copy-engine copy of peer memory: fixed cost (ms)",
    "peer_copy_gbs": "a copy-engine copy of peer memory: bandwidth (GB/s)",
    "local_copy_latency_ms": "a copy-engine copy within one GPU: fixed cost (ms)",
    "local_copy_gbs": "a copy-engine copy within one GPU: bandwidth (GB/s)",
    "flag_ms": "a flag written into the peer's memory until a stream waiting on it runs (ms)",
    "chunk_overhead_ms": "GPU time a chunk adds beyond its GEMM and its copy (ms)",
    "call_overhead_ms": "GPU time a call adds beyond its chunks: graph launch, stream joins (ms)",
    "copy_contention": "a GEMM's time beside copy-engine traffic over its time alone",
    "gather_exposed": "the part of AllReduce's last gather back-to-back calls do not hide",
    "tiled_gemm_factor": "a tiled-mode phase over the tile profile's GEMM of its shape",
    "tiled_remote_store_factor": "a phase-2 GEMM storing into the peer's memory over a local one",
    "host_graph_call_ms": "host time of a call replayed from the engine's own CUDA graph (ms)",
    "host_eager_op_ms": "host time per operation of an eager call (ms)",
}
# Operations an eager call issues (counted from fo_kernels.engines.copy_engine's protocol): per call the
# PULLED / GATHERED waits and flags and the stream joins; per chunk and step a GEMM, its flag
# write, the pull's wait and copy, the next step's wait; AllReduce per chunk the gather's flag,
# wait and copy and the local copy of the sums.
EAGER_OPS_PER_CALL = 8
EAGER_OPS_PER_CHUNK_STEP = 5
EAGER_OPS_PER_CHUNK_GATHER = 4


def chunk_rows(rows: int, weights: tuple[int, ...]) -> list[int]:
    """Rows of each chunk of a shard, cut as the runtime cuts them (``chunk_bounds``)."""
    return [b - a for a, b in itertools.pairwise(chunk_bounds(rows, weights))]


@dataclass
class _Pulls:
    """A call's copies in issue order: when each one's data was ready, began, ended, and its time."""

    ready: list[float] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    comm: list[float] = field(default_factory=list)

    def add(self, ready: float, start: float, copy: float) -> float:
        """Record a copy of ``copy`` ms that begins at ``start``; returns when it ends."""
        self.ready.append(ready)
        self.start.append(start)
        self.end.append(start + copy)
        self.comm.append(copy)
        return start + copy


def eager_ops(collective: str, world: int, chunks: int) -> int:
    """Operations an eager call issues (see ``EAGER_OPS_PER_*``)."""
    gather = EAGER_OPS_PER_CHUNK_GATHER * chunks if collective == "all_reduce" else 0
    return EAGER_OPS_PER_CALL + EAGER_OPS_PER_CHUNK_STEP * chunks * world + gather


# The world size the host constants (host_graph_call_ms, host_eager_op_ms) were measured at: the
# growth measured with virtual ranks is added from here.
HOST_BASE_WORLD = 2


def _at(points: Mapping[int, float], world: int) -> float:
    """``points`` (world -> value) at ``world``: exact, interpolated between the two measured world
    sizes around it, or extended linearly from the two nearest."""
    if world in points:
        return points[world]
    xs = sorted(points)
    below = [x for x in xs if x < world]
    above = [x for x in xs if x > world]
    if below and above:
        x0, x1 = below[-1], above[0]
    else:
        x0, x1 = (xs[-2], xs[-1]) if below else (xs[0], xs[1])
    return points[x0] + (points[x1] - points[x0]) * (world - x0) / (x1 - x0)


class CopyEngineTerm:
    """Predictions of copy-engine schedules (see the module docstring); ``host``: the
    calibration's host times at N peers (``HostPoint``s), if any."""

    def __init__(self, model: CostModel, params: Mapping[str, float], host: Sequence[HostPoint] = ()) -> None:
        self.model = model
        self.p = dict(params)
        self._graph: dict[str, dict[int, float]] = {}
        self._per_op: dict[str, dict[int, float]] = {}
        for point in host:  # (a time not measured, or not measurable, is NaN: left out)
            if not math.isnan(point.graph_ms):
                self._graph.setdefault(point.collective, {})[point.world] = point.graph_ms
            if not math.isnan(point.eager_ms):
                self._per_op.setdefault(point.collective, {})[point.world] = point.eager_ms / point.ops

    def copy_ms(self, nbytes: float, *, peer: bool = True) -> float:
        kind = "peer" if peer else "local"
        return self.p[f"{kind}_copy_latency_ms"] + nbytes / (self.p[f"{kind}_copy_gbs"] * 1e6)

    def host_growth(self, collective: str, world: int, *, graphed: bool) -> float:
        """How much a rank's host time (replayed: per call; eager: per operation) grows from
        ``HOST_BASE_WORLD`` to ``world`` peers, from the measured host times (0.0 without them,
        or without a measurement at the base and one more world size)."""
        points = (self._graph if graphed else self._per_op).get(collective, {})
        if HOST_BASE_WORLD not in points or len(points) < 2:
            return 0.0
        return _at(points, world) - points[HOST_BASE_WORLD]

    def host_ms(self, schedule: Schedule, chunks: int, *, graphed: bool, ops: int | None = None) -> float:
        """A rank's host time of a call (``ops``: an eager call's operation count, default
        ``eager_ops``)."""
        collective, world = schedule.collective, schedule.world_size
        grow = self.host_growth(collective, world, graphed=graphed)
        if graphed:
            return self.p["host_graph_call_ms"] + grow
        ops = eager_ops(collective, world, chunks) if ops is None else ops
        return (self.p["host_eager_op_ms"] + grow) * ops

    def _chunk_ms(self, rows: int, n: int, k: int, world: int, *, beta: int = 0, fill: bool = False) -> float:
        """A chunk GEMM alone: its measured time at N > 2 where the calibration has its shape."""
        return self.model.library.time(
            rows, n, k, beta=beta, fill=fill, measured_fill=world > HOST_BASE_WORLD
        )

    @staticmethod
    def _prediction(
        device: float,
        host: float,
        gemm_alone: float,
        gemm_busy: float,
        pulls: _Pulls,
        exposed: float,
        gemm_source: str = "library",
    ) -> Prediction:
        return Prediction(
            total_ms=max(device, host),
            device_ms=device,
            host_ms=host,
            gemm_alone_ms=gemm_alone,
            gemm_ms=gemm_busy,
            engine="copy_engine",
            group_ready_ms=tuple(pulls.ready),
            group_start_ms=tuple(pulls.start),
            group_end_ms=tuple(pulls.end),
            group_comm_ms=tuple(pulls.comm),
            exposed_comm_ms=exposed,
            gemm_source=gemm_source,
        )

    def predict(self, schedule: Schedule, m: int, n: int, k: int, *, graphed: bool = True) -> Prediction:
        st = schedule.settings
        assert isinstance(st, CopyEngineSettings)
        if st.mode == "tiled":
            return self._tiled(schedule, st, m, n, k, graphed=graphed)
        if schedule.collective == "all_gather":
            return self._ring_all_gather(schedule, st, m, n, k, graphed=graphed)
        return self._ring(schedule, st, m, n, k, graphed=graphed)

    def _ring(
        self, schedule: Schedule, st: CopyEngineSettings, m: int, n: int, k: int, *, graphed: bool
    ) -> Prediction:
        p, world = self.p, schedule.world_size
        elem = output_bytes(schedule.dtype)  # (the partial sums: the output's dtype)
        rows = chunk_rows(cdiv(m, world), st.weights)
        fill = len(rows) * world > 1
        compute = side = 0.0
        pulled: list[float] = []
        pulls = _Pulls()
        gemm_alone = gemm_busy = 0.0
        for step in range(world):
            now_pulled, finished = [], []
            for c, r in enumerate(rows):
                dep = pulled[c] + p["flag_ms"] if step else 0.0
                alone = self._chunk_ms(r, n, k, world, beta=1 if step else 0, fill=fill)
                dur = alone * p["copy_contention"] + p["chunk_overhead_ms"]
                gemm_alone += alone
                gemm_busy += dur
                compute = max(compute, dep) + dur
                finished.append(compute)
                if step < world - 1:
                    side = pulls.add(compute, max(compute + p["flag_ms"], side), self.copy_ms(r * n * elem))
                    now_pulled.append(side)
            pulled = now_pulled
        device, exposed = compute, 0.0
        if schedule.collective == "all_reduce":  # the sums' chunks are gathered in order
            for r, summed in zip(rows, finished, strict=True):
                copy = self.copy_ms((world - 1) * r * n * elem)
                side = pulls.add(summed, max(summed + p["flag_ms"], side), copy)
            exposed = max(0.0, side - compute)
            device = compute + p["gather_exposed"] * exposed
        device += p["call_overhead_ms"]
        host = self.host_ms(schedule, len(rows), graphed=graphed)
        return self._prediction(device, host, gemm_alone, gemm_busy, pulls, exposed)

    def _ring_all_gather(
        self, schedule: Schedule, st: CopyEngineSettings, m: int, n: int, k: int, *, graphed: bool
    ) -> Prediction:
        """AllGather + GEMM on the gathered (m, n, k) (module docstring)."""
        p, world = self.p, schedule.world_size
        elem = element_bytes(schedule.dtype)
        shard = m // world
        rows = chunk_rows(shard, st.weights)
        shard_ready = self.copy_ms(shard * k * elem, peer=False) + p["flag_ms"]
        own = self._chunk_ms(shard, n, k, world, fill=True)
        gemm_alone = own
        compute = gemm_busy = own * p["copy_contention"] + p["chunk_overhead_ms"]
        side, waited = shard_ready, 0.0
        pulls = _Pulls()
        for _peer in range(world - 1):
            for r in rows:
                side = pulls.add(shard_ready, side, self.copy_ms(r * k * elem))
                alone = self._chunk_ms(r, n, k, world, fill=True)
                dur = alone * p["copy_contention"] + p["chunk_overhead_ms"]
                waited += max(0.0, side - compute)
                compute = max(compute, side) + dur
                gemm_alone += alone
                gemm_busy += dur
        device = compute + p["call_overhead_ms"]
        ops = None
        if not graphed:
            from fo_kernels.engines.copy_engine.modes import plan_call

            ops = len(plan_call("ring", "all_gather", world, 0, m, n, k, st.weights).ops)
        host = self.host_ms(schedule, len(rows), graphed=graphed, ops=ops)
        return self._prediction(device, host, gemm_alone, gemm_busy, pulls, waited)

    def _tiled(
        self, schedule: Schedule, st: CopyEngineSettings, m: int, n: int, k: int, *, graphed: bool
    ) -> Prediction:
        p, model = self.p, self.model
        assert st.tile is not None
        elem = output_bytes(schedule.dtype)
        half = cdiv(m, 2)
        t0, source = model.tile_profile.scaled_time(st.tile, half, n, k, model.sm_count, split=False)
        t1 = t0 * p["tiled_gemm_factor"] * model.library.clock
        remote = p["tiled_remote_store_factor"] if schedule.collective == "all_reduce" else 1.0
        t2 = t1 * remote
        rows = [b - a for a, b in itertools.pairwise(tile_row_bounds(half, st.weights, st.tile.block_m))]
        side, done = 0.0, 0
        pulls = _Pulls()
        # phase 2 runs its chunks in order; a tile computes its K loop, then waits for its chunk's
        # pull: a chunk's first wave can end no earlier than its pull, later waves are not held
        wave = t2 / cdiv(cdiv(half, st.tile.block_m) * cdiv(n, st.tile.block_n), model.sm_count)
        end2 = t1
        for r in rows:  # phase 1 progresses evenly over its chunks
            done += r
            phase1_end = t1 * done / half
            side = pulls.add(phase1_end, max(phase1_end + p["flag_ms"], side), self.copy_ms(r * n * elem))
            work = t2 * r / half
            first = min(work, wave)
            end2 = max(end2 + first, side) + (work - first) + p["chunk_overhead_ms"]
        device, exposed = end2 + p["call_overhead_ms"], max(0.0, side - t1)
        if schedule.collective == "all_reduce":  # the peer copies my pushed sums into its output
            tail = p["flag_ms"] + self.copy_ms(half * n * elem, peer=False)
            device += p["gather_exposed"] * tail
            exposed = tail
        host = self.host_ms(schedule, len(rows), graphed=graphed)
        return self._prediction(device, host, 2 * t0, t1 + t2, pulls, exposed, source)
