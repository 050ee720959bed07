"""fp8 operands in the tuner's tasks: the scales that go with float8_e4m3fn operands, the library's
GEMM of any operands and their float32 reference.

A task that measures ``--dtype float8_e4m3fn`` draws its operands as every other dtype (random,
never zero: ``fo_tune.ranks.gemm.gemm_operands``, rounded to fp8) and gives them scales of one of
``SCALINGS`` (``TUNE_SCALING`` unless the task names another): rowwise scales are a function of
the row or column index alone, tensorwise ones two fixed numbers, so every rank and the reference
recompute them. None is 1 and the two operands' differ, so a path that drops a scale fails the
check. The runtime's call takes them as ``scale_a`` / ``scale_b`` (``scale_kwargs``); the library
GEMM is ``torch._scaled_mm`` (``fo_kernels.scaling.scaled_mm``); the output is bfloat16, the ops'
default ``out_dtype``, which the tables are tuned for (docs/design.md#fp8). Other dtypes get no
scales and ``a @ b``.
"""

from __future__ import annotations

from typing import Any

import torch

from fo_kernels.scaling import DEFAULT_OUT_DTYPE, Scales, check_scales, is_fp8, matmul

# How the tuner's fp8 operands are scaled: rowwise, the dearer epilogue (a scale per row and per
# column) and the common serving one (per-token activations, per-channel weights).
TUNE_SCALING = "rowwise"
# The scalings a task can measure, torch._scaled_mm's two (fo_kernels.scaling): rowwise, and
# tensorwise (one 0-dim scale each, the cheaper epilogue).
SCALINGS = ("rowwise", "tensorwise")
# Rowwise: the scales' values repeat over these many rows / columns, in steps of 1/8 from 1/2: exact
# in float32, different from 1 and from each other.
_ROW_CYCLE, _COL_CYCLE = 4, 3
# Tensorwise: scale_a and scale_b, exact in float32, different from 1 and from each other, so a path
# that drops either scale, or applies one of them twice, gives a wrong product.
_TENSOR_SCALE_A, _TENSOR_SCALE_B = 0.625, 0.75


def scale_kwargs(a: torch.Tensor, b: torch.Tensor, scaling: str = TUNE_SCALING) -> dict[str, Any]:
    """The ops' fp8 keyword arguments for ``a`` (M, K) and ``b`` (K, N), made once per operand pair:
    rowwise ``scale_a`` (M, 1) and ``scale_b`` (1, N), tensorwise both 0-dim; {} for other dtypes.
    ValueError for a scaling not in ``SCALINGS``."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling {scaling!r} is not one of {', '.join(SCALINGS)}")
    if not is_fp8(a.dtype):
        return {}
    if scaling == "tensorwise":
        return dict(
            scale_a=torch.tensor(_TENSOR_SCALE_A, device=a.device, dtype=torch.float32),
            scale_b=torch.tensor(_TENSOR_SCALE_B, device=a.device, dtype=torch.float32),
        )
    rows = torch.arange(a.shape[0], device=a.device, dtype=torch.float32)
    cols = torch.arange(b.shape[1], device=a.device, dtype=torch.float32)
    return dict(
        scale_a=(0.5 + (rows % _ROW_CYCLE) / 8).view(-1, 1),
        scale_b=(0.5 + (cols % _COL_CYCLE) / 8).view(1, -1),
    )


def scales_of(collective: str, a: torch.Tensor, b: torch.Tensor, kw: dict[str, Any]) -> Scales | None:
    """``kw``'s checked scales (``fo_kernels.scaling.Scales``), None without scales."""
    if not kw:
        return None
    return check_scales(collective, a, b, kw["scale_a"], kw["scale_b"], DEFAULT_OUT_DTYPE)


def library_mm(
    a: torch.Tensor, b: torch.Tensor, kw: dict[str, Any], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The library's GEMM of ``a`` and ``b``: cuBLAS ``a @ b``, or ``torch._scaled_mm`` with
    ``kw``'s scales (into ``out`` when given)."""
    return matmul(a, b, scales_of("all_reduce", a, b, kw), out)


def out_dtype(a: torch.Tensor) -> torch.dtype:
    """The dtype of a GEMM's output: ``a``'s, or bfloat16 for fp8 operands."""
    return DEFAULT_OUT_DTYPE if is_fp8(a.dtype) else a.dtype


def dequantized(a: torch.Tensor, b: torch.Tensor, kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` in float32, times their scales."""
    if not kw:
        return a.float(), b.float()
    return a.float() * kw["scale_a"], b.float() * kw["scale_b"]
