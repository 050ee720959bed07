"""Engine plug-ins of the tuner, registered by the exact name of the runtime engine they tune.

    get_tuner("copy_engine").blocker(fingerprint, "all_reduce", "bfloat16")

Registered, one package each: ``triton`` (``fo_tune.engines.triton``: the signalled persistent
Triton GEMM and NCCL per group) and ``copy_engine`` (``fo_tune.engines.copy_engine``: library GEMM
chunks and copy-engine pulls between peers). Each package is imported on first use. An engine
added to the runtime (``fo_kernels.engines``) gets searched, predicted and calibrated by a package
here whose ``TUNER`` is its ``fo_tune.engines.base.EngineTuner`` and one line in ``TUNERS``; the
strategies, the encoding and the model need no change (``cost_model`` hands the model every
engine's term). See ``base`` for the call order.

An engine with an expert-parallel MoE path (``fo_kernels.moe.schedule.MOE_ENGINES``) also has a
``moe`` module in its package: ``MOE_TERM``, the class that prices its MoE schedules
(``fo_tune.moe.model``), made by ``moe_cost_model`` for every such engine, loaded through the
same registry (``moe_term``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fo_kernels.registry import Registry
from fo_tune.engines.base import EngineTuner, Infeasible, ShapeTask, UnknownEngineError

if TYPE_CHECKING:
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.model import CostModel
    from fo_tune.moe.model import MoeCostModel

__all__ = [
    "TUNERS",
    "EngineTuner",
    "Infeasible",
    "ShapeTask",
    "UnknownEngineError",
    "cost_model",
    "engine_names",
    "get_tuner",
    "moe_cost_model",
    "moe_engine_names",
    "moe_term",
]

# Each engine's tuner package (``TUNER``: its ``EngineTuner``), in search order.
TUNERS = Registry(
    "engine",
    {"triton": "fo_tune.engines.triton", "copy_engine": "fo_tune.engines.copy_engine"},
    error=UnknownEngineError,
)


def engine_names() -> tuple[str, ...]:
    """The registered engines' names, in search order."""
    return TUNERS.names()


@functools.cache
def get_tuner(name: str) -> EngineTuner:
    """The plug-in registered as ``name`` (one instance per process: plug-ins are stateless); an
    unknown name lists the valid ones."""
    return TUNERS.load(name, "TUNER")()


def cost_model(cal: Calibration) -> CostModel:
    """The cost model of ``cal`` with every registered engine's term (each made on first use)."""
    from fo_tune.model import CostModel

    return CostModel(cal, {name: get_tuner(name).term for name in engine_names()})


def cost_models_by_dtype(cal: Calibration, dtypes: Iterable[str]) -> dict[str, CostModel]:
    """A cost model per operand dtype, each on its own GEMM profile (``Calibration.for_dtype``:
    an fp8 row priced on the fp8 profile, not the calibration's bfloat16 one)."""
    return {d: cost_model(cal.for_dtype(d)) for d in sorted(set(dtypes))}


def moe_engine_names() -> tuple[str, ...]:
    """The registered engines with an MoE path, in search order."""
    from fo_kernels.moe.schedule import MOE_ENGINES

    return tuple(name for name in engine_names() if name in MOE_ENGINES)


def moe_term(name: str) -> type:
    """The MoE term class of engine ``name`` (its package's ``moe.MOE_TERM``)."""
    return TUNERS.load(name, "moe").MOE_TERM


def moe_cost_model(cal: Calibration) -> MoeCostModel:
    """The MoE cost model of ``cal`` with every MoE engine's term (each made on first use)."""
    from fo_tune.moe.model import MoeCostModel

    return MoeCostModel(cal, cost_model(cal), {name: moe_term(name) for name in moe_engine_names()})
