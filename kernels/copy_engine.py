"""The ``copy_engine`` engine: GEMM + ReduceScatter / AllReduce between two NVLink peers, no NCCL.

On Hopper, NCCL's kernels need SMs that a GEMM also wants, and beside a GEMM both slow down
(``docs/perf-notes.md``). Here the data moves through the GPUs' copy engines, which use no SM, and
the reduction is folded into cuBLAS's ``beta = 1`` epilogue. Rank r owns shard r of the output rows
(``shard_rows``); each shard is cut into row chunks by the schedule's ``groups`` weights::

    main stream   [wait PULLED]  phase 1: for each chunk c of the PEER's shard:
                      part[c] = A[peer rows c] @ B            (into my symmetric buffer)
                      set peer.flag[PARTIAL + c]              (cuStreamWriteValue32, system fence)
                  phase 2: for each chunk c of MY shard:
                      wait pulled[c];  dst[c] += A[my rows c] @ B   (addmm_: the sum, in the epilogue)
                      [all_reduce] set peer.flag[SUMMED + c]
    side stream   [all_reduce: wait GATHERED]  for each chunk c: wait my flag[PARTIAL + c];
                      dst[c] = peer.part[c]                   (a copy of peer memory: copy engine)
                  set peer.flag[PULLED]                       (I have finished reading peer.part)
                  [all_reduce] for each chunk c: wait my flag[SUMMED + c];
                      out[peer rows c] = peer.final[c]        (and, on a third stream, out[my rows
                  set peer.flag[GATHERED]                      c] = final[c] as each is summed)

``dst`` is the caller's output for ReduceScatter and my symmetric ``final`` buffer for AllReduce
(the peer copies my sums from it). The "main stream" GEMMs alternate between the caller's stream
and a second one (``GEMM_STREAMS``), each chunk's flag written after its GEMM on its own stream:
the next chunk's tiles then fill the SMs a GEMM's last wave leaves, instead of waiting for it to
drain (runs 40 and 48 in ``docs/perf-notes.md``: faster in 14 of 15 suite cases, by up to 11%).
A flag is set to 1 by the peer and reset to 0 by the stream that waited for it, so every call
issues the same operations: a call can be captured in a CUDA graph and replayed (after one eager
call of its shape, which makes the buffers; the buffers then must not grow, so the largest shape
runs eagerly before any capture). PULLED and GATHERED start at 1 and guard my buffers: phase 1 of a
call rewrites ``part`` only after the peer has pulled the previous call's, and the pulls and phase
2 rewrite ``final`` only after the peer has gathered the previous call's sums. No flag is set twice
before its reset, because every shard has a row (M >= 2; the ops run M = 1 as GEMM then the
collective): the peer sets a call's PARTIAL / SUMMED only after its wait for my PULLED / GATHERED
of the call before, which my side stream sends after resetting them; and it sets my PULLED /
GATHERED only after reading this call's data, which I flag after resetting PULLED / GATHERED in
this call. Both ranks must make the same calls in the same order, as with any collective.

A call's host time, not the GPU, bounded small shapes (run 18 in ``docs/perf-notes.md``: ~0.1 ms of
launches per chunk through torch streams, events and copies), so the waits, flag writes and copies
go straight to the driver (cuda-bindings) with the views and addresses of a ``_Plan`` made once per
(collective, M, N, dtype, weights). Even so an eager call issues ~10 operations per chunk from
Python (~0.34 ms at 2048x4096x4096 against ~0.15 ms of GPU work, run 25), so an eager call whose
operand and output addresses repeat (a training or serving loop's steady state: the caching
allocator hands out the same blocks) is captured into a CUDA graph of its own the
``graph_after``-th time it is seen and replayed from then on: one launch instead of dozens. The
graph issues exactly the operations of an eager call, so a rank replaying and a rank issuing
eagerly stay in step. The graphs are dropped when the buffers grow.

Two more modes (``run``'s ``tile`` and ``exchange``, a schedule's ``tile`` and ``exchange``):

- tiled (``_run_tiled``): each phase is one persistent Triton GEMM on all SMs instead of a cuBLAS
  GEMM per chunk (no chunk pays a small GEMM's wave quantization); its tiles count per chunk, a
  notify stream forwards each finished chunk, and each tile of phase 2 waits in the kernel for its
  chunk's pull before adding it in float32 (``fo_kernels.gemm.rows_gemm``). Its AllReduce stores
  each sum into the peer's ``final`` as well (NVLink stores from the kernel) and counts it there, so
  no pull of the sums waits for the GEMM's end; the peer copies them into its output. The peer
  writes my ``final`` in a call only after pulling my partials of that call, which I issue after my
  previous call has copied the last sums out of it;
- exchange (``_run_exchange``, all_reduce): the chunks cut all M rows; each rank pulls the peer's
  whole partial into the output and adds its own, one NVLink hop per byte.

Every mode issues a call's main-stream work before the side streams' waits that depend on the
peer: two streams can share one of the GPU's hardware queues, and a wait queued first would block
the work the peer waits for (run 34 in ``docs/perf-notes.md`` hung that way).

Needs CUDA, two GPUs with peer access (NVLink), ``torch.distributed._symmetric_memory`` and
cuda-bindings (``pip install 'fo-tune[cuda]'``); ``CopyEnginePeers`` says what is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import EnvironmentMismatchError, ScheduleError, ShapeError
from .gemm import BOperand, rows_gemm
from .graphs import GRAPH_AFTER_CALLS, GRAPH_CACHE_SIZE, SEEN_CACHE_SIZE, OutputPool, end_generator_capture
from .schedule import MAX_CHUNKS, Tile
from .wait import _driver_module

# The peers this module's protocol connects (each rank owns one half of the rows).
COPY_ENGINE_WORLD = 2
# Flag slots, each 0 or 1: [PARTIAL, PARTIAL + MAX_CHUNKS) the peer's partial of my chunk c is
# ready, [SUMMED, ...) the peer's summed chunk c is ready (all_reduce), PULLED / GATHERED: the
# peer has finished reading my ``part`` / ``final`` buffer (both start at 1: nothing to read).
PARTIAL = 0
SUMMED = MAX_CHUNKS
PULLED = 2 * MAX_CHUNKS
GATHERED = PULLED + 1
# Tiled mode: [READY, READY + MAX_CHUNKS) my side stream has pulled the peer's partial of my chunk c
# into its destination (set and reset by me; the phase-2 kernel's tiles wait on it).
READY = GATHERED + 1
FLAG_SLOTS = READY + MAX_CHUNKS
# Tiled mode's tile counters (local, kernel-incremented), one per chunk of the peer's shard: phase 1's
# tiles done. (Its AllReduce counts the summed tiles it stores into the peer's memory in the peer's
# SUMMED flag slots, which the waiting side stream resets.)
COUNTER_SLOTS = MAX_CHUNKS
# Inner chunk cuts fall on multiples of this many rows when the shard is big enough: 128 is the
# tallest cuBLAS tile on Hopper, so no chunk's GEMM ends in a partly filled row of tiles.
ROW_ALIGN = 128
# Symmetric buffers are sized in multiples of this many bytes, so a byte buffer grown for one dtype
# can be viewed as any other (float32 needs a size divisible by 4).
BUFFER_ALIGN = 16
# Plans kept per peers object (one per (collective, M, N, dtype, weights)); serving sees many M.
PLAN_CACHE_SIZE = 256
# The cuBLAS-chunk mode's chunk GEMMs alternate between this many streams (the caller's and
# ``_alt``): a GEMM's last, partly filled wave then shares the GPU with the next chunk's first
# tiles instead of leaving SMs idle at every chunk boundary (1: all on the caller's stream).
GEMM_STREAMS = 2
# AllReduce: my sums go into the output in one copy once the last chunk is summed (True), instead of
# one copy per chunk beside the remaining GEMMs (False). Beside a GEMM such a copy competes for HBM
# and, small, runs as an SM kernel in a graph ("memcpy128" in run 43's timeline); at the end it runs
# beside the last chunk's gather, which takes as long or longer up to ~5 chunks per shard (a local
# copy moves ~1.7 TB/s, a pull ~0.3-0.38 TB/s: runs 18 and 43 in docs/perf-notes.md). Off: run 48
# measured it 0.3-1.4% faster on the suite's AllReduce shapes, but that run's GPU tests ran past
# their time limit (the last test passed alone in run 49); the shipped tables were searched without.
OWN_COPY_AT_END = False


def copy_engine_blocker(device: torch.device, world_size: int) -> str:
    """Why this rank cannot run the engine, as a phrase after "engine copy_engine" ("" if it can).
    Local checks only; making the symmetric buffers (a rendezvous of both ranks) can still fail."""
    if device.type != "cuda":
        return f"needs CUDA GPUs with peer access; this call runs on {device.type}"
    if world_size != COPY_ENGINE_WORLD:
        return f"runs between exactly {COPY_ENGINE_WORLD} ranks, this group has {world_size}"
    if _driver_module() is None:
        return "needs cuda-bindings (pip install 'fo-tune[cuda]')"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return "needs torch.distributed._symmetric_memory, which this torch lacks"
    return ""


def shard_rows(m: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rows [r0, r1) that rank 0 and rank 1 own: the first ceil(M/2) rows, then the rest."""
    half = (m + 1) // 2
    return (0, half), (half, m)


def chunk_bounds(rows: int, weights: tuple[int, ...], align: int | None = None) -> list[int]:
    """Row boundaries cutting ``rows`` by ``weights`` (each chunk >= 1 row; fewer chunks when the
    shard has fewer rows than weights). Inner cuts are rounded to ``align`` (default: to
    ``ROW_ALIGN`` when every chunk can still get a row)."""
    if rows <= 0:
        return [0]
    if align is None:
        align = ROW_ALIGN if rows >= ROW_ALIGN * len(weights) else 1
    total = sum(weights)
    bounds = [0]
    acc = 0
    for w in weights[:-1]:
        acc += w
        cut = round(rows * acc / total / align) * align
        if bounds[-1] < cut < rows:
            bounds.append(cut)
    bounds.append(rows)
    return bounds


def tile_row_bounds(rows: int, weights: tuple[int, ...], block_m: int) -> list[int]:
    """The tiled mode's row chunks: ``rows`` cut by ``weights`` on whole tile rows of ``block_m``
    (each chunk >= 1 tile row, so each tile belongs to exactly one chunk; fewer chunks when the
    shard has fewer tile rows than weights)."""
    tile_rows = -(-rows // block_m)
    return [min(c * block_m, rows) for c in chunk_bounds(tile_rows, weights, align=1)]


@dataclass(frozen=True)
class _Plan:
    """What a call of one (collective, M, N, dtype, chunk weights) reuses: the row chunks, the views
    of the symmetric buffers the GEMMs write, and the byte addresses the copies read and write (the
    host cost of a call is most of a small shape's time, run 18 in ``docs/perf-notes.md``)."""

    mine: tuple[int, int]  # my shard's rows of the output
    theirs: tuple[int, int]
    own: tuple[tuple[int, int], ...]  # chunks of my shard, rows relative to it
    other: tuple[tuple[int, int], ...]  # chunks of the peer's shard
    row_bytes: int
    part: tuple[torch.Tensor, ...]  # my partials of the peer's chunks (phase 1 GEMM outputs)
    final: tuple[torch.Tensor, ...]  # all_reduce: my summed chunks (phase 2 outputs), else ()
    final_base: int  # all_reduce: my ``final`` buffer's address (the pulls' destination), else 0
    pull_src: tuple[int, ...]  # the peer's partials of my chunks (its ``part``)
    final_src: tuple[int, ...]  # all_reduce: my summed chunks' addresses
    gather_src: tuple[int, ...]  # all_reduce: the peer's summed chunks (its ``final``)


@dataclass(frozen=True)
class _Mode:
    """How a call runs: a cuBLAS GEMM per chunk (the default), ``tile``: the tiled mode, or
    ``exchange``: AllReduce by exchanging whole partials (see ``_run_exchange``)."""

    tile: Tile | None = None
    exchange: bool = False


CHUNKED = _Mode()


def _plan_key(
    collective: str, m: int, n: int, dtype: torch.dtype, weights: tuple[int, ...], mode: _Mode
) -> tuple:
    """The key of a call's plan (``_Plan``, ``_TiledPlan`` or ``_ExchangePlan``, by ``mode``)."""
    return (collective, m, n, dtype, weights, mode)


@dataclass(frozen=True)
class _ExchangePlan:
    """What an exchange-mode call of one (M, N, dtype, weights) reuses: chunks of all M rows, the
    views of my ``part`` buffer the GEMMs write and the peer's partials' addresses."""

    chunks: tuple[tuple[int, int], ...]
    row_bytes: int
    part: tuple[torch.Tensor, ...]  # my partial of each chunk (the peer pulls it)
    pull_src: tuple[int, ...]  # the peer's partial of each chunk (its ``part``)


@dataclass(frozen=True)
class _TiledPlan:
    """What a tiled-mode call of one (collective, M, N, dtype, weights, tile) reuses: row chunks on
    whole tile rows, each tile row's chunk and each chunk's tile count (the kernel's groups and the
    counters' targets), the buffer views the two GEMMs write and the copies' addresses."""

    mine: tuple[int, int]
    theirs: tuple[int, int]
    own: tuple[tuple[int, int], ...]  # chunks of my shard, rows relative to it
    other: tuple[tuple[int, int], ...]  # chunks of the peer's shard
    row_bytes: int
    part: torch.Tensor  # (rows of the peer's shard, N): my partials (phase 1's output)
    own_groups: torch.Tensor  # int32 chunk of each tile row of my shard
    other_groups: torch.Tensor  # ... of the peer's shard
    # tiles per chunk of the peer's shard: phase 1's counter targets, and (all_reduce) those of the
    # peer's summed tiles it counts in my SUMMED slots
    other_tiles: tuple[int, ...]
    pull_src: tuple[int, ...]  # the peer's partials of my chunks (its ``part``)
    peer_final: torch.Tensor | None  # all_reduce: (rows of my shard, N) of the peer's ``final``
    final_src: tuple[int, ...]  # all_reduce: the peer's sums of its chunk c, in my ``final``


@dataclass
class CopyEnginePeers:
    """The symmetric buffers, flags, streams, events and plans of one (device, 2-rank group)."""

    device: torch.device
    group: dist.ProcessGroup | None = None
    _capacity: int = 0
    _part: torch.Tensor | None = field(default=None, repr=False)
    _final: torch.Tensor | None = field(default=None, repr=False)
    _peer_part: torch.Tensor | None = field(default=None, repr=False)
    _peer_final: torch.Tensor | None = field(default=None, repr=False)
    _flags: torch.Tensor | None = field(default=None, repr=False)
    _peer_flags: torch.Tensor | None = field(default=None, repr=False)
    _side: torch.cuda.Stream | None = field(default=None, repr=False)
    _local: torch.cuda.Stream | None = field(default=None, repr=False)
    _notify: torch.cuda.Stream | None = field(default=None, repr=False)  # tiled: counters -> peer
    _alt: torch.cuda.Stream | None = field(default=None, repr=False)  # every other chunk GEMM
    _counters: torch.Tensor | None = field(default=None, repr=False)  # tiled: COUNTER_SLOTS int32
    _calls: int = 0
    _events: list = field(default_factory=list, repr=False)
    _agreed: set = field(default_factory=set, repr=False)
    _plans: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _streams: dict = field(default_factory=dict, repr=False)
    # Streams the cuBLAS-chunk mode's chunk GEMMs alternate between (``GEMM_STREAMS``): 1 or 2.
    gemm_streams: int = GEMM_STREAMS
    # AllReduce: my sums into the output in one copy after the last chunk (``OWN_COPY_AT_END``).
    own_copy_at_end: bool = OWN_COPY_AT_END
    # Capture an eager call into a graph of its own after this many calls with the same key (the
    # shape, the operands' and the output's addresses); 0 never does (every call issues eagerly).
    graph_after: int = GRAPH_AFTER_CALLS
    _graphs: OrderedDict = field(default_factory=OrderedDict, repr=False)  # key -> CUDAGraph
    _seen: OrderedDict = field(default_factory=OrderedDict, repr=False)  # key -> calls seen
    _capture_stream: torch.cuda.Stream | None = field(default=None, repr=False)
    replays: int = 0  # calls served by a graph of the engine's own (tests and probes read it)
    _last_main: torch.cuda.Stream | None = field(default=None, repr=False)  # the last call's stream
    _outputs: OutputPool | None = field(default=None, repr=False)  # the outputs' memory pool
    _capturing_own: bool = False  # inside ``_capture``: nothing recorded has run
    # The first own graph, never dropped: cuBLAS's workspace for the capture stream was allocated
    # in its memory pool and every later graph uses it, so that pool must outlive them all.
    _first_graph: object | None = field(default=None, repr=False)
    graph_failure: str = ""  # why a capture failed (graph_after is 0 since), for probes and reports
    _captured: bool = False  # a caller's CUDA graph holds the buffers' addresses: they must not move
    _broken: str = ""  # why an earlier call failed part-way (the ranks' flags are out of step)

    def __post_init__(self) -> None:
        if self.gemm_streams not in (1, 2):
            raise ValueError(f"gemm_streams: 1 or 2 streams for the chunk GEMMs, got {self.gemm_streams}")
        why = copy_engine_blocker(self.device, dist.get_world_size(self.group))
        if why:
            raise EnvironmentMismatchError(
                f"engine copy_engine {why}; use a table row with engine: triton or overlap: false here"
            )
        drv = _driver_module()
        self._driver = drv
        self._ok = drv.CUresult.CUDA_SUCCESS
        self._geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._fence_write = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self.rank = dist.get_rank(self.group)
        self.peer = 1 - self.rank
        self._flags, self._peer_flags = self._symmetric(FLAG_SLOTS, torch.int32)
        self._flags.zero_()
        self._flags[[PULLED, GATHERED]] = 1
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group, device_ids=[self.device.index])
        self._side = torch.cuda.Stream(self.device, priority=-1)
        self._local = torch.cuda.Stream(self.device, priority=-1)
        size = self._flags.element_size()
        self._my_flag = [drv.CUdeviceptr(self._flags.data_ptr() + i * size) for i in range(FLAG_SLOTS)]
        self._peer_flag = [drv.CUdeviceptr(self._peer_flags.data_ptr() + i * size) for i in range(FLAG_SLOTS)]
        self._side_h = self._stream(self._side.cuda_stream)
        self._local_h = self._stream(self._local.cuda_stream)
        self._notify = torch.cuda.Stream(self.device, priority=-1)
        self._notify_h = self._stream(self._notify.cuda_stream)
        self._alt = torch.cuda.Stream(self.device)  # the caller's priority (the default one)
        self._alt_h = self._stream(self._alt.cuda_stream)
        self._counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=self.device)
        csize = self._counters.element_size()
        self._counter = [drv.CUdeviceptr(self._counters.data_ptr() + i * csize) for i in range(COUNTER_SLOTS)]
        self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        torch.cuda.synchronize(self.device)

    def call_counts(self) -> tuple[int, int]:
        """(calls run, of which replayed from the engine's own graphs) since it was made."""
        return self._calls, self.replays

    def _symmetric(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A symmetric allocation of ``numel`` elements on both ranks: (mine, the peer's view)."""
        group = self.group if self.group is not None else dist.group.WORLD
        try:
            from torch.distributed import _symmetric_memory as symm_mem

            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # needed before torch 2.11, a deprecated no-op since
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    enable(group.group_name)
            mine = symm_mem.empty((numel,), dtype=dtype, device=self.device)
            handle = symm_mem.rendezvous(mine, group)
            peer = handle.get_buffer(self.peer, (numel,), dtype)
        except torch.OutOfMemoryError:
            raise
        except (ImportError, RuntimeError, AttributeError) as exc:
            raise EnvironmentMismatchError(
                f"engine copy_engine: symmetric memory between the two GPUs failed ({exc}); it needs "
                "peer access (NVLink) and torch.distributed._symmetric_memory. Use a table row with "
                "engine: triton or overlap: false here (re-run `fo-tune search` on this machine)"
            ) from exc
        return mine, peer

    def _reserve(self, nbytes: int) -> None:
        """Grow the symmetric buffers to ``nbytes`` each (both ranks do it in the same call)."""
        if nbytes <= self._capacity:
            return
        if self._captured:
            raise ScheduleError(
                f"engine copy_engine: this call needs {nbytes} bytes of peer buffers, more than the "
                f"{self._capacity} a captured CUDA graph uses; run the largest shape eagerly before "
                "capturing any graph (the buffers cannot move under a graph)"
            )
        if self._calls:  # the peer has finished reading the old buffers before they are freed
            # every stream of mine first (a previous call may have run on another stream: its
            # resets must not leave a stale 1 for the waits below)
            torch.cuda.synchronize(self.device)
            main = self._stream(torch.cuda.current_stream(self.device).cuda_stream)
            self._wait(main, PULLED, reset=False)
            self._wait(main, GATHERED, reset=False)
            torch.cuda.synchronize(self.device)
        nbytes = -(-nbytes // BUFFER_ALIGN) * BUFFER_ALIGN
        self._part = self._peer_part = self._final = self._peer_final = None
        self._plans.clear()  # their views and addresses point into the old buffers
        self._graphs.clear()  # and so do the engine's own graphs
        self._capacity = 0  # until both buffers exist
        part, peer_part = self._symmetric(nbytes, torch.uint8)
        final, peer_final = self._symmetric(nbytes, torch.uint8)
        self._part, self._peer_part, self._final, self._peer_final = part, peer_part, final, peer_final
        self._capacity = nbytes

    def _stream(self, handle: int):
        """The driver's handle object of a CUDA stream (made once per stream)."""
        wrapped = self._streams.get(handle)
        if wrapped is None:
            wrapped = self._streams[handle] = self._driver.CUstream(handle)
        return wrapped

    def _check(self, err, what: str) -> None:
        if err != self._ok:
            why = f"{what} failed ({err})"
            if not self._capturing_own:  # part of the call may be queued already: the two ranks'
                self._broken = why  # flags are out of step now (a capture queues nothing)
            raise EnvironmentMismatchError(
                f"engine copy_engine: {why}; use a table row with engine: triton "
                "or overlap: false on this machine"
            )

    def _wait_at(self, stream, address, target: int, *, reset: bool) -> None:
        """``stream`` waits (GPU front end, no SM) until the int32 at ``address`` reaches
        ``target``, then (``reset``) sets it back to 0 for the next call."""
        drv = self._driver
        (err,) = drv.cuStreamWaitValue32(stream, address, target, self._geq)
        self._check(err, "cuStreamWaitValue32")
        if reset:  # (the driver refuses NO_MEMORY_BARRIER here: CUDA_ERROR_INVALID_VALUE, run 20)
            self._write(stream, address, 0)

    def _write(self, stream, address, value: int, what: str = "cuStreamWriteValue32") -> None:
        """``stream`` writes ``value`` to the int32 at ``address`` after a system-wide fence (the
        data before it is visible first)."""
        (err,) = self._driver.cuStreamWriteValue32(stream, address, value, self._fence_write)
        self._check(err, what)

    def _wait(self, stream, slot: int, *, reset: bool = True) -> None:
        """``stream`` waits until my flag ``slot`` is set, then resets it."""
        self._wait_at(stream, self._my_flag[slot], 1, reset=reset)

    def _signal(self, stream, slot: int) -> None:
        """``stream`` sets the peer's flag ``slot`` (the data before it is visible to the peer first)."""
        self._write(stream, self._peer_flag[slot], 1, "cuStreamWriteValue32 to the peer")

    def _set(self, stream, slot: int) -> None:
        """``stream`` sets my own flag ``slot`` (the copies before it are visible first)."""
        self._write(stream, self._my_flag[slot], 1)

    def _count(self, stream, slot: int, target: int) -> None:
        """``stream`` waits until tile counter ``slot`` reaches ``target`` (every tile of its chunk
        has stored and signalled), then resets it for the next call."""
        self._wait_at(stream, self._counter[slot], target, reset=True)

    def _copy(self, stream, dst: int, src: int, nbytes: int) -> None:
        """A device-to-device copy on ``stream`` (the copy engine; ``src`` may be the peer's)."""
        drv = self._driver
        (err,) = drv.cuMemcpyDtoDAsync(drv.CUdeviceptr(dst), drv.CUdeviceptr(src), nbytes, stream)
        self._check(err, "cuMemcpyDtoDAsync")

    def _event(self, i: int) -> torch.cuda.Event:
        while len(self._events) <= i:
            self._events.append(torch.cuda.Event())
        return self._events[i]

    def _agree(self, signature: tuple) -> None:
        """On the first call of each (collective, N, K, dtype, chunk weights): both ranks must cut
        the same chunks, else the flags would never match (a hang) or rows would be read before
        they are written (one small all_reduce, once per signature)."""
        if signature in self._agreed:
            return
        digest = zlib.crc32(repr(signature).encode())
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if int(both[0]) != digest or int(both[1]) != -digest:
            raise ScheduleError(
                f"engine copy_engine: the two ranks called with different schedules "
                f"(this rank: {signature}); every rank must read the same table"
            )
        self._agreed.add(signature)

    def _cached(self, key: tuple, make):
        """The plan of ``key`` (LRU, ``PLAN_CACHE_SIZE``), made by ``make()`` the first time."""
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = self._plans[key] = make()  # (after make(): its buffer growth clears the plans)
        while len(self._plans) > PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        return plan

    def _reserve_rows(self, rows: int, n: int, dtype: torch.dtype) -> int:
        """Grow the buffers to hold ``rows`` rows of ``n`` ``dtype`` elements; bytes per row."""
        row_bytes = n * torch.empty((), dtype=dtype).element_size()
        self._reserve(rows * row_bytes)
        return row_bytes

    @staticmethod
    def _rows(buffer: torch.Tensor, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``rows`` rows of ``n`` ``dtype`` elements of a byte buffer, as a (rows, n) view."""
        return buffer.view(dtype)[: rows * n].view(-1, n)

    def _halves(self, m: int, n: int, dtype: torch.dtype) -> tuple[tuple[int, int], tuple[int, int], int]:
        """(my shard's rows, the peer's, bytes per row), the buffers grown to hold either shard."""
        spans = shard_rows(m)
        row_bytes = self._reserve_rows(max(r1 - r0 for r0, r1 in spans), n, dtype)
        return spans[self.rank], spans[self.peer], row_bytes

    def _plan(self, collective: str, m: int, n: int, dtype: torch.dtype, weights: tuple[int, ...]) -> _Plan:
        key = _plan_key(collective, m, n, dtype, weights, CHUNKED)
        return self._cached(key, lambda: self._make_plan(collective, m, n, dtype, weights))

    def _make_plan(
        self, collective: str, m: int, n: int, dtype: torch.dtype, weights: tuple[int, ...]
    ) -> _Plan:
        mine, theirs, row_bytes = self._halves(m, n, dtype)
        own = tuple(itertools.pairwise(chunk_bounds(mine[1] - mine[0], weights)))
        other = tuple(itertools.pairwise(chunk_bounds(theirs[1] - theirs[0], weights)))
        part = self._rows(self._part, theirs[1] - theirs[0], n, dtype)
        peer_part = self._peer_part.data_ptr()
        final, final_src, gather_src, final_base = (), (), (), 0
        if collective == "all_reduce":
            whole = self._rows(self._final, mine[1] - mine[0], n, dtype)
            final = tuple(whole[r0:r1] for r0, r1 in own)
            final_base = self._final.data_ptr()
            final_src = tuple(self._final.data_ptr() + r0 * row_bytes for r0, _ in own)
            gather_src = tuple(self._peer_final.data_ptr() + r0 * row_bytes for r0, _ in other)
        return _Plan(
            mine=mine,
            theirs=theirs,
            own=own,
            other=other,
            row_bytes=row_bytes,
            part=tuple(part[r0:r1] for r0, r1 in other),
            final=final,
            final_base=final_base,
            pull_src=tuple(peer_part + r0 * row_bytes for r0, _ in own),
            final_src=final_src,
            gather_src=gather_src,
        )

    def _plan_tiled(
        self, collective: str, m: int, n: int, dtype: torch.dtype, weights: tuple[int, ...], tile: Tile
    ) -> _TiledPlan:
        key = _plan_key(collective, m, n, dtype, weights, _Mode(tile=tile))
        return self._cached(key, lambda: self._make_tiled(collective, m, n, dtype, weights, tile))

    def _make_tiled(
        self, collective: str, m: int, n: int, dtype: torch.dtype, weights: tuple[int, ...], tile: Tile
    ) -> _TiledPlan:
        mine, theirs, row_bytes = self._halves(m, n, dtype)
        tiles_n = -(-n // tile.block_n)

        def cut(rows: int) -> tuple[tuple[tuple[int, int], ...], torch.Tensor, tuple[int, ...]]:
            chunks = tuple(itertools.pairwise(tile_row_bounds(rows, weights, tile.block_m)))
            groups = [c for c, (r0, r1) in enumerate(chunks) for _ in range(-(-(r1 - r0) // tile.block_m))]
            tiles = tuple(-(-(r1 - r0) // tile.block_m) * tiles_n for r0, r1 in chunks)
            return chunks, torch.tensor(groups, dtype=torch.int32, device=self.device), tiles

        own, own_groups, _ = cut(mine[1] - mine[0])
        other, other_groups, other_tiles = cut(theirs[1] - theirs[0])
        peer_final, final_src = None, ()
        if collective == "all_reduce":
            peer_final = self._rows(self._peer_final, mine[1] - mine[0], n, dtype)
            final_src = tuple(self._final.data_ptr() + r0 * row_bytes for r0, _ in other)
        return _TiledPlan(
            mine=mine,
            theirs=theirs,
            own=own,
            other=other,
            row_bytes=row_bytes,
            part=self._rows(self._part, theirs[1] - theirs[0], n, dtype),
            own_groups=own_groups,
            other_groups=other_groups,
            other_tiles=other_tiles,
            pull_src=tuple(self._peer_part.data_ptr() + r0 * row_bytes for r0, _ in own),
            peer_final=peer_final,
            final_src=final_src,
        )

    def run(
        self,
        collective: str,
        a: torch.Tensor,
        b: torch.Tensor,
        weights: tuple[int, ...],
        tile: Tile | None = None,
        exchange: bool = False,
    ) -> torch.Tensor:
        """``collective(a @ b)`` over the two ranks (see the module docstring). ``tile``: the tiled
        mode, one persistent Triton GEMM per phase with this tile instead of a cuBLAS GEMM per chunk.
        ``exchange`` (all_reduce only): each rank pulls the peer's whole partial chunk by chunk and
        adds it (one hop instead of reduce-scatter then all-gather; ``_run_exchange``).
        Forward only: the result carries no autograd history."""
        weights = tuple(weights)
        if exchange and (tile is not None or collective != "all_reduce"):
            raise ScheduleError("engine copy_engine: exchange runs all_reduce with cuBLAS chunks (no tile)")
        mode = _Mode(tile=tile, exchange=bool(exchange))
        if tile is not None:
            if BOperand.of(b) is None:
                raise ShapeError(
                    "engine copy_engine with a tile: b must be row-major (K, N) or the transposed view "
                    f"of a contiguous (N, K) weight (got strides {b.stride()}); call .contiguous() on it"
                )
            if not a.is_contiguous():
                a = a.contiguous()
        if self._broken:
            raise EnvironmentMismatchError(
                f"engine copy_engine failed in an earlier call ({self._broken}) and its peer flags "
                "are out of step; restart the processes, and use a table row with engine: triton "
                "or overlap: false on this machine"
            )
        if a.shape[0] < COPY_ENGINE_WORLD:  # each rank must own a row, else its flags go unpaired
            raise ShapeError(
                f"engine copy_engine needs M >= {COPY_ENGINE_WORLD}, got M={a.shape[0]}; the ops "
                "run smaller M as GEMM then the collective"
            )
        # M is left out: it changes from call to call in serving (each M would cost a collective)
        signature = (collective, b.shape[1], a.shape[1], str(a.dtype), weights, mode)
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and (
            signature not in self._agreed
            or _plan_key(collective, a.shape[0], b.shape[1], a.dtype, weights, mode) not in self._plans
        ):
            raise ScheduleError(
                f"engine copy_engine: call {collective} with this shape ({a.shape[0]}x{b.shape[1]}x"
                f"{a.shape[1]}, {a.dtype}) once before capturing it in a CUDA graph (the first call "
                "makes the symmetric buffers and checks the ranks agree, which a graph cannot hold)"
            )
        self._agree(signature)
        m, n = a.shape[0], b.shape[1]
        if collective == "reduce_scatter" and m % COPY_ENGINE_WORLD:
            raise ShapeError(f"reduce_scatter needs M divisible by the world size 2, got M={m}")
        rows = m if collective == "all_reduce" else m // COPY_ENGINE_WORLD
        if capturing:
            out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
            self._run(collective, a, b, weights, mode, out, capturing=True)
            self._captured = True
            return out
        main = torch.cuda.current_stream(self.device)
        last = self._last_main
        if last is not None and last.cuda_stream != main.cuda_stream:
            main.wait_stream(last)  # the previous call (eager or replayed) ran on another stream
        if self.graph_after > 0:
            out = self._output((rows, n), a.dtype)
            self._run_graphed(collective, a, b, weights, mode, out)
        else:
            out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
            self._run(collective, a, b, weights, mode, out)
        self._last_main = main
        return out

    def _output(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A new output tensor from the engine's own pool (``fo_kernels.graphs.OutputPool``)."""
        if self._outputs is None:
            self._outputs = OutputPool(self.device)
        return self._outputs.empty(shape, dtype)

    def _run_graphed(
        self,
        collective: str,
        a: torch.Tensor,
        b: torch.Tensor,
        weights: tuple[int, ...],
        mode: _Mode,
        out: torch.Tensor,
    ) -> None:
        """An eager call through the engine's own graph of it: replayed if there is one, captured
        and replayed on the ``graph_after``-th sighting of its key, else issued eagerly."""
        key = (
            collective, weights, mode, self.gemm_streams, self.own_copy_at_end, a.dtype,
            tuple(a.shape), a.stride(), a.data_ptr(), b.dtype, tuple(b.shape), b.stride(),
            b.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        graph = self._graphs.get(key)
        if graph is None:
            seen = self._seen.pop(key, 0) + 1
            plan_key = _plan_key(collective, a.shape[0], b.shape[1], a.dtype, weights, mode)
            if seen < self.graph_after or plan_key not in self._plans:  # the plan: buffers big enough
                self._seen[key] = seen
                while len(self._seen) > SEEN_CACHE_SIZE:
                    self._seen.popitem(last=False)
                self._run(collective, a, b, weights, mode, out)
                return
            try:
                graph = self._capture(collective, a, b, weights, mode, out)
            except Exception as exc:
                if self._broken:  # a side stream was left capturing: nothing more can run
                    raise
                # nothing recorded has run, so the flags are in step: this call and later ones
                # are issued eagerly (correct, only slower at small shapes)
                self.graph_failure = f"{collective} {a.shape[0]}x{b.shape[1]}x{a.shape[1]} {weights}: {exc}"
                warnings.warn(
                    f"engine copy_engine: capturing a call in a CUDA graph failed ({self.graph_failure}); "
                    "this process issues its copy-engine calls eagerly from now on",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.graph_after = 0
                self._run(collective, a, b, weights, mode, out)
                return
            self._graphs[key] = graph
            if self._first_graph is None:
                self._first_graph = graph
            while len(self._graphs) > GRAPH_CACHE_SIZE:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        # (an eager call's side streams joined its main stream at its end, which ``run`` waited
        # for if it was another stream; a graph joins its own)
        graph.replay()
        self.replays += 1
        self._calls += 1

    def _capture(
        self,
        collective: str,
        a: torch.Tensor,
        b: torch.Tensor,
        weights: tuple[int, ...],
        mode: _Mode,
        out: torch.Tensor,
    ) -> torch.cuda.CUDAGraph:
        """A graph of one call (recorded, not run). ``thread_local``: other threads' CUDA calls
        do not break the capture."""
        if self._capture_stream is None:  # one stream, so cuBLAS makes one workspace for captures
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        calls = self._calls
        self._capturing_own = True
        try:
            with torch.cuda.stream(self._capture_stream):
                # a memory pool of its own (pool=None): a pool shared by graphs is released once
                # they are all dropped (buffer growth), and torch asserts when a capture reuses it
                # (run 28)
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._run(collective, a, b, weights, mode, out, capturing=True)
                except BaseException:
                    self._abandon_capture(graph)
                    raise
                try:
                    graph.capture_end()
                except RuntimeError:
                    end_generator_capture(self._capture_stream)
                    raise
        finally:
            self._capturing_own = False
        self._calls = calls  # recorded, not run: the replay counts it
        return graph

    def _abandon_capture(self, graph: torch.cuda.CUDAGraph) -> None:
        """End a capture that ``_run`` left part-way: the side streams it forked join the capture
        stream first (an unjoined fork makes ``capture_end`` fail before torch's own cleanup of the
        allocator and the random generator), then the capture ends; a side stream left capturing
        makes the engine unusable (its next operations would be recorded, never run)."""
        here = torch.cuda.current_stream(self.device)
        forked = (self._side, self._local, self._notify, self._alt)  # every stream a call may fork
        for side in forked:
            with contextlib.suppress(RuntimeError):
                here.wait_stream(side)
        try:
            graph.capture_end()
        except RuntimeError:  # invalid already: the first error is the one to report
            end_generator_capture(self._capture_stream)
        for side in forked:
            with torch.cuda.stream(side):
                if torch.cuda.is_current_stream_capturing():
                    self._broken = "a failed CUDA graph capture left a side stream capturing"

    @torch.no_grad()  # (a replayed call issues no torch op: only this path needs it)
    def _run(
        self,
        collective: str,
        a: torch.Tensor,
        b: torch.Tensor,
        weights: tuple[int, ...],
        mode: _Mode,
        out: torch.Tensor,
        capturing: bool = False,
    ) -> None:
        """Issue one call's operations on the current stream and the side streams; ``out`` is the
        result's (M, N) or (M / 2, N) tensor."""
        if mode.tile is not None:
            self._run_tiled(collective, a, b, weights, mode.tile, out, capturing)
            return
        if mode.exchange:
            self._run_exchange(a, b, weights, out, capturing)
            return
        m, n = a.shape[0], b.shape[1]
        plan = self._plan(collective, m, n, a.dtype, weights)
        all_reduce = collective == "all_reduce"
        mine, theirs, own, rb = plan.mine, plan.theirs, plan.own, plan.row_bytes
        out_ptr = out.data_ptr()
        main = torch.cuda.current_stream(self.device)
        main_h, side_h, local_h = self._stream(main.cuda_stream), self._side_h, self._local_h
        if not capturing:  # a graph's streams are joined at its end; eager calls may switch streams
            main.wait_stream(self._side)  # the previous call's streams are done
            main.wait_stream(self._local)
        self._side.wait_stream(main)  # the inputs and the output's memory are ready
        self._wait(main_h, PULLED)  # the peer has pulled the previous call's partials from ``part``
        gemms = self._gemm_streams(main, main_h)
        t0 = theirs[0]
        self._partials(gemms, a[t0:], b, plan.other, plan.part)  # phase 1: the peer's shard
        # the peer's partials of my shard, pulled by the copy engine into my sums' destination
        dst_base = plan.final_base if all_reduce else out_ptr
        pulled = [self._event(c) for c in range(len(own))]
        if all_reduce:  # the pulls write ``final``: the peer has gathered the previous call's sums
            self._wait(side_h, GATHERED)
        for c, (r0, r1) in enumerate(own):
            self._wait(side_h, PARTIAL + c)
            self._copy(side_h, dst_base + r0 * rb, plan.pull_src[c], (r1 - r0) * rb)
            pulled[c].record(self._side)
        self._signal(side_h, PULLED)
        summed = [self._event(len(own) + c) for c in range(len(own))]
        m0 = mine[0]
        for c, (r0, r1) in enumerate(own):  # phase 2: my shard, summed in the GEMM's epilogue
            stream, handle = gemms[(len(plan.other) + c) % len(gemms)]
            stream.wait_event(pulled[c])
            dst = plan.final[c] if all_reduce else out[r0:r1]
            with torch.cuda.stream(stream):
                dst.addmm_(a[m0 + r0 : m0 + r1], b)
            if all_reduce:
                self._signal(handle, SUMMED + c)
                summed[c].record(stream)
        if all_reduce and self.own_copy_at_end:  # my sums into the output, all in one copy
            for event in summed:
                self._local.wait_event(event)
            self._copy(local_h, out_ptr + m0 * rb, plan.final_src[0], own[-1][1] * rb)
        elif all_reduce:
            for c, (r0, r1) in enumerate(own):  # my sums into the output, as each is done
                self._local.wait_event(summed[c])
                self._copy(local_h, out_ptr + (m0 + r0) * rb, plan.final_src[c], (r1 - r0) * rb)
        if all_reduce:
            for c, (r0, r1) in enumerate(plan.other):  # the peer's sums into the output
                self._wait(side_h, SUMMED + c)
                self._copy(side_h, out_ptr + (t0 + r0) * rb, plan.gather_src[c], (r1 - r0) * rb)
            self._signal(side_h, GATHERED)
            main.wait_stream(self._local)
        if len(gemms) == 2:
            main.wait_stream(self._alt)
        main.wait_stream(self._side)
        self._calls += 1

    def _gemm_streams(self, main: torch.cuda.Stream, main_h) -> list[tuple[torch.cuda.Stream, object]]:
        """The (stream, driver handle) pairs a call's chunk GEMMs alternate between: chunk GEMM g
        runs on entry g % len (``gemm_streams``). ``_alt`` starts where ``main`` is now (after its
        waits for the inputs and the previous call); the call joins it back at its end."""
        gemms = [(main, main_h)]
        if self.gemm_streams == 2:
            self._alt.wait_stream(main)
            gemms.append((self._alt, self._alt_h))
        return gemms

    def _partials(
        self,
        gemms: list[tuple[torch.cuda.Stream, object]],
        a: torch.Tensor,
        b: torch.Tensor,
        chunks: tuple[tuple[int, int], ...],
        parts: tuple[torch.Tensor, ...],
    ) -> None:
        """My partial of each chunk (rows [r0, r1) of ``a``) into ``parts``, GEMM c on
        ``gemms[c % len]``, each followed on its stream by the peer's PARTIAL + c flag."""
        for c, (r0, r1) in enumerate(chunks):
            stream, handle = gemms[c % len(gemms)]
            with torch.cuda.stream(stream):
                torch.mm(a[r0:r1], b, out=parts[c])
            self._signal(handle, PARTIAL + c)

    def _run_tiled(
        self,
        collective: str,
        a: torch.Tensor,
        b: torch.Tensor,
        weights: tuple[int, ...],
        tile: Tile,
        out: torch.Tensor,
        capturing: bool,
    ) -> None:
        """The tiled mode of ``_run``: phase 1 and phase 2 are one persistent Triton GEMM each
        (``fo_kernels.gemm.rows_gemm``) on all SMs, so no chunk pays a small GEMM's wave
        quantization. Phase 1's tiles count per chunk; the notify stream forwards each finished
        chunk to the peer (PARTIAL); my side stream pulls the peer's partial of my chunk c into my
        shard of the output and sets READY + c; each tile of phase 2 waits in the kernel for its
        chunk's READY, then adds the pulled partial in float32 before storing. AllReduce: phase 2
        also stores each sum into the peer's ``final`` over NVLink and counts it in the peer's
        SUMMED + c, and my side stream copies the peer's sums from my ``final`` into the output as
        each of its chunks' counts completes (no pull of the sums after the GEMM: run 52 in
        ``docs/perf-notes.md``, 0.154-0.156 against 0.162-0.165 ms at 2048x4096x4096)."""
        m, n = a.shape[0], b.shape[1]
        plan = self._plan_tiled(collective, m, n, a.dtype, weights, tile)
        operand = BOperand.of(b)
        all_reduce = collective == "all_reduce"
        (m0, m1), (t0, t1), own, rb = plan.mine, plan.theirs, plan.own, plan.row_bytes
        out_ptr = out.data_ptr()
        main = torch.cuda.current_stream(self.device)
        main_h, side_h, notify_h = self._stream(main.cuda_stream), self._side_h, self._notify_h
        if not capturing:
            main.wait_stream(self._side)
            main.wait_stream(self._notify)
        self._side.wait_stream(main)
        self._notify.wait_stream(main)
        self._wait(main_h, PULLED)  # the peer has pulled the previous call's partials from ``part``
        rows_gemm(
            a[t0:t1], operand, plan.part, tile, grid=self._sms, row_group=plan.other_groups,
            counters=self._counters[:MAX_CHUNKS],
        )  # fmt: skip
        for c, tiles in enumerate(plan.other_tiles):  # each of the peer's chunks, once it is done
            self._count(notify_h, c, tiles)
            self._signal(notify_h, PARTIAL + c)
        mine = out[m0:m1] if all_reduce else out  # my shard of the output: the pulls land there
        for c, (r0, r1) in enumerate(own):
            self._wait(side_h, PARTIAL + c)
            self._copy(side_h, mine.data_ptr() + r0 * rb, plan.pull_src[c], (r1 - r0) * rb)
            self._set(side_h, READY + c)
        self._signal(side_h, PULLED)
        rows_gemm(
            a[m0:m1], operand, mine, tile, grid=self._sms, row_group=plan.own_groups,
            ready=self._flags[READY:], counters=self._peer_flags[SUMMED:] if all_reduce else None,
            out2=plan.peer_final, remote_counters=all_reduce,
        )  # fmt: skip
        (err,) = self._driver.cuMemsetD32Async(self._my_flag[READY], 0, len(own), main_h)
        self._check(err, "cuMemsetD32Async")  # READY is read again only after the next pulls
        if all_reduce:  # (queued after phase 2: a wait queued first could block it, run 34)
            for c, (r0, r1) in enumerate(plan.other):  # the peer's sums, as each chunk's count completes
                self._wait_at(side_h, self._my_flag[SUMMED + c], plan.other_tiles[c], reset=True)
                self._copy(side_h, out_ptr + (t0 + r0) * rb, plan.final_src[c], (r1 - r0) * rb)
        main.wait_stream(self._notify)
        main.wait_stream(self._side)
        self._calls += 1

    def _plan_exchange(self, m: int, n: int, dtype: torch.dtype, weights: tuple[int, ...]) -> _ExchangePlan:
        key = _plan_key("all_reduce", m, n, dtype, weights, _Mode(exchange=True))
        return self._cached(key, lambda: self._make_exchange(m, n, dtype, weights))

    def _make_exchange(self, m: int, n: int, dtype: torch.dtype, weights: tuple[int, ...]) -> _ExchangePlan:
        row_bytes = self._reserve_rows(m, n, dtype)
        chunks = tuple(itertools.pairwise(chunk_bounds(m, weights)))
        whole = self._rows(self._part, m, n, dtype)
        return _ExchangePlan(
            chunks=chunks,
            row_bytes=row_bytes,
            part=tuple(whole[r0:r1] for r0, r1 in chunks),
            pull_src=tuple(self._peer_part.data_ptr() + r0 * row_bytes for r0, _ in chunks),
        )

    def _run_exchange(
        self, a: torch.Tensor, b: torch.Tensor, weights: tuple[int, ...], out: torch.Tensor, capturing: bool
    ) -> None:
        """AllReduce by exchange: both ranks cut all M rows into the same chunks; for each chunk c
        my main stream writes my partial into ``part`` (cuBLAS) and flags the peer (PARTIAL + c);
        my side stream pulls the peer's partial of chunk c straight into the output, and the main
        stream adds my partial to it (``out[c] += part[c]``) after the last GEMM, so each pull but
        the last runs beside a GEMM. Every byte crosses NVLink once (reduce-scatter then all-gather
        moves the same bytes in two dependent hops), at the price of an add kernel per chunk: the
        shape of small outputs, where the second hop cannot hide behind anything."""
        m, n = a.shape[0], b.shape[1]
        plan = self._plan_exchange(m, n, a.dtype, weights)
        rb, out_ptr = plan.row_bytes, out.data_ptr()
        main = torch.cuda.current_stream(self.device)
        main_h, side_h = self._stream(main.cuda_stream), self._side_h
        if not capturing:
            main.wait_stream(self._side)
        self._side.wait_stream(main)  # the inputs and the output's memory are ready
        self._wait(main_h, PULLED)  # the peer has pulled the previous call's partials from ``part``
        # The GEMMs are issued before the side stream's waits: two streams may share one of the
        # GPU's hardware queues, and a wait queued ahead of the GEMM the peer is waiting for would
        # block it (run 34 hung with the waits issued first).
        gemms = self._gemm_streams(main, main_h)
        self._partials(gemms, a, b, plan.chunks, plan.part)
        pulled = [self._event(c) for c in range(len(plan.chunks))]
        for c, (r0, r1) in enumerate(plan.chunks):
            self._wait(side_h, PARTIAL + c)
            self._copy(side_h, out_ptr + r0 * rb, plan.pull_src[c], (r1 - r0) * rb)
            pulled[c].record(self._side)
        self._signal(side_h, PULLED)
        for c, (r0, r1) in enumerate(plan.chunks):  # my partial onto the peer's, as each lands
            stream = gemms[c % len(gemms)][0]  # (after my GEMM of the chunk, on its stream)
            stream.wait_event(pulled[c])
            with torch.cuda.stream(stream):
                out[r0:r1].add_(plan.part[c])
        if len(gemms) == 2:
            main.wait_stream(self._alt)
        main.wait_stream(self._side)
        self._calls += 1
