"""The ``copy_engine`` engine: GEMM + ReduceScatter / AllReduce between two NVLink peers, no NCCL.

On Hopper, NCCL's kernels need SMs that a GEMM also wants, and beside a GEMM both slow down
(``docs/perf-notes.md``). Here the data moves through the GPUs' copy engines, which use no SM, and
the reduction is folded into cuBLAS's ``beta = 1`` epilogue. Rank r owns shard r of the output rows
(``shard_rows``); each shard is cut into row chunks by the schedule's ``groups`` weights::

    main stream   phase 1: for each chunk c of the PEER's shard:
                      part[c] = A[peer rows c] @ B            (into my symmetric buffer)
                      flag_peer[PARTIAL + c] = epoch          (cuStreamWriteValue32, system fence)
                  phase 2: for each chunk c of MY shard:
                      wait pulled[c];  dst[c] += A[my rows c] @ B   (addmm_: the sum, in the epilogue)
                      [all_reduce] flag_peer[SUMMED + c] = epoch
    side stream   for each chunk c: wait my flag[PARTIAL + c] >= epoch (cuStreamWaitValue32);
                      dst[c] = peer.part[c]                   (a copy of peer memory: copy engine)
                  [all_reduce] for each chunk c: wait my flag[SUMMED + c]; out[peer rows c] =
                      peer.final[c];  out[my rows c] = final[c]
                  flag_peer[DONE] = epoch                     (I have finished reading the peer)

``dst`` is the caller's output for ReduceScatter and my symmetric ``final`` buffer for AllReduce
(the peer copies my sums from it). A call first waits for the peer's DONE of the previous call, so
no buffer is rewritten while the peer still reads it. Flags are never reset: each call's epoch is
one more than the last, and the waits compare modulo 2**32. Both ranks must make the same calls in
the same order, as with any collective.

Needs CUDA, two GPUs with peer access (NVLink), ``torch.distributed._symmetric_memory`` and
cuda-bindings (``pip install 'fo-tune[cuda]'``); ``CopyEnginePeers`` says what is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import warnings
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import EnvironmentMismatchError, ScheduleError, ShapeError
from .schedule import COPY_ENGINE_WORLD, MAX_CHUNKS
from .wait import SpinWaiter, StreamWaiter, _driver_module

# Flag slots: [PARTIAL, PARTIAL + MAX_CHUNKS) partial chunk ready, [SUMMED, ...) summed chunk
# ready (all_reduce), DONE: the peer has finished reading my buffers of a call.
PARTIAL = 0
SUMMED = MAX_CHUNKS
DONE = 2 * MAX_CHUNKS
FLAG_SLOTS = DONE + 1
# Inner chunk cuts fall on multiples of this many rows when the shard is big enough: 128 is the
# tallest cuBLAS tile on Hopper, so no chunk's GEMM ends in a partly filled row of tiles.
ROW_ALIGN = 128
_U32 = 0xFFFFFFFF
# Symmetric buffers are sized in multiples of this many bytes, so a byte buffer grown for one dtype
# can be viewed as any other (float32 needs a size divisible by 4).
BUFFER_ALIGN = 16
# How a stream waits for the peer's flag: the GPU front end (cuStreamWaitValue32, no SM) or a
# one-warp kernel polling the flag with system-scope acquire loads (one SM slot while it waits).
CE_WAITS = ("stream_wait", "spin")


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


def chunk_bounds(rows: int, weights: tuple[int, ...]) -> list[int]:
    """Row boundaries cutting ``rows`` by ``weights`` (each chunk >= 1 row; fewer chunks when the
    shard has fewer rows than weights). Inner cuts are rounded to ``ROW_ALIGN`` when every chunk
    can still get a row."""
    if rows <= 0:
        return [0]
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


@dataclass
class CopyEnginePeers:
    """The symmetric buffers, flags, side stream and epoch of one (device, 2-rank group)."""

    device: torch.device
    group: dist.ProcessGroup | None = None
    wait: str = "stream_wait"
    # SMs the chunk GEMMs leave free (cuBLASLt's SM_COUNT_TARGET, run 10), 0: none, plain cuBLAS
    carveout: int = 0
    _capacity: int = 0
    _part: torch.Tensor | None = field(default=None, repr=False)
    _final: torch.Tensor | None = field(default=None, repr=False)
    _peer_part: torch.Tensor | None = field(default=None, repr=False)
    _peer_final: torch.Tensor | None = field(default=None, repr=False)
    _flags: torch.Tensor | None = field(default=None, repr=False)
    _peer_flags: torch.Tensor | None = field(default=None, repr=False)
    _side: torch.cuda.Stream | None = field(default=None, repr=False)
    _local: torch.cuda.Stream | None = field(default=None, repr=False)
    _epoch: int = 0
    _events: list = field(default_factory=list, repr=False)
    _agreed: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.wait not in CE_WAITS:
            raise ScheduleError(f"engine copy_engine: wait {self.wait!r} is not one of {CE_WAITS}")
        if self.carveout < 0:
            raise ScheduleError(f"engine copy_engine: carveout must be >= 0, got {self.carveout}")
        why = copy_engine_blocker(self.device, dist.get_world_size(self.group))
        if why:
            raise EnvironmentMismatchError(
                f"engine copy_engine {why}; use a table row with engine: triton or overlap: false here"
            )
        driver = _driver_module()
        self._driver = driver
        self._waiter = StreamWaiter(driver) if self.wait == "stream_wait" else SpinWaiter(system=True)
        self._fence_write = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self.rank = dist.get_rank(self.group)
        self.peer = 1 - self.rank
        self._flags, self._peer_flags = self._symmetric(FLAG_SLOTS, torch.int32)
        self._flags.zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group, device_ids=[self.device.index])
        self._side = torch.cuda.Stream(self.device, priority=-1)
        self._local = torch.cuda.Stream(self.device, priority=-1)

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
        if self._epoch:  # the peer has finished reading the old buffers before they are freed
            self._wait(DONE, self._epoch)
            torch.cuda.synchronize(self.device)
        nbytes = -(-nbytes // BUFFER_ALIGN) * BUFFER_ALIGN
        self._part = self._peer_part = self._final = self._peer_final = None
        self._capacity = 0  # until both buffers exist
        part, peer_part = self._symmetric(nbytes, torch.uint8)
        final, peer_final = self._symmetric(nbytes, torch.uint8)
        self._part, self._peer_part, self._final, self._peer_final = part, peer_part, final, peer_final
        self._capacity = nbytes

    def _wait(self, slot: int, value: int) -> None:
        self._waiter.wait(self._flags, slot, value & _U32)

    def _signal(self, slot: int, value: int) -> None:
        drv = self._driver
        stream = drv.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        address = drv.CUdeviceptr(self._peer_flags.data_ptr() + slot * self._peer_flags.element_size())
        (err,) = drv.cuStreamWriteValue32(stream, address, value & _U32, self._fence_write)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise EnvironmentMismatchError(
                f"engine copy_engine: cuStreamWriteValue32 to the peer failed ({err}); use a table "
                "row with engine: triton or overlap: false on this machine"
            )

    @contextlib.contextmanager
    def _gemm_settings(self):
        """cuBLASLt with ``carveout`` SMs left free for the spin waits, restored afterwards."""
        if not self.carveout:
            yield
            return
        library = torch.backends.cuda.preferred_blas_library()
        before = torch._C._get_sm_carveout_experimental()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(self.carveout)
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(before)
            torch.backends.cuda.preferred_blas_library(library)

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

    def run(
        self, collective: str, a: torch.Tensor, b: torch.Tensor, weights: tuple[int, ...]
    ) -> torch.Tensor:
        """``collective(a @ b)`` over the two ranks (see the module docstring). Forward only: the
        result carries no autograd history."""
        # M is left out: it changes from call to call in serving (each M would cost a collective)
        self._agree((collective, b.shape[1], a.shape[1], str(a.dtype), tuple(weights)))
        with torch.no_grad(), self._gemm_settings():
            return self._run(collective, a, b, weights)

    def _run(
        self, collective: str, a: torch.Tensor, b: torch.Tensor, weights: tuple[int, ...]
    ) -> torch.Tensor:
        m, n = a.shape[0], b.shape[1]
        if collective == "reduce_scatter" and m % COPY_ENGINE_WORLD:
            raise ShapeError(f"reduce_scatter needs M divisible by the world size 2, got M={m}")
        spans = shard_rows(m)
        mine, theirs = spans[self.rank], spans[self.peer]
        width = max(r1 - r0 for r0, r1 in spans)
        self._reserve(width * n * a.element_size())
        part = self._part.view(a.dtype)[: (theirs[1] - theirs[0]) * n].view(-1, n)
        peer_part = self._peer_part.view(a.dtype)[: (mine[1] - mine[0]) * n].view(-1, n)
        own = list(itertools.pairwise(chunk_bounds(mine[1] - mine[0], weights)))
        other = list(itertools.pairwise(chunk_bounds(theirs[1] - theirs[0], weights)))
        if collective == "all_reduce":
            out = torch.empty((m, n), dtype=a.dtype, device=a.device)
            dst = self._final.view(a.dtype)[: (mine[1] - mine[0]) * n].view(-1, n)
            peer_final = self._peer_final.view(a.dtype)[: (theirs[1] - theirs[0]) * n].view(-1, n)
        else:
            out = dst = torch.empty((m // COPY_ENGINE_WORLD, n), dtype=a.dtype, device=a.device)
        epoch = self._epoch + 1
        main, side = torch.cuda.current_stream(self.device), self._side
        main.wait_stream(side)  # the previous call's streams are done, whichever stream it ran on
        main.wait_stream(self._local)
        if self._epoch:
            self._wait(DONE, self._epoch)  # the peer no longer reads what this call overwrites
        side.wait_stream(main)  # the inputs and the output's memory are ready
        for c, (r0, r1) in enumerate(other):  # phase 1: the peer's shard, its partial sums
            torch.mm(a[theirs[0] + r0 : theirs[0] + r1], b, out=part[r0:r1])
            self._signal(PARTIAL + c, epoch)
        pulled = [self._event(c) for c in range(len(own))]
        with torch.cuda.stream(side):  # the peer's partials of my shard, by the copy engine
            for c, (r0, r1) in enumerate(own):
                self._wait(PARTIAL + c, epoch)
                dst[r0:r1].copy_(peer_part[r0:r1])
                pulled[c].record(side)
        summed = [self._event(len(own) + c) for c in range(len(own))]
        for c, (r0, r1) in enumerate(own):  # phase 2: my shard, summed in the GEMM's epilogue
            main.wait_event(pulled[c])
            dst[r0:r1].addmm_(a[mine[0] + r0 : mine[0] + r1], b)
            if collective == "all_reduce":
                self._signal(SUMMED + c, epoch)
                summed[c].record(main)
        if collective == "all_reduce":
            local = self._local  # ordered after main by the summed events
            with torch.cuda.stream(local):  # my sums into the output, as each is done
                for c, (r0, r1) in enumerate(own):
                    local.wait_event(summed[c])
                    out[mine[0] + r0 : mine[0] + r1].copy_(dst[r0:r1])
            with torch.cuda.stream(side):  # the peer's sums into the output
                for c, (r0, r1) in enumerate(other):
                    self._wait(SUMMED + c, epoch)
                    out[theirs[0] + r0 : theirs[0] + r1].copy_(peer_final[r0:r1])
            main.wait_stream(local)
        with torch.cuda.stream(side):
            self._signal(DONE, epoch)
        main.wait_stream(side)
        self._epoch = epoch
        return out
