"""The measurement harness every GPU command uses: one persistent pool of rank processes per command.

    with open_pool(world_size) as pool:          # spawns ranks, or joins torchrun's
        if pool.is_driver:                       # the process that decides what to measure
            per_rank = pool.run(SomeTask(...))   # every rank runs task.run(ctx); results by rank
            timing = Timing.max_over(per_rank)   # a measurement is the max over ranks

- Spawned (no torchrun): the calling process drives; it starts one process per rank once, joins
  them into one process group (NCCL with a GPU each, else gloo), and sends them tasks. Processes and
  communicators live for the whole command, never one per candidate.
- Under torchrun: rank 0 drives; the other ranks serve tasks it broadcasts until it closes the pool
  (``pool.is_driver`` is False there, and the command body is skipped). Every rank leaves the
  process group when the pool closes.
- A rank that raises, dies or hangs ends the command within ``timeout_s`` with ``LaunchError``
  naming the rank (its traceback attached); the pool is then closed and every process stopped.
  Spawned ranks also exit on their own when the driver dies without closing the pool (SIGKILL).

Tasks are picklable objects with ``run(ctx) -> result`` (``Task``); they run on every rank at
once, so any collective inside them is matched. ``time_region`` is the timing helper tasks use:
warm-up, CUDA events (``perf_counter`` on the CPU) around back-to-back calls, median and spread;
``time_interleaved`` times several variants in alternating rounds for side-by-side comparisons.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .launch import SAFE_ENV, LaunchError, RankContext, in_torchrun, pick_backend, torchrun_context

# How often the driver checks for dead ranks while it waits for results.
POLL_S = 0.5
# How long a rank may take to join the process group and answer the first ping.
STARTUP_TIMEOUT_S = 300.0
# Default per-task limit; a measurement sweep is split into tasks well under it.
TASK_TIMEOUT_S = 600.0


class Task(Protocol):
    """A unit of work every rank runs at once; the result must be picklable."""

    def run(self, ctx: RankContext) -> Any: ...


@dataclass(frozen=True, slots=True)
class Timing:
    """Median, spread (max - min) and interquartile range of repeated measurements, in milliseconds.

    ``spread_ms`` shows the outliers; ``iqr_ms`` is the robust noise figure decisions use.
    """

    median_ms: float
    spread_ms: float
    samples: int
    iqr_ms: float = math.nan

    @staticmethod
    def max_over(per_rank: Sequence[Timing]) -> Timing:
        """The slowest rank's median (a collective is as slow as its slowest rank)."""
        worst = max(per_rank, key=lambda t: t.median_ms)
        iqr = max((t.iqr_ms for t in per_rank), key=lambda x: -math.inf if math.isnan(x) else x)
        return Timing(worst.median_ms, max(t.spread_ms for t in per_rank), worst.samples, iqr)


# A timed sample spans at least this long: back-to-back calls keep the GPU queue full, so a
# launch's host overhead (~0.09 ms for the persistent GEMM, docs/perf-notes.md) is hidden behind
# queued work as it is in a real loop and in nccl-tests; the first calibration timed single calls.
# Each sample still pays its first launch once: 4 ms keeps that under ~2% on the suite's 2 ms ops
# (with 1 ms they ran one call per sample and the overlapped ops paid 0.1-0.2 ms more, run 7).
MIN_SAMPLE_MS = 4.0
# Most calls in one sample (tiny kernels would otherwise need thousands).
MAX_INNER = 64
# The sample length of the side-by-side comparisons that decide or report (the bench, a search's
# confirmation) on GPUs. A sample also pays its first call's host time on an idle GPU and any rank's
# late start once; over the ~15 calls of a 4 ms sample that read 0.164 ms for a 0.15 ms fo-tune
# call (2048x4096x4096 AllReduce) against 0.151-0.154 with the ranks aligned and the first call
# hidden, or with 16 ms samples, while sequential moved by <= 2% (run 60 in docs/perf-notes.md,
# bench/timing_probe.py). 16 ms also keeps the large shapes' calls back to back for ~8 calls, near a
# loop's power-limited clock (run 42). The search's many trials keep MIN_SAMPLE_MS.
STEADY_SAMPLE_MS = 16.0


def comparison_sample_ms(on_gpu: bool) -> float:
    """The sample length of a side-by-side comparison that decides or reports: ``STEADY_SAMPLE_MS``
    on GPUs, ``MIN_SAMPLE_MS`` on the CPU (where a call of Triton's interpreter outlasts both)."""
    return STEADY_SAMPLE_MS if on_gpu else MIN_SAMPLE_MS


def time_region(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup: int = 3,
    reps: int = 10,
    inner: int | None = None,
    agree: bool = False,
) -> Timing:
    """Time ``fn`` ``reps`` times after ``warmup`` calls; each sample runs ``inner`` calls back to
    back (default: enough for ``MIN_SAMPLE_MS``) and reports the time per call.

    CUDA events bracket each sample on the current stream; on the CPU ``perf_counter`` does.
    ``agree``: ``fn`` is a collective, so every rank must make the same number of calls; the ranks
    take the largest ``inner`` (an all_reduce on the default group).
    """
    for _ in range(warmup):
        fn()
    if inner is None:
        one = _samples(fn, device, reps=1, inner=1)[0]
        inner = max(1, min(MAX_INNER, math.ceil(MIN_SAMPLE_MS / max(one, 1e-6))))
        if agree and dist.is_initialized():
            t = torch.tensor([inner], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            inner = int(t.item())
    return _timing(_samples(fn, device, reps=reps, inner=inner))


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    device: torch.device,
    *,
    warmup: int = 3,
    rounds: int = 10,
    agree: bool = False,
    align: bool = False,
    lead_ms: float = 0.0,
    min_sample_ms: float = MIN_SAMPLE_MS,
) -> dict[str, Timing]:
    """Time several variants side by side: each round takes one sample of every variant in turn
    (``inner`` back-to-back calls each, per variant as in ``time_region``, enough for
    ``min_sample_ms``), so a clock or thermal drift during the run moves them all alike instead of
    favouring whichever ran first; the order rotates every round and every other round runs
    backwards, so no variant always follows the same one.

    ``agree``: some variants run collectives; the ranks agree on every variant's ``inner``.
    ``align`` (with ``agree``): the ranks start every sample together (``_align``), so no
    rank's sample includes waiting for a peer still finishing its previous sample. ``lead_ms``: each
    sample's first call is queued behind a spin kernel of that length, outside the timed region, so
    the GPU does not idle while the host issues it (a loop's steady state; see ``_samples``).
    """
    names = list(fns)
    inners = []
    for name in names:
        for _ in range(warmup):
            fns[name]()
        one = _samples(fns[name], device, reps=1, inner=1)[0]
        inners.append(max(1, min(MAX_INNER, math.ceil(min_sample_ms / max(one, 1e-6)))))
    if agree and dist.is_initialized() and names:
        t = torch.tensor(inners, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        inners = [int(x) for x in t.tolist()]
    align = align and agree and dist.is_initialized()
    samples: dict[str, list[float]] = {name: [] for name in names}
    order = list(zip(names, inners, strict=True))
    for r in range(rounds):
        shift = r % len(order) if order else 0  # each variant takes every place in the round in turn,
        turn = order[shift:] + order[:shift]  # and every other round runs backwards, so it follows
        for name, inner in turn if r % 2 == 0 else turn[::-1]:  # different neighbours too
            got = _samples(fns[name], device, reps=1, inner=inner, align=align, lead_ms=lead_ms)
            samples[name].extend(got)
    return {name: _timing(v) for name, v in samples.items()}


def _timing(samples: list[float]) -> Timing:
    iqr = math.nan
    if len(samples) >= 2:
        q1, _, q3 = statistics.quantiles(samples, n=4)
        iqr = q3 - q1
    return Timing(statistics.median(samples), max(samples) - min(samples), len(samples), iqr)


def _align(device: torch.device) -> None:
    """Return when every rank has reached this point (a one-element all_reduce, then a
    synchronization): the ranks leave within a few microseconds of each other."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _samples(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    reps: int,
    inner: int,
    align: bool = False,
    lead_ms: float = 0.0,
) -> list[float]:
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        cycles_per_ms = torch.cuda.get_device_properties(device).clock_rate if lead_ms > 0 else 0  # kHz
        for _ in range(reps):
            if align:
                _align(device)
            if lead_ms > 0:  # the GPU spins (untimed) while the host issues the first call
                torch.cuda._sleep(int(lead_ms * cycles_per_ms))
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
    else:
        for _ in range(reps):
            if align:
                _align(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return samples


class Pool(Protocol):
    is_driver: bool
    world_size: int
    backend: str

    def run(self, task: Task, *, timeout_s: float = TASK_TIMEOUT_S) -> list[Any]: ...


# ----------------------------------------------------------------------------- spawned ranks
def _serve(rank: int, world: int, backend: str, init_file: str, inbox, outbox) -> None:
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world, **kwargs
        )
        ctx = RankContext(rank, world, device, backend)
        outbox.put((rank, -1, True, None))  # ready
        parent = os.getppid()
        while True:
            try:
                item = inbox.get(timeout=POLL_S)
            except queue.Empty:
                if os.getppid() != parent:  # the driver was killed (SIGKILL skips its clean-up)
                    raise SystemExit(1) from None
                continue
            if item is None:
                break
            seq, task = item
            try:
                outbox.put((rank, seq, True, task.run(ctx)))
            except BaseException:
                outbox.put((rank, seq, False, traceback.format_exc()))
                raise
        dist.destroy_process_group()
    except BaseException:
        with contextlib.suppress(Exception):
            outbox.put((rank, -2, False, traceback.format_exc()))
        raise SystemExit(1) from None


class SpawnedPool:
    """Ranks spawned by this process, which drives (see the module docstring)."""

    is_driver = True

    def __init__(self, world_size: int, backend: str | None = None) -> None:
        self.world_size = world_size
        self.backend = pick_backend(world_size, backend)
        self._ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="fo-tune-pool-")
        self._outbox = self._ctx.Queue()
        self._inboxes = [self._ctx.Queue() for _ in range(world_size)]
        init_file = str(Path(self._tmp.name) / "store")
        self._procs = [
            self._ctx.Process(
                target=_serve,
                args=(r, world_size, self.backend, init_file, self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(world_size)
        ]
        self._seq = 0
        self._closed = False
        for p in self._procs:
            p.start()
        try:
            self._gather(-1, STARTUP_TIMEOUT_S, "start")
        except BaseException:
            self.close()
            raise

    def run(self, task: Task, *, timeout_s: float = TASK_TIMEOUT_S) -> list[Any]:
        if self._closed:
            raise LaunchError("the worker pool is closed (an earlier task failed)")
        self._seq += 1
        for inbox in self._inboxes:
            inbox.put((self._seq, task))
        try:
            return self._gather(self._seq, timeout_s, type(task).__name__)
        except BaseException:
            self.close()
            raise

    def _gather(self, seq: int, timeout_s: float, what: str) -> list[Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            try:
                rank, rseq, ok, value = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if r not in got and p.exitcode not in (None, 0)]
                if dead and self._outbox.empty():
                    time.sleep(POLL_S)
                    if self._outbox.empty():
                        code = self._procs[dead[0]].exitcode
                        raise LaunchError(f"rank {dead[0]} died during {what} (exit code {code})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    raise LaunchError(
                        f"rank(s) {missing} did not finish {what} within {timeout_s:.0f} s (hung?)"
                    ) from None
                continue
            if not ok:
                raise LaunchError(f"rank {rank} failed during {what}:\n{value}")
            if rseq == seq:
                got[rank] = value
        return [got[r] for r in range(self.world_size)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._tmp.cleanup()


# ----------------------------------------------------------------------------- torchrun
class TorchrunPool:
    """This process is one rank of torchrun's group; rank 0 drives, the others serve."""

    def __init__(self, backend: str | None = None) -> None:
        self.ctx = torchrun_context(backend)
        self.world_size = self.ctx.world_size
        self.backend = self.ctx.backend
        self.is_driver = self.ctx.rank == 0
        self._group = dist.new_group(backend="gloo")  # task objects travel over gloo, not NCCL

    def run(self, task: Task, *, timeout_s: float = TASK_TIMEOUT_S) -> list[Any]:
        if not self.is_driver:
            raise LaunchError("only rank 0 drives a torchrun pool")
        return self._round(task)

    def _round(self, task: Task | None) -> list[Any]:
        box = [task]
        dist.broadcast_object_list(box, src=0, group=self._group)
        if box[0] is None:
            return []
        mine: tuple[bool, Any]
        try:
            mine = (True, box[0].run(self.ctx))
        except Exception:
            mine = (False, traceback.format_exc())
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self._group)
        for rank, (ok, value) in enumerate(gathered):
            if not ok:
                raise LaunchError(f"rank {rank} failed during {type(box[0]).__name__}:\n{value}")
        return [value for _, value in gathered]

    def close(self) -> None:
        if self.is_driver:
            self._round(None)


def _serve_torchrun(pool: TorchrunPool) -> None:
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=pool._group)
        task = box[0]
        if task is None:
            return
        try:
            mine = (True, task.run(pool.ctx))
        except Exception:
            mine = (False, traceback.format_exc())
        gathered: list[Any] = [None] * pool.world_size
        dist.all_gather_object(gathered, mine, group=pool._group)
        if any(not ok for ok, _ in gathered):
            raise LaunchError("a rank failed; rank 0 reports it")


@contextlib.contextmanager
def open_pool(world_size: int, *, backend: str | None = None) -> Iterator[Pool]:
    """The pool for one command: torchrun's ranks when started by torchrun, else spawned ones.

    On a serving torchrun rank the body runs with ``pool.is_driver`` False after the driver has
    closed the pool; commands skip their work there.
    """
    if in_torchrun():
        pool = TorchrunPool(backend)
        try:
            if pool.world_size != world_size:
                raise LaunchError(
                    f"torchrun started {pool.world_size} ranks but --world-size is {world_size}"
                )
            if not pool.is_driver:
                _serve_torchrun(pool)
                yield pool
                return
            try:
                yield pool
            finally:
                pool.close()
        finally:
            # A gloo rank that exits with the group up can abort at interpreter shutdown, and
            # torchrun then kills rank 0 before it has written its files: leave it here.
            if dist.is_initialized():
                dist.destroy_process_group()
        return
    spawned = SpawnedPool(world_size, backend)
    try:
        yield spawned
    finally:
        spawned.close()
