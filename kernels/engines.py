"""Engines: what runs an overlapped schedule, registered by the exact name its settings carry.

An ``Engine`` is stateless; what it keeps between calls (streams, counters, peer buffers, graphs)
lives in the ``OverlapRuntime`` of the call's (device, group). Call order, per call of the ops
(``fo_kernels.overlap``): the ops check the operands and resolve the schedule, then
``get_engine(schedule.engine).run(schedule, a, b, runtime)``. ``blocker``
says, without running anything, why this process cannot run the engine ("" when it can); the ops
and the tuner ask it before choosing an engine. ``collectives`` names the collectives an engine
runs; ``check_collective`` is the one place that refuses a schedule for another one.

Registered here: ``triton`` (``fo_kernels.triton_engine``: the signalled persistent Triton GEMM and
NCCL per group) and ``copy_engine`` (``fo_kernels.copy_engine``: library GEMM chunks and copy-engine
pulls between NVLink peers). Each engine's module is imported on first use, so reading a table
defines no Triton kernel.
"""

from __future__ import annotations

import functools
import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from .errors import ScheduleError
from .schedule import CopyEngineSettings, Schedule

if TYPE_CHECKING:
    from .gemm import BOperand
    from .runtime import OverlapRuntime


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
        own_graphs: bool = True,
    ) -> EngineResult:
        """``schedule.collective(a @ b)`` over the runtime's group, overlapped as its settings say
        (the ops have checked the operands, that the schedule covers the call and that the engine
        serves its collective). For all_gather, ``a`` is this rank's shard and the result is
        ``(gathered @ b, gathered)``. Outputs are new tensors the caller owns (never views of
        buffers the runtime reuses: autograd may keep them). ``own_graphs=False``: no CUDA graph or
        output pool of the engine's own; outputs from the caller's allocator."""


def check_collective(engine: Engine, collective: str) -> None:
    """Raise ``ScheduleError`` when ``engine`` does not run ``collective`` in this build."""
    if collective not in engine.collectives:
        raise ScheduleError(
            f"engine: {engine.name} has no {collective} path in this build (it runs "
            f"{', '.join(engine.collectives)}); use a schedule of another engine or overlap: false"
        )


# name -> "module:class" of the engine, imported on first use.
_REGISTRY: dict[str, str] = {
    "triton": "fo_kernels.triton_engine:TritonEngine",
    "copy_engine": "fo_kernels.engines:CopyEngine",
}


def engine_names() -> tuple[str, ...]:
    """The registered engines' names."""
    return tuple(sorted(_REGISTRY))


@functools.cache
def get_engine(name: str) -> Engine:
    """The engine registered as ``name`` (one instance per process: engines are stateless); an
    unknown name lists the valid ones."""
    where = _REGISTRY.get(name) if isinstance(name, str) else None
    if where is None:
        raise ScheduleError(f"engine: {name!r} is not one of {', '.join(engine_names())}")
    module, cls = where.split(":")
    return getattr(importlib.import_module(module), cls)()


class CopyEngine(Engine):
    """The ``copy_engine`` engine through the runtime's peers object (``fo_kernels.copy_engine``)."""

    name: ClassVar[str] = "copy_engine"
    collectives: ClassVar[tuple[str, ...]] = ("all_reduce", "reduce_scatter", "all_gather")

    def blocker(self, device: torch.device, world_size: int) -> str:
        from .copy_engine import copy_engine_blocker

        return copy_engine_blocker(device, world_size)

    def run(
        self,
        schedule: Schedule,
        a: torch.Tensor,
        b: BOperand,
        runtime: OverlapRuntime,
        *,
        own_graphs: bool = True,
    ) -> EngineResult:
        st = schedule.settings
        assert isinstance(st, CopyEngineSettings)
        peers_args = dict(mode=st.mode, weights=st.weights, tile=st.tile, own_graphs=own_graphs)
        if schedule.collective == "all_gather":  # (a is this rank's shard: every rank owns its rows)
            gathered, out = runtime.copy_engine().run_all_gather(a, b.tensor, **peers_args)
            return out, gathered
        if a.shape[0] < runtime.world_size:  # a rank would own no row (an M-range row reaching M = 1)
            return runtime.fallback().run(schedule.collective, a, b.tensor, own_graphs=own_graphs)
        return runtime.copy_engine().run(schedule.collective, a, b.tensor, **peers_args)
