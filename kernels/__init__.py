"""fo_kernels: the fo-tune runtime (source in ``kernels/``, imported as ``fo_kernels``).

Tile-wise overlap of a GEMM with its collective (GEMM + AllReduce, GEMM + ReduceScatter, AllGather
+ GEMM) and of MoE experts with their All-to-All (``expert_parallel_ffn``), driven by YAML
schedule tables; the ops are torch.library custom ops with autograd (``torch.ops.fo_kernels.*``),
and tensor-parallel layers build on them: torch's ``parallelize_module`` styles
(``fo_kernels.parallel``), torch's fused-op signatures (``fo_kernels.symm_mem``) and the
plain-tensor layers (``fo_kernels.layers``). Depends only on torch, triton and pyyaml
(cuda-bindings optional); it never imports the tuner ``fo_tune``.

The public names below load their module on first use (PEP 562), so ``import fo_kernels.errors``
or ``fo_kernels.Schedule`` does not define the Triton kernels: Triton decides at that moment
whether they run compiled or in its CPU interpreter (TRITON_INTERPRET), and a process may need to
set that after importing the error types.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed

if torch.distributed.is_available():
    # torch.distributed.nn.functional binds ``group.WORLD`` as its functions' default ``group`` when
    # it is imported, and torch._dynamo imports it (the ops' module imports torch._dynamo): imported
    # first after init_process_group, it would keep the default group past
    # dist.destroy_process_group() into the interpreter's teardown (``runtime._release_at_exit``
    # says what that costs a gloo rank). Imported with fo_kernels, before the caller's group
    # exists, it binds None.
    import torch.distributed.nn

_EXPORTS = {
    "EnvironmentMismatchError": "errors",
    "FoTuneError": "errors",
    "Fp8TrainingError": "errors",
    "DoubleBackwardError": "errors",
    "ScaleError": "errors",
    "DeviceLimitError": "errors",
    "HeuristicScheduleWarning": "errors",
    "ScheduleError": "errors",
    "ShapeError": "errors",
    "TableError": "errors",
    "TableNotFoundError": "errors",
    "TableDirWarning": "errors",
    "VersionDriftWarning": "errors",
    "Fingerprint": "fingerprint",
    "current_fingerprint": "fingerprint",
    "GroupError": "errors",
    "PlanError": "errors",
    "AlreadyParallelizedError": "errors",
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "parallelize_linears": "parallel",
    "NotOverlappedWarning": "errors",
    "TileStagesWarning": "errors",
    "ArgumentError": "errors",
    "SignatureError": "errors",
    "NotInitializedError": "errors",
    "all_gather_gemm": "overlap",
    "gemm_all_reduce": "overlap",
    "gemm_reduce_scatter": "overlap",
    "expert_parallel_ffn": "moe.ffn",
    "ExpertParallelExperts": "moe.module",
    "parallelize_experts": "moe.module",
    "MoeProblem": "moe.schedule",
    "MoeSchedule": "moe.schedule",
    "MoeRow": "moe.table",
    "MoeTable": "moe.table",
    "load_moe_table": "moe.table",
    "save_moe_table": "moe.table",
    "OverlapRuntime": "runtime",
    "release_group": "runtime",
    "CopyEngineSettings": "engines.copy_engine.settings",
    "EngineSettings": "schedule",
    "Problem": "schedule",
    "Schedule": "schedule",
    "Tile": "tile",
    "TritonSettings": "engines.triton.settings",
    "Engine": "engines",
    "get_engine": "engines",
    "ScheduleTable": "table",
    "load_table": "table",
    "lookup_schedule": "table",
    "save_table": "table",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fo_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
