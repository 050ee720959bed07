"""How large a GEMM + collective problem may be on its target: checked before any work starts.

A shape is refused (``ProblemSizeError``, a ``ShapeError``: exit code 2 in the CLI) when

- M, N or K is above ``INT32_MAX``: the library GEMMs take int32 sizes (cuBLAS's m, n, k and
  leading dimensions are ``int``, and torch refuses larger ones), and the Triton GEMM's tile
  indices, signal units and group counters are int32 too;
- A (M x K), B (K x N) and the M x N output of one rank need more bytes than the target's memory:
  the local GPU's when the ranks run here (``torch.cuda.get_device_properties``), the host's
  physical memory shared by the ranks when they run on the CPU, and for an offline search the
  datasheet memory of the calibration's GPU (``DATASHEET_MEMORY_BYTES``; a GPU not listed there
  is checked against the int32 limit only);
- the dtype is float8_e4m3fn and N or K is not a multiple of ``FP8_ALIGN``: the fp8 ops refuse
  such a call (``ShapeError``), as torch._scaled_mm does, so no measurement or table row of it
  could run (``check_fp8_shapes``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from fo_kernels.errors import ShapeError
from fo_kernels.fingerprint import CPU_MAX_MACS, Fingerprint
from fo_kernels.scaling import FP8_ALIGN, FP8_DTYPE, fp8_aligned
from fo_kernels.schedule import dtype_name, torch_dtype

INT32_MAX = 2**31 - 1
# CPU_MAX_MACS as a cube's side, for messages ("give shapes up to 1024x1024x1024").
CPU_MAX_SIDE = round(CPU_MAX_MACS ** (1 / 3))
# Memory of the GPUs whose calibrations ship, for searches that plan for them offline (NVIDIA H200
# datasheet: 141 GB of HBM3e).
DATASHEET_MEMORY_BYTES = {"NVIDIA H200": 141 * 10**9}
GB = 1e9


class ProblemSizeError(ShapeError):
    """A shape whose operands or output cannot exist on the target; the message states the bound."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a problem runs: its memory per rank in bytes (None: unknown) and its name in messages."""

    memory_bytes: int | None
    name: str


def problem_bytes(m: int, n: int, k: int, dtype: str) -> int:
    """Bytes of A (M x K), B (K x N) and the M x N output of one rank in ``dtype``."""
    size = torch_dtype(dtype).itemsize
    return (m * k + k * n + m * n) * size


def host_target(world_size: int) -> Target:
    """This host's physical memory, shared by ``world_size`` CPU ranks (unknown off Linux)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return Target(None, "this host")
    return Target(total // max(1, world_size), f"this host's memory shared by {world_size} rank(s)")


def local_target(backend: str, world_size: int) -> Target:
    """The ranks' memory when they run here: GPU 0's (NCCL, one GPU per rank), else the host's."""
    if backend != "nccl":
        return host_target(world_size)
    import torch

    props = torch.cuda.get_device_properties(0)
    return Target(props.total_memory, f"{props.name} (GPU 0)")


def fingerprint_target(fp: Fingerprint) -> Target:
    """The memory of the machine a calibration describes: the datasheet's for its GPU; the host's
    for a CPU calibration."""
    if fp.compute_capability == "cpu":
        return host_target(fp.world_size)
    memory = DATASHEET_MEMORY_BYTES.get(fp.gpu_name)
    return Target(memory, f"{fp.gpu_name} (the calibration's GPU, datasheet)")


def check_fp8_shapes(shapes: Iterable[tuple[int, int, int]], dtype: str) -> None:
    """Raise ``ShapeError`` for the first fp8 shape whose N or K is not a multiple of
    ``FP8_ALIGN`` (nothing for other dtypes)."""
    if dtype != dtype_name(FP8_DTYPE):
        return
    for m, n, k in shapes:
        if not fp8_aligned(n, k):
            raise ShapeError(
                f"shape {m}x{n}x{k}: {dtype} needs N and K multiples of {FP8_ALIGN} (torch._scaled_mm's "
                "rule, which the fp8 ops enforce); choose another N and K"
            )


def check_problem_size(shapes: Iterable[tuple[int, int, int]], dtype: str, target: Target) -> None:
    """Raise ``ProblemSizeError`` for the first shape that breaks a size bound of the module
    docstring, ``ShapeError`` for an fp8 shape the fp8 ops refuse (``check_fp8_shapes``)."""
    shapes = list(shapes)
    check_fp8_shapes(shapes, dtype)
    for m, n, k in shapes:
        shape = f"{m}x{n}x{k}"
        for name, size in (("M", m), ("N", n), ("K", k)):
            if size > INT32_MAX:
                raise ProblemSizeError(
                    f"shape {shape}: {name} = {size} is above {INT32_MAX}, the largest size the GEMMs "
                    "take (int32: cuBLAS's m, n, k and the Triton GEMM's tile indices); give a smaller shape"
                )
        need = problem_bytes(m, n, k, dtype)
        if target.memory_bytes is not None and need > target.memory_bytes:
            raise ProblemSizeError(
                f"shape {shape}: A, B and the output of one rank need {need / GB:.1f} GB in {dtype}, "
                f"more than the {target.memory_bytes / GB:.1f} GB of {target.name}; give a smaller shape"
            )


def largest_for_the_interpreter(shapes: Iterable[tuple[int, int, int]]) -> tuple[int, int, int] | None:
    """The largest of ``shapes`` (by M x N x K) above ``CPU_MAX_MACS``, hours in Triton's CPU
    interpreter; None when every shape is within it. Each command words its own refusal."""
    big = [s for s in shapes if s[0] * s[1] * s[2] > CPU_MAX_MACS]
    return max(big, key=lambda s: s[0] * s[1] * s[2]) if big else None
