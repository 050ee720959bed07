"""Ranks this process spawns and drives (``SpawnedPool``): one process per rank, started once and
joined into one process group, each serving the driver's tasks from its queue until the pool
closes (see ``fo_tune.ranks.launch``). NCCL ranks are spawned (a fresh interpreter each); gloo
ranks fork from a server process that has imported torch once (``rank_processes``), and each takes
the driver's working folder, environment and ``sys.path`` as they are when the pool starts.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fo_tune.ranks.backend import SAFE_ENV, choose_backend
from fo_tune.ranks.interrupt import sigint_deferred
from fo_tune.ranks.orphan import orphaned, remove_pool_files
from fo_tune.ranks.pool import TASK_TIMEOUT_S, LaunchError, RankContext, Task, task_label

# How often the driver checks for dead ranks while it waits for results.
POLL_S = 0.5
# How long a rank may take to join the process group and answer the first ping.
STARTUP_TIMEOUT_S = 300.0
# How long closed ranks get to leave before they are stopped; after a Ctrl-C, busy ones are not waited for.
CLOSE_WAIT_S, INTERRUPTED_WAIT_S = 10.0, 1.0

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
