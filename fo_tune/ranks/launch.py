"""The worker pool of a command (``open_pool``: spawned ranks, or torchrun's), torchrun's ranks,
``run_ranks``, and the hardware fingerprint the ranks agree on. What a pool is lives in
``fo_tune.ranks.pool``, the backend rule in ``fo_tune.ranks.backend``, the spawned ranks in
``fo_tune.ranks.spawned``.

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
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from fo_kernels.errors import EnvironmentMismatchError
from fo_tune.ranks.backend import SAFE_ENV, choose_backend, in_torchrun
from fo_tune.ranks.pool import TASK_TIMEOUT_S, LaunchError, Pool, RankContext, Task, task_label
from fo_tune.ranks.spawned import SpawnedPool

if TYPE_CHECKING:
    from fo_kernels.fingerprint import Fingerprint

T = TypeVar("T")


# ----------------------------------------------------------------------------- torchrun
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
