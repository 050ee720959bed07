"""Running a function on every rank of a local process group: under torchrun, or by spawning.

``run_ranks(fn, world_size, payload)`` starts one process per rank (spawn), joins them into a
process group (NCCL with one GPU per rank when there are enough GPUs, else gloo on the CPU), calls
``fn(ctx, payload)`` on each and returns the per-rank results in rank order: a one-task pool of
``fo_tune.harness``. A rank that raises, dies or hangs ends the whole run within ``timeout_s``
with a ``LaunchError`` naming the rank and carrying its traceback; no process is left behind.

``in_torchrun()`` / ``torchrun_context()`` serve commands started by torchrun, where the process
group comes from the environment instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fo_kernels.errors import EnvironmentMismatchError, FoTuneError

T = TypeVar("T")
# NVLink multicast must stay off on the shared H200 hosts (device notes: NVLS can take the host's
# GPUs out of service); every rank process gets these unless the caller set them.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


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


@dataclass(frozen=True)
class _Call:
    """``fn(ctx, payload)`` as a harness task."""

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
    """Run ``fn(ctx, payload)`` once on ``world_size`` spawned ranks; results in rank order.

    A one-task ``fo_tune.harness.SpawnedPool``: the same start-up, failure and timeout handling.
    """
    if world_size < 1:
        raise EnvironmentMismatchError(f"world size must be >= 1, got {world_size}")
    from .harness import SpawnedPool  # the harness builds on this module

    pool = SpawnedPool(world_size, backend)
    try:
        return pool.run(_Call(fn, payload), timeout_s=timeout_s)
    finally:
        pool.close()


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
