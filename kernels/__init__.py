"""fo_kernels: the fo-tune runtime (source in ``kernels/``, imported as ``fo_kernels``).

Tile-wise overlap of a GEMM with its collective, driven by YAML schedule tables. Depends only on
torch, triton and pyyaml (cuda-bindings optional); it never imports the tuner ``fo_tune``.
"""

from .errors import (
    EnvironmentMismatchError,
    FoTuneError,
    HeuristicScheduleWarning,
    ScheduleError,
    ShapeError,
    TableError,
    TableNotFoundError,
    VersionDriftWarning,
)
from .fingerprint import Fingerprint, current_fingerprint
from .module import RowParallelLinear
from .overlap import gemm_all_reduce, gemm_reduce_scatter
from .runtime import OverlapRuntime
from .schedule import Problem, Schedule, Tile
from .table import ScheduleTable, load_table, lookup_schedule, save_table

__all__ = [
    "EnvironmentMismatchError",
    "Fingerprint",
    "FoTuneError",
    "HeuristicScheduleWarning",
    "OverlapRuntime",
    "Problem",
    "RowParallelLinear",
    "Schedule",
    "ScheduleError",
    "ScheduleTable",
    "ShapeError",
    "TableError",
    "TableNotFoundError",
    "Tile",
    "VersionDriftWarning",
    "current_fingerprint",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "load_table",
    "lookup_schedule",
    "save_table",
]
__version__ = "0.1.0"
