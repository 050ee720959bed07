"""What a pool of ranks is, whichever started them: the ``Pool`` a command drives, the ``Task`` every
rank runs at once, the ``RankContext`` a task gets, and ``LaunchError`` for a rank that failed,
died or hung. ``fo_tune.ranks.launch.open_pool`` opens one of the two kinds: ranks this process
spawns (``fo_tune.ranks.spawned``) or torchrun's (``fo_tune.ranks.launch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fo_kernels.errors import FoTuneError

# Default per-task limit; a measurement sweep is split into tasks well under it.
TASK_TIMEOUT_S = 600.0


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


class Pool(Protocol):
    """The ranks of one command (``SpawnedPool`` or ``TorchrunPool``); ``run`` returns by rank."""

    is_driver: bool
    world_size: int
    backend: str

    def run(self, task: Task, *, timeout_s: float = TASK_TIMEOUT_S) -> list[Any]: ...
