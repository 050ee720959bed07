"""Which backend and how many ranks: ``choose_backend`` (the one rule of every command and pool), the
world-size checks made before anything starts, the GPUs this process sees, whether torchrun started
it, and the environment every rank process gets (``SAFE_ENV``).
"""

from __future__ import annotations

import os

import torch

from fo_kernels.errors import ArgumentError, EnvironmentMismatchError

# NVLink multicast (NVLS) stays off: on some H200 hosts it takes the host's GPUs out of service;
# every rank process gets these unless the caller set them.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BACKENDS = ("nccl", "gloo")
# The rendezvous variables torchrun sets in every rank's environment.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
# The most ranks this machine starts without GPUs (gloo processes, or the copy engine's thread-ranks;
# a gloo rank holds torch and Triton's interpreter, ~0.4 GB resident): twice the largest world the
# tuner plans (one 8-GPU NVSwitch board), while a mistyped --world-size (1000) is refused before
# anything starts instead of exhausting the machine's memory.
MAX_CPU_WORLD_SIZE = 16


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
