"""Running a function on every rank of a local process group: under torchrun, or by spawning.

``run_ranks(fn, world_size, payload)`` starts one process per rank (spawn), joins them into a
process group (NCCL with one GPU per rank when there are enough GPUs, else gloo on the CPU), calls
``fn(ctx, payload)`` on each and returns the per-rank results in rank order. A rank that raises,
dies or hangs ends the whole run within ``timeout_s`` with a ``LaunchError`` naming the rank and
carrying its traceback; no process is left behind.

``in_torchrun()`` / ``torchrun_context()`` serve commands started by torchrun, where the process
group comes from the environment instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fo_kernels.errors import EnvironmentMismatchError, FoTuneError

T = TypeVar("T")
# NVLink multicast must stay off on the shared H200 hosts (device notes: NVLS can take the host's
# GPUs out of service); every rank process gets these unless the caller set them.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# How often the parent checks for dead ranks while waiting for results.
POLL_S = 0.5


class LaunchError(FoTuneError, RuntimeError):
    """A rank failed, died or hung."""


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a rank function gets: its rank, the world size, its device and the backend."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


def pick_backend(world_size: int, backend: str | None = None) -> str:
    """``nccl`` when there is one GPU per rank, else ``gloo``; an explicit choice is checked."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise EnvironmentMismatchError(
            f"world size {world_size} needs {world_size} GPUs for NCCL, {gpus} visible; lower --world-size"
        )
    if backend not in ("nccl", "gloo"):
        raise EnvironmentMismatchError(f"backend {backend!r} is not one of nccl, gloo")
    return backend


def _rank_main(fn, rank, world_size, backend, init_file, payload, results) -> None:
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            **({"device_id": device} if backend == "nccl" else {}),
        )
        try:
            out = fn(RankContext(rank, world_size, device, backend), payload)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # report everything, KeyboardInterrupt included, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None


def run_ranks(
    fn: Callable[[RankContext, Any], T],
    world_size: int,
    payload: Any = None,
    *,
    backend: str | None = None,
    timeout_s: float = 900.0,
) -> list[T]:
    """Run ``fn(ctx, payload)`` on ``world_size`` spawned ranks; results in rank order."""
    if world_size < 1:
        raise EnvironmentMismatchError(f"world size must be >= 1, got {world_size}")
    backend = pick_backend(world_size, backend)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fo-tune-rdzv-") as tmp:
        init_file = Path(tmp) / "store"
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world_size, backend, str(init_file), payload, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()


def _collect(procs, results, world_size: int, timeout_s: float) -> list:
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < world_size:
        try:
            rank, ok, value = results.get(timeout=POLL_S)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
            if dead:
                time.sleep(POLL_S)  # let a dying rank's report arrive before blaming it silently
                if results.empty():
                    raise LaunchError(
                        f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) without a report"
                    ) from None
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(got))
                raise LaunchError(
                    f"rank(s) {missing} did not finish within {timeout_s:.0f} s (hung?)"
                ) from None
            continue
        if not ok:
            raise LaunchError(f"rank {rank} failed:\n{value}")
        got[rank] = value
    return [got[r] for r in range(world_size)]


def in_torchrun() -> bool:
    """True when this process was started by torchrun (its rendezvous variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def torchrun_context(backend: str | None = None) -> RankContext:
    """Join the torchrun process group (if not yet) and describe this rank."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    backend = pick_backend(world, backend) if backend is None else backend
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, **({"device_id": device} if backend == "nccl" else {}))
    return RankContext(dist.get_rank(), world, device, backend)
