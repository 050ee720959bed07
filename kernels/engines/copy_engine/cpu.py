"""The CPU executor: the same operation lists as on GPUs, run by thread-ranks with real concurrency.

    host thread of rank r   for op in plan.ops: [random delay]; [host_blocks(op): wait until
                            its streams are idle]; queue op on its stream's FIFO
                            wait until the main stream has run everything queued on it
    FIFO worker (a thread)  for op in its queue: [random delay]; run op
                            (waits block the worker, as a stream waits on the GPU)

Each stream of a rank is a FIFO worker of its own, so operations on different streams overlap and
are ordered only by ``Join``, ``WaitEvent`` and the flag waits, as on a GPU; ``fifos`` maps several
streams onto one FIFO to model streams that share one hardware queue (a wait there blocks the work
queued behind it on the other stream). The symmetric regions are byte tensors every thread can read
(``buffers.Regions``), the flag cells integers under one lock per rank. What each operation does
there is ``cpu_run.CpuRun``'s: the GEMMs as torch matmuls (fp8: ``torch._scaled_mm``), the tiled
mode's persistent kernel as its chunks in order.

What fails a run, always within ``timeout_s`` instead of hanging:

- a wait that is not satisfied in time (a lost flag, a deadlock): ``ProtocolTimeout`` naming the
  rank, stream, operation and the cell's value; the other threads then stop waiting;
- a flag set while it is still 1 (set twice before its reset, so one signal is lost), a wait or
  reset of a peer's cell, an event waited for before it is recorded: ``ProtocolError``;
- a stream with work left when the call's main stream is done (the list does not join it back).

``drop`` injects faults: operations for which it returns True are not issued.
"""

from __future__ import annotations

import contextlib
import math
import queue
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from fo_kernels.engines.copy_engine.buffers import Regions, data_bytes
from fo_kernels.engines.copy_engine.cpu_run import CpuRun
from fo_kernels.engines.copy_engine.layout import Cell, FlagLayout
from fo_kernels.engines.copy_engine.ops import (
    MAIN,
    STREAMS,
    CallPlan,
    Join,
    Op,
    Record,
    WaitEvent,
)
from fo_kernels.errors import ArgumentError, ProtocolError, ProtocolTimeout
from fo_kernels.scaling import Scales

T = TypeVar("T")


class _Aborted(Exception):
    """Another thread failed first: stop waiting."""


@dataclass(frozen=True, kw_only=True)
class CpuOptions:
    """How the CPU executor runs: ``timeout_s`` for every wait; a random delay of up to
    ``delay_s`` before every operation (host and streams, from ``seed``); ``slow[rank]`` more
    seconds before each operation that rank's host issues (a host that falls behind); ``fifos``
    maps stream names to FIFO names (left out: one FIFO per stream); ``drop(rank, index, op)``
    True leaves that operation out (fault injection); ``host_blocks(op)`` True makes the host wait,
    before it issues ``op``, until every stream of its rank has run everything queued on it (a
    host that blocks there: a synchronizing torch op, or a kernel's first load under CUDA's lazy
    module loading, which at worst waits for all of the rank's queued work)."""

    timeout_s: float = 10.0
    delay_s: float = 0.0
    seed: int = 0
    slow: Mapping[int, float] | None = None
    fifos: Mapping[str, str] | None = None
    drop: Callable[[int, int, Op], bool] | None = None
    host_blocks: Callable[[Op], bool] | None = None

    def __post_init__(self) -> None:
        """Every option checked here, before any thread starts: ``ArgumentError`` naming it."""
        if not _number(self.timeout_s) or not 0 < self.timeout_s < math.inf:
            raise ArgumentError(f"timeout_s: expected a finite number of seconds > 0, got {self.timeout_s!r}")
        if not _number(self.delay_s) or not 0 <= self.delay_s < math.inf:
            raise ArgumentError(f"delay_s: expected a finite number of seconds >= 0, got {self.delay_s!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ArgumentError(f"seed: expected an integer, got {self.seed!r}")
        slow = self.slow if self.slow is not None else {}
        if not isinstance(slow, Mapping) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 and _number(s) and 0 <= s < math.inf
            for r, s in slow.items()
        ):
            raise ArgumentError(
                f"slow: expected a mapping of rank (an integer >= 0) to finite seconds >= 0, "
                f"got {self.slow!r}"
            )
        fifos = self.fifos if self.fifos is not None else {}
        if not isinstance(fifos, Mapping) or not all(isinstance(q, str) for q in fifos.values()):
            raise ArgumentError(f"fifos: expected a mapping of stream name to FIFO name, got {self.fifos!r}")
        unknown = set(fifos) - set(STREAMS)
        if unknown:
            raise ArgumentError(
                f"fifos: unknown stream(s) {sorted(map(str, unknown))}; valid: {', '.join(STREAMS)}"
            )
        if self.drop is not None and not callable(self.drop):
            raise ArgumentError(
                f"drop: expected a function (rank, index, op) -> bool, or None; got {self.drop!r}"
            )
        if self.host_blocks is not None and not callable(self.host_blocks):
            raise ArgumentError(
                f"host_blocks: expected a function op -> bool, or None; got {self.host_blocks!r}"
            )


def _number(x: object) -> bool:
    """An int or float, not a bool (a comparison then means what it says)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# The share of operations that a random delay holds back: a sleep costs a thread switch under the
# GIL, and with 8 ranks of 5 streams sleeping before every operation made a run several times
# slower without reaching more orders (a delayed operation delays everything behind it anyway).
PAUSE_SHARE = 0.125


def _pause(rng: random.Random, delay_s: float) -> None:
    """A random delay of up to ``delay_s`` before ``PAUSE_SHARE`` of the operations."""
    x = rng.random()
    if x < PAUSE_SHARE:
        time.sleep(x / PAUSE_SHARE * delay_s)


class World:
    """What the thread-ranks share: flag cells, regions, per-stream progress, the first failure.

    A rank's cells and progress change under its lock (``change``); a waiter registers what it
    waits for and is woken only once that holds (no thread wakes for a change it does not need)."""

    def __init__(self, world: int, options: CpuOptions, region_bytes: int, scale_bytes: int = 0) -> None:
        self.size, self.options = world, options
        self.locks = [threading.Lock() for _ in range(world)]
        self._waiters: list[list[tuple[Callable[[], bool], threading.Event]]] = [[] for _ in range(world)]
        self.cells: dict[Cell, int] = defaultdict(int)
        layout = FlagLayout(world)
        for q in range(world):
            for cell in layout.guards(q):
                self.cells[cell] = 1
        self.done: dict[tuple[int, str], int] = defaultdict(int)  # (rank, stream) -> ops run
        self.failure: BaseException | None = None
        total = data_bytes(world, region_bytes, scale_bytes)
        data = {q: torch.zeros(total, dtype=torch.uint8) for q in range(world)}
        self.regions = Regions(world, region_bytes, data, scale_bytes)

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        for rank, lock in enumerate(self.locks):
            with lock:
                for _, woken in self._waiters[rank]:
                    woken.set()

    def changed(self, rank: int) -> None:
        """Wake the waiters of rank ``rank`` whose condition now holds (its lock held)."""
        waiters = self._waiters[rank]
        if waiters:
            ready = [w for w in waiters if w[0]()]
            for w in ready:
                waiters.remove(w)
                w[1].set()

    def wait_until(
        self, rank: int, ready: Callable[[], bool], what: Callable[[], str], timeout_s: float | None = None
    ) -> None:
        """Block until ``ready()`` (about rank ``rank``'s cells or progress), the timeout (default
        ``options.timeout_s``), or a failure elsewhere."""
        timeout_s = self.options.timeout_s if timeout_s is None else timeout_s
        lock = self.locks[rank]
        with lock:
            if ready():
                return
            if self.failure is not None:
                raise _Aborted
            waiter = (ready, threading.Event())
            self._waiters[rank].append(waiter)
        if waiter[1].wait(timeout_s) and self.failure is None:
            return
        with lock:
            if waiter in self._waiters[rank]:
                self._waiters[rank].remove(waiter)
            if ready():
                return
        if self.failure is not None:
            raise _Aborted
        raise ProtocolTimeout(f"{what()} for {timeout_s:g} s: a lost flag or a deadlock")


class _Fifo:
    """One FIFO worker: runs queued (stream, operation) items in order."""

    def __init__(self, world: World, rank: int, name: str, seed: int) -> None:
        self.world, self.rank = world, rank
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.rng = random.Random(seed)
        self.thread = threading.Thread(target=self._loop, name=f"rank{rank}:{name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        world, delay = self.world, self.world.options.delay_s
        while True:
            item = self.queue.get()
            if item is None:
                return
            stream, run = item
            try:
                if world.failure is None:
                    if delay:
                        _pause(self.rng, delay)
                    run()
            except _Aborted:
                pass
            except BaseException as exc:
                world.fail(exc)
            finally:
                with world.locks[self.rank]:
                    world.done[self.rank, stream] += 1
                    world.changed(self.rank)


class CpuRank:
    """One thread-rank: its FIFOs and the issue of its calls (``call``)."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank
        self._fifos: dict[str, _Fifo] = {}
        self._issued: dict[str, int] = defaultdict(int)
        self._events: dict[int, tuple[str, int]] = {}
        self._rng = random.Random(world.options.seed * 7919 + rank)
        self._calls = 0

    def call(
        self,
        plan: CallPlan,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        gathered: torch.Tensor | None = None,
        scales: Scales | None = None,
    ) -> None:
        """Issue ``plan``'s operations, then wait for the main stream (as a synchronize would).
        ``scales``: an fp8 call's (rowwise: ``scales.a`` has this rank's rows of A)."""
        world, r = self.world, self.rank
        if plan.spec.rank != r or plan.spec.world != world.size:
            raise ProtocolError(
                f"rank {r} of {world.size} was given the plan of rank {plan.spec.rank} of {plan.spec.world}"
            )
        tensors = {"a": a, "out": out, "gathered": gathered, "scales": scales}
        if scales is not None and scales.rowwise:
            tensors["scale_a"] = scales.a.view(-1, 1)
            if plan.spec.row_scales:
                tensors["gathered_scale"] = torch.empty(plan.spec.m, 1, dtype=torch.float32)
        self.run_ops(plan.ops, lambda where: CpuRun(world, r, plan, tensors, b, where))

    def run_ops(self, ops: tuple[Op, ...], make_run: Callable[[str], Callable[[Op], None]]) -> None:
        """Issue ``ops``, then wait for the main stream; ``make_run(where)`` runs the operations
        that are neither events nor joins (``call``'s are ``CpuRun``; another protocol's, its own)."""
        world, r, opts = self.world, self.rank, self.world.options
        self._calls += 1
        slow = (opts.slow or {}).get(r, 0.0)
        for i, op in enumerate(ops):
            if opts.drop is not None and opts.drop(r, i, op):
                continue
            if opts.delay_s:
                _pause(self._rng, opts.delay_s / 4)
            if slow:
                time.sleep(slow)
            if opts.host_blocks is not None and opts.host_blocks(op):
                self._drain(f"rank {r}, call {self._calls}: its host, before op {i} {type(op).__name__},")
            self._issue(i, op, len(ops), make_run)
        target = self._issued[MAIN]
        # (each operation's wait is bounded: one of them times out first, and says which)
        with contextlib.suppress(_Aborted):
            world.wait_until(
                r,
                lambda: world.done[r, MAIN] >= target,
                lambda: f"rank {r}'s host waited for its main stream",
                opts.timeout_s * (len(ops) + 1),
            )
        if world.failure is not None:
            raise world.failure
        left = [s for s, n in self._issued.items() if world.done[r, s] < n]
        if left:
            raise ProtocolError(
                f"rank {r}, call {self._calls}: stream(s) {', '.join(left)} still had work when the "
                "call's main stream was done: the list does not join them back"
            )

    def _drain(self, who: str) -> None:
        """Block until every stream of this rank has run everything queued on it."""
        world, r = self.world, self.rank
        issued = dict(self._issued)
        with contextlib.suppress(_Aborted):
            world.wait_until(
                r,
                lambda: all(world.done[r, s] >= n for s, n in issued.items()),
                lambda: f"{who} waited for its streams",
                world.options.timeout_s * (sum(issued.values()) + 1),
            )

    def close(self) -> None:
        """Stop this rank's FIFO workers and wait for them: a worker still inside a torch op
        when the interpreter exits aborts the process (C++ ``terminate``). Their waits end on a
        failure anywhere, so the bound is a wait's."""
        for fifo in self._fifos.values():
            fifo.queue.put(None)
        for fifo in self._fifos.values():
            fifo.thread.join(self.world.options.timeout_s)

    # ------------------------------------------------------------------ issue
    def _issue(self, i: int, op: Op, count: int, make_run: Callable[[str], Callable[[Op], None]]) -> None:
        world, r, opts = self.world, self.rank, self.world.options
        where = f"rank {r}, call {self._calls}, {op.stream} stream, op {i} {type(op).__name__}"
        if isinstance(op, Record):
            self._events[op.event] = (op.stream, self._issued[op.stream] + 1)
            self._queue(op.stream, lambda: None)
        elif isinstance(op, (WaitEvent, Join)):
            if isinstance(op, WaitEvent):
                if op.event not in self._events:
                    raise ProtocolError(f"{where}: event {op.event} is waited for before it is recorded")
                other, count = self._events[op.event]
            else:
                other, count = op.other, self._issued[op.other]
            # (waits within a rank target work queued before them, so they cannot deadlock by
            # themselves: they get the long bound, and the flag wait behind a failure reports it)
            bound = opts.timeout_s * (count + 1)

            def wait() -> None:
                done = lambda: world.done[r, other] >= count
                world.wait_until(r, done, lambda: f"{where} waited for the {other} stream", bound)

            self._queue(op.stream, wait)
        else:
            run = make_run(where)
            self._queue(op.stream, lambda: run(op))

    def _queue(self, stream: str, run: Callable[[], None]) -> None:
        name = (self.world.options.fifos or {}).get(stream, stream)
        fifo = self._fifos.get(name)
        if fifo is None:
            seed = (self.world.options.seed * 1009 + self.rank) * 31 + len(self._fifos)
            fifo = self._fifos[name] = _Fifo(self.world, self.rank, name, seed)
        self._issued[stream] += 1
        fifo.queue.put((stream, run))


def run_ranks(
    world: int,
    body: Callable[[CpuRank], T],
    *,
    region_bytes: int,
    options: CpuOptions | None = None,
    scale_bytes: int = 0,
) -> list[T]:
    """Run ``body(rank)`` on ``world`` thread-ranks that share regions of ``region_bytes`` each
    (``buffers.region_bytes_for``) and a scales region of ``scale_bytes``; their results in rank
    order. The first failure of any thread (a ``ProtocolError``, or what ``body`` raised) is raised
    once every thread has stopped; so is a ``KeyboardInterrupt`` of the caller."""
    options = options or CpuOptions()
    beyond = sorted(r for r in options.slow or {} if r >= world)
    if beyond:
        raise ArgumentError(f"slow: rank(s) {beyond} outside the {world} ranks of this run")
    shared = World(world, options, region_bytes, scale_bytes)
    ranks = [CpuRank(shared, r) for r in range(world)]
    results: list = [None] * world

    def host(r: int) -> None:
        try:
            results[r] = body(ranks[r])
        except BaseException as exc:
            shared.fail(exc)

    threads = [
        threading.Thread(target=host, args=(r,), name=f"rank{r}:host", daemon=True) for r in range(world)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    except BaseException as exc:  # a Ctrl-C: the ranks stop too, or a thread left inside a torch op
        shared.fail(exc)  # when the interpreter exits aborts it (C++ terminate)
        for t in threads:
            if t.ident is not None:
                t.join(options.timeout_s)
        raise
    finally:
        for rank in ranks:
            rank.close()
    if shared.failure is not None:
        raise shared.failure
    return results
