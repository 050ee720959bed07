"""Engines: what runs an overlapped schedule, registered by the exact name its settings carry.

An ``Engine`` is stateless; what it keeps between calls (streams, counters, peer buffers, graphs)
lives in the ``OverlapRuntime`` of the call's (device, group). Call order, per call of the ops
(``fo_kernels.overlap``): the ops check the operands and resolve the schedule, then
``get_engine(schedule.engine).run(schedule, a, b, runtime)``. ``blocker``
says, without running anything, why this process cannot run the engine ("" when it can); the ops
and the tuner ask it before choosing an engine. ``collectives`` names the collectives an engine
runs; ``check_collective`` is the one place that refuses a schedule for another one.

Registered here, one package each: ``triton`` (``fo_kernels.engines.triton``: the signalled
persistent Triton GEMM and NCCL per group) and ``copy_engine`` (``fo_kernels.engines.copy_engine``:
library GEMM chunks and copy-engine pulls between NVLink peers). An engine's package holds its
settings (``settings.py``, ``SETTINGS``), its ``Engine`` (``ENGINE`` in ``__init__.py``) and its
executor; it is imported on first use, and reading its settings defines no Triton kernel.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from fo_kernels.errors import ScheduleError
from fo_kernels.registry import Registry

if TYPE_CHECKING:
    from fo_kernels.gemm import BOperand
    from fo_kernels.runtime import OverlapRuntime
    from fo_kernels.scaling import Scales
    from fo_kernels.schedule import EngineSettings, Schedule


# What ``Engine.run`` returns: the (M, N) output; for all_gather the pair (output, gathered A).
EngineResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class Engine(ABC):
    """Runs one overlapped GEMM + collective (see the module docstring for the call order)."""

    name: ClassVar[str]
    collectives: ClassVar[tuple[str, ...]]  # the collectives ``run`` serves

    @abstractmethod
    def blocker(self, device: torch.device, world_size: int) -> str:
        """Why this process cannot run the engine, as a phrase after "engine NAME" ("" if it can)."""

    @abstractmethod
    def run(
        self,
        schedule: Schedule,
        a: torch.Tensor,
        b: BOperand,
        runtime: OverlapRuntime,
        *,
        scales: Scales | None = None,
        own_graphs: bool = True,
    ) -> EngineResult:
        """``schedule.collective(a @ b)`` over the runtime's group, overlapped as its settings say
        (the ops have checked the operands, that the schedule covers the call and that the engine
        serves its collective). For all_gather, ``a`` is this rank's shard and the result is
        ``(gathered @ b, gathered)``. ``scales``: an fp8 call's (``fo_kernels.scaling``; the
        output in ``scales.out_dtype``). Outputs are new tensors the caller owns (never views of
        buffers the runtime reuses: autograd may keep them). ``own_graphs=False``: no CUDA graph or
        output pool of the engine's own; outputs from the caller's allocator."""


def check_collective(engine: Engine, collective: str) -> None:
    """Raise ``ScheduleError`` when ``engine`` does not run ``collective`` in this build."""
    if collective not in engine.collectives:
        raise ScheduleError(
            f"engine: {engine.name} has no {collective} path in this build (it runs "
            f"{', '.join(engine.collectives)}); use a schedule of another engine or overlap: false"
        )


# Each engine's package by name: its ``ENGINE`` (the ``Engine`` class; the package is light, the
# kernels load when it first runs) and ``settings.SETTINGS`` (its part of a schedule).
ENGINES = Registry(
    "engine:",
    {"copy_engine": "fo_kernels.engines.copy_engine", "triton": "fo_kernels.engines.triton"},
    error=ScheduleError,
)


def engine_names() -> tuple[str, ...]:
    """The registered engines' names."""
    return ENGINES.names()


@functools.cache
def get_engine(name: str) -> Engine:
    """The engine registered as ``name`` (one instance per process: engines are stateless); an
    unknown name lists the valid ones."""
    return ENGINES.load(name, "ENGINE")()


def engine_settings(name: object) -> type[EngineSettings]:
    """The settings type of the engine registered as ``name``; an unknown name lists the valid ones."""
    return _settings_of(ENGINES.check(name))


@functools.cache
def _settings_of(name: str) -> type[EngineSettings]:
    """``engine_settings`` of a registered name, imported once (a table's every row asks)."""
    return ENGINES.load(name, "settings").SETTINGS
