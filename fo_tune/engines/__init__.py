"""Engine plug-ins of the tuner, registered by the exact name of the runtime engine they tune.

    get_tuner("copy_engine").blocker(fingerprint, "all_reduce", "bfloat16")

Registered: ``triton`` (``fo_tune.engines.triton``: the signalled persistent Triton GEMM and NCCL
per group) and ``copy_engine`` (``fo_tune.engines.copy_engine``: library GEMM chunks and
copy-engine pulls between peers). Each module is imported on first use. An engine added to the
runtime (``fo_kernels.engines``) gets searched, predicted and calibrated by adding its plug-in
here (``fo_tune.engines.base.EngineTuner``); the strategies, the encoding and the model's
dispatch need no change. See ``base`` for the call order.
"""

from __future__ import annotations

import functools
import importlib

from fo_tune.engines.base import EngineTuner, Infeasible, ShapeTask, UnknownEngineError

__all__ = ["EngineTuner", "Infeasible", "ShapeTask", "UnknownEngineError", "engine_names", "get_tuner"]

# name -> "module:class" of the plug-in, imported on first use.
_REGISTRY: dict[str, str] = {
    "triton": "fo_tune.engines.triton:TritonTuner",
    "copy_engine": "fo_tune.engines.copy_engine:CopyEngineTuner",
}


def engine_names() -> tuple[str, ...]:
    """The registered engines' names, in search order."""
    return tuple(_REGISTRY)


@functools.cache
def get_tuner(name: str) -> EngineTuner:
    """The plug-in registered as ``name`` (one instance per process: plug-ins are stateless); an
    unknown name lists the valid ones."""
    where = _REGISTRY.get(name) if isinstance(name, str) else None
    if where is None:
        raise UnknownEngineError(f"engine {name!r} is not one of {', '.join(engine_names())}")
    module, cls = where.split(":")
    return getattr(importlib.import_module(module), cls)()
