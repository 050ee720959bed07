"""What the cost model returns: one call's predicted latency, and the two baselines."""

from __future__ import annotations

from dataclasses import dataclass

_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
# The output dtype a table's rows are tuned for, by operand dtype: the operands' own, and for fp8
# operands the ops' default out_dtype (fo_kernels.scaling.DEFAULT_OUT_DTYPE; docs/design.md#fp8).
_TUNED_OUTPUT = {"float8_e4m3fn": "bfloat16"}


def element_bytes(dtype: str) -> int:
    """Bytes per element of a table dtype name: an operand's (what an AllGather moves)."""
    return _ELEM_BYTES[dtype]


def output_bytes(dtype: str) -> int:
    """Bytes per element of the output of ``dtype`` operands (what an AllReduce or a ReduceScatter
    moves): the operand's, bfloat16's for fp8."""
    return _ELEM_BYTES[_TUNED_OUTPUT.get(dtype, dtype)]


@dataclass(frozen=True, slots=True)
class Interference:
    """How the collective and the Triton GEMM affect each other at (sms_free, cap)."""

    concurrent: bool  # the collective ran beside the GEMM at all
    comm_slowdown: float
    gemm_slowdown: float
    matched: str  # "exact" or the nearest calibrated (sms_free, cap) used


@dataclass(frozen=True, slots=True)
class Prediction:
    """The model's view of one call (milliseconds). The per-group fields describe the Triton
    engine's NCCL chunks; the copy engine fills them with its pulls (``group_*``: one entry per
    copy, in issue order)."""

    total_ms: float  # what back-to-back calls cost each: max(device, host)
    device_ms: float
    host_ms: float
    gemm_alone_ms: float  # the GEMM work without any contention
    gemm_ms: float  # the GEMM work as the call runs it (contention, clock)
    engine: str = ""  # "" for overlap: false
    restore_ms: float = 0.0
    group_ready_ms: tuple[float, ...] = ()
    group_start_ms: tuple[float, ...] = ()
    group_end_ms: tuple[float, ...] = ()
    group_comm_ms: tuple[float, ...] = ()  # each group's transfer alone
    exposed_comm_ms: float = 0.0  # communication after the last GEMM ended
    interference: Interference | None = None
    gemm_source: str = ""  # "measured" (a profiled point), "wave-model", "library"


@dataclass(frozen=True, slots=True)
class Baseline:
    """GEMM then collective, predicted: eager (``sequential_ms``, what the bench's sequential
    variant runs) and as the runtime's ``overlap: false`` fallback replays it (``fallback_ms``)."""

    gemm_ms: float
    comm_ms: float
    sequential_ms: float
    fallback_ms: float
