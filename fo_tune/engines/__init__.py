"""Engine plug-ins of the tuner, registered by the exact name of the runtime engine they tune.

    get_tuner("copy_engine").blocker(fingerprint, "all_reduce", "bfloat16")

Registered, one package each: ``triton`` (``fo_tune.engines.triton``: the signalled persistent
Triton GEMM and NCCL per group) and ``copy_engine`` (``fo_tune.engines.copy_engine``: library GEMM
chunks and copy-engine pulls between peers). Each package is imported on first use. An engine
added to the runtime (``fo_kernels.engines``) gets searched, predicted and calibrated by a package
here whose ``TUNER`` is its ``fo_tune.engines.base.EngineTuner`` and one line in ``TUNERS``; the
strategies, the encoding and the model need no change (``cost_model`` hands the model every
engine's term). See ``base`` for the call order.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from fo_kernels.registry import Registry
from fo_tune.engines.base import EngineTuner, Infeasible, ShapeTask, UnknownEngineError

if TYPE_CHECKING:
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.model import CostModel

__all__ = [
    "TUNERS",
    "EngineTuner",
    "Infeasible",
    "ShapeTask",
    "UnknownEngineError",
    "cost_model",
    "engine_names",
    "get_tuner",
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
