"""Rank processes: the process-group backend, the worker pool of a command, ``run_ranks``, and the
hardware fingerprint the ranks agree on.

    with fingerprinted_pool(world_size, purpose="bench") as (pool, fp):
        if fp is None:                           # a serving torchrun rank: rank 0 did the work
            return None
        per_rank = pool.run(SomeTask(...))       # every rank runs task.run(ctx); results by rank
        timing = Timing.max_over(per_rank)       # fo_tune.ranks.timing: a measurement is the max over ranks

- Spawned (no torchrun): the calling process drives; it starts one process per rank once, joins
  them into one process group (``choose_backend``: NCCL with a GPU each, else gloo), and sends them
  tasks. Processes and communicators live for the whole command, never one per candidate. NCCL
  ranks are spawned (a fresh interpreter each); gloo ranks fork from a server process that has
  imported torch once (``rank_processes``), and each takes the driver's working folder,
  environment and ``sys.path`` as they are when the pool starts, as a spawned one would.
- Under torchrun: rank 0 drives; the other ranks serve tasks it broadcasts until it closes the pool
  (``pool.is_driver`` is False there, and the command body is skipped). Every rank leaves the
  process group when the pool closes.
- A rank that raises, dies or hangs ends the command within ``timeout_s`` with ``LaunchError`` naming
  the rank (its traceback attached); the pool is then closed and every process stopped. Spawned ranks
  exit on their own, removing the pool's files, when the driver dies without closing the pool
  (SIGKILL: ``fo_tune.ranks.orphan``); they start with SIGINT blocked (``fo_tune.ranks.interrupt``).

Tasks are picklable objects with ``run(ctx) -> result`` (``Task``), run on every rank at once, so any
collective inside them is matched. ``run_ranks(fn, world_size, payload)`` is a one-task pool.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from fo_kernels.errors import ArgumentError, EnvironmentMismatchError, FoTuneError
from fo_tune.ranks.interrupt import sigint_deferred
from fo_tune.ranks.orphan import orphaned, remove_pool_files

if TYPE_CHECKING:
    from fo_kernels.fingerprint import Fingerprint

T = TypeVar("T")
# NVLink multicast (NVLS) stays off: on some H200 hosts it takes the host's GPUs out of service;
# every rank process gets these unless the caller set them.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BACKENDS = ("nccl", "gloo")
# The rendezvous variables torchrun sets in every rank's environment.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
# How often the driver checks for dead ranks while it waits for results.
POLL_S = 0.5
# How long a rank may take to join the process group and answer the first ping.
STARTUP_TIMEOUT_S = 300.0
# Default per-task limit; a measurement sweep is split into tasks well under it.
TASK_TIMEOUT_S = 600.0
# How long closed ranks get to leave before they are stopped; after a Ctrl-C, busy ones are not waited for.
CLOSE_WAIT_S, INTERRUPTED_WAIT_S = 10.0, 1.0
# The most ranks this machine starts without GPUs (gloo processes, or the copy engine's thread-ranks;
# a gloo rank holds torch and Triton's interpreter, ~0.4 GB resident): twice the largest world the
# tuner plans (one 8-GPU NVSwitch board), while a mistyped --world-size (1000) is refused before
# anything starts instead of exhausting the machine's memory.
MAX_CPU_WORLD_SIZE = 16


class LaunchError(FoTuneError, RuntimeError):
    """A rank failed, died or hung."""


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank function gets: its rank, the world size, its device and the backend."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


class Task(Protocol):
    """A unit of work every rank runs at once; the result must be picklable."""

    def run(self, ctx: RankContext) -> Any: ...


def task_label(task: Task) -> str:
    """What a task's ranks do, for its errors: a ``run_ranks`` call's function, else the task's type."""
    return getattr(getattr(task, "fn", None), "__name__", None) or type(task).__name__


# ----------------------------------------------------------------------------- backend
def visible_gpus() -> int:
    """CUDA GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def in_torchrun() -> bool:
    """True when this process was started by torchrun (its rendezvous variables are set)."""
    return all(key in os.environ for key in TORCHRUN_VARS)


def check_world_size(world_size: object) -> int:
    """``world_size`` when it is an integer >= 1, else ``ArgumentError`` naming --world-size."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"--world-size: expected an integer >= 1, got {world_size!r}")
    return world_size


def check_cpu_world_size(world_size: int) -> None:
    """``ArgumentError`` (naming --world-size) for more ranks than ``MAX_CPU_WORLD_SIZE`` on the CPU."""
    if world_size > MAX_CPU_WORLD_SIZE:
        raise ArgumentError(
            f"--world-size {world_size}: at most {MAX_CPU_WORLD_SIZE} ranks run without GPUs (gloo "
            "processes, the copy engine's thread-ranks); lower --world-size"
        )


def choose_backend(world_size: int, backend: str | None = None) -> str:
    """``nccl`` or ``gloo`` for ``world_size`` ranks: the one rule of every command and pool.

    None or ``"auto"``: gloo when no GPU is visible, NCCL with one GPU per rank; GPUs visible but fewer
    than the ranks is an error (gloo beside visible GPUs is rarely what was meant: ask for ``"gloo"``).
    ``"nccl"`` needs one GPU per rank. Under torchrun the ranks may span hosts, so the local GPU count
    is not checked (``auto``: NCCL when any GPU is visible). Spawned gloo ranks: ``check_cpu_world_size``."""
    check_world_size(world_size)
    if backend not in (None, "auto", *BACKENDS):
        raise ArgumentError(f"--backend {backend!r} is not one of auto, {', '.join(BACKENDS)}")
    gpus = 0 if backend == "gloo" else visible_gpus()
    if backend == "gloo" or (backend != "nccl" and gpus == 0):
        if not in_torchrun():  # (torchrun started its ranks already)
            check_cpu_world_size(world_size)
        return "gloo"
    if gpus < world_size and not in_torchrun():
        raise too_few_gpus(world_size, gpus)
    return "nccl"


def too_few_gpus(world_size: int, gpus: int, *, default_fits: bool = False) -> EnvironmentMismatchError:
    """The error for NCCL ranks that ``gpus`` visible GPUs cannot hold, with the fixes that fit:
    fewer ranks where there are GPUs (``default_fits``: a command whose default world size takes
    the GPUs there are says so), else gloo."""
    fix = "use --backend gloo"
    if gpus:
        default = " (or leave it out to use the GPUs there are)" if default_fits else ""
        fix = f"lower --world-size to {gpus}{default}, or {fix}"
    return EnvironmentMismatchError(
        f"world size {world_size} needs {world_size} GPU(s), {gpus} visible (NCCL takes one per rank); {fix}"
    )


def torchrun_context(backend: str | None = None) -> RankContext:
    """Join the torchrun process group (if not yet) and describe this rank."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    backend = choose_backend(world, backend)
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, **({"device_id": device} if backend == "nccl" else {}))
    return RankContext(dist.get_rank(), world, device, backend)


class Pool(Protocol):
    """The ranks of one command (``SpawnedPool`` or ``TorchrunPool``); ``run`` returns by rank."""

    is_driver: bool
    world_size: int
    backend: str

    def run(self, task: Task, *, timeout_s: float = TASK_TIMEOUT_S) -> list[Any]: ...


# ----------------------------------------------------------------------------- spawned ranks
# What a gloo rank's server process imports before it forks the ranks: torch (~1.6 s of CPU a
# process, the most of a rank's start on the CPU) and "__main__" as spawn re-imports it, so a task
# defined in the driver's script unpickles. (Nothing that reads TRITON_INTERPRET: the ranks import
# fo_kernels after they take the driver's environment.)
FORKSERVER_PRELOAD = ["__main__", "torch"]


def rank_processes(backend: str) -> Any:
    """The multiprocessing context of ``backend``'s ranks: spawn for NCCL (CUDA in a fresh
    interpreter); forkserver with ``FORKSERVER_PRELOAD`` for gloo where the platform has it."""
    if backend == "gloo" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        return ctx
    return mp.get_context("spawn")


@dataclass(frozen=True)
class _Driver:
    """What a rank takes from its driver when it starts: a forked rank has its server's instead."""

    cwd: str
    env: dict[str, str]
    path: list[str]
    pid: int

    @staticmethod
    def now() -> _Driver:
        return _Driver(os.getcwd(), dict(os.environ), list(sys.path), os.getpid())

    def apply(self) -> None:
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.env)
        sys.path[:] = self.path


def _serve(rank: int, world: int, backend: str, init_file: str, inbox, outbox, driver: _Driver) -> None:
    driver.apply()
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
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
                if orphaned(driver.pid, parent):  # (SIGKILL skips the driver's clean-up)
                    remove_pool_files(Path(init_file).parent)
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
        self.backend = choose_backend(world_size, backend)
        self._ctx = rank_processes(self.backend)
        self._tmp = tempfile.TemporaryDirectory(prefix="fo-tune-pool-")
        self._outbox = self._ctx.Queue()
        self._inboxes = [self._ctx.Queue() for _ in range(world_size)]
        init_file = str(Path(self._tmp.name) / "store")
        self._procs = [
            self._ctx.Process(
                target=_serve,
                args=(r, world_size, self.backend, init_file, self._inboxes[r], self._outbox, _Driver.now()),
                daemon=True,
            )
            for r in range(world_size)
        ]
        self._seq = 0
        self._closed = False
        try:
            with sigint_deferred():  # (a Ctrl-C meanwhile is raised after: closes them)
                for p in self._procs:
                    p.start()
            self._gather(-1, STARTUP_TIMEOUT_S, "start")
        except BaseException as exc:
            self.close(INTERRUPTED_WAIT_S if isinstance(exc, KeyboardInterrupt) else CLOSE_WAIT_S)
            raise

    def run(self, task: Task, *, timeout_s: float = TASK_TIMEOUT_S) -> list[Any]:
        if self._closed:
            raise LaunchError("the worker pool is closed (an earlier task failed)")
        self._seq += 1
        for inbox in self._inboxes:
            inbox.put((self._seq, task))
        try:
            return self._gather(self._seq, timeout_s, task_label(task))
        except BaseException as exc:
            self.close(INTERRUPTED_WAIT_S if isinstance(exc, KeyboardInterrupt) else CLOSE_WAIT_S)
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
                        f"rank(s) {missing} did not finish {what} within {timeout_s:g} s (hung, or "
                        "slower than that: a longer --timeout allows more)"
                    ) from None
                continue
            if not ok:
                raise LaunchError(f"rank {rank} failed during {what}:\n{value}")
            if rseq == seq:
                got[rank] = value
        return [got[r] for r in range(self.world_size)]

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        if self._closed:
            return
        self._closed = True
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        deadline = time.monotonic() + wait_s
        started = [p for p in self._procs if p.pid is not None]
        for p in started:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in started:
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
                raise LaunchError(f"rank {rank} failed during {task_label(box[0])}:\n{value}")
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
    closed the pool; commands skip their work there."""
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


# ----------------------------------------------------------------------------- the fingerprint
@dataclass(frozen=True)
class FingerprintTask:
    """Every rank's hardware fingerprint (``agreed_fingerprint`` checks that they agree)."""

    def run(self, ctx: RankContext) -> Fingerprint:
        from fo_kernels.fingerprint import current_fingerprint

        return current_fingerprint(ctx.device, ctx.world_size)


def agreed_fingerprint(pool: Pool, purpose: str) -> Fingerprint:
    """The fingerprint of the pool's ranks, which must all see the same hardware (one device key):
    a measurement is the max over ranks, and its files carry one fingerprint. ``purpose`` names
    the command in the ``EnvironmentMismatchError`` raised otherwise."""
    fps = pool.run(FingerprintTask())
    keys = sorted({f.device_key for f in fps})
    if len(keys) > 1:
        raise EnvironmentMismatchError(f"ranks see different hardware ({keys}); {purpose} on identical GPUs")
    return fps[0]


@contextlib.contextmanager
def fingerprinted_pool(
    world_size: int, *, backend: str | None = None, purpose: str
) -> Iterator[tuple[Pool, Fingerprint | None]]:
    """``open_pool`` and, on the driver, ``agreed_fingerprint``: what calibrate, search and bench
    measure in. A serving torchrun rank gets None for the fingerprint after the driver is done."""
    with open_pool(world_size, backend=backend) as pool:
        yield pool, (agreed_fingerprint(pool, purpose) if pool.is_driver else None)


# ----------------------------------------------------------------------------- run_ranks
@dataclass(frozen=True)
class _Call:
    """``fn(ctx, payload)`` as a pool task."""

    fn: Callable[[RankContext, Any], Any]
    payload: Any

    def run(self, ctx: RankContext) -> Any:
        return self.fn(ctx, self.payload)


def run_ranks(
    fn: Callable[[RankContext, Any], T],
    world_size: int,
    payload: Any = None,
    *,
    backend: str | None = None,
    timeout_s: float = 900.0,
) -> list[T]:
    """Run ``fn(ctx, payload)`` once on ``world_size`` spawned ranks (a one-task ``SpawnedPool``:
    the same start-up, failure and timeout handling); results in rank order."""
    if world_size < 1:
        raise EnvironmentMismatchError(f"world size must be >= 1, got {world_size}")
    pool = SpawnedPool(world_size, backend)
    try:
        return pool.run(_Call(fn, payload), timeout_s=timeout_s)
    finally:
        pool.close()
