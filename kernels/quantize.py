"""fp8 quantization for the tensor-parallel layers: a weight once, an activation per call.

A block x (a whole tensor, tensorwise; each row, rowwise) becomes float8_e4m3fn codes and the
float32 scale that ``torch._scaled_mm`` multiplies them back by:

    scale = max(amax(|x|), AMAX_FLOOR) / FP8_MAX        codes = round(x / scale) in float8_e4m3fn

so the block's largest magnitude maps to the largest finite fp8 value. A weight (N, K) in
``nn.Linear`` layout gives ``scale_b`` for ``b = weight.t()``: 0-dim tensorwise, (1, N) rowwise
(one per output feature). An activation (M, K) gives ``scale_a``: 0-dim or (M, 1). Where the ranks
must share one tensorwise scale (an AllGather's shards: ``fo_kernels.scaling``), ``shared=True``
takes the largest amax over ``group`` (one small all_reduce).

Beside them, the fp8 layers' pieces outside the scaled ops, shared by ``fo_kernels.layers`` and
``fo_kernels.parallel_fp8``: the local scaled GEMM of a replicated input, the autograd
functions whose backward refuses fp8 training, a call's fp8 operands, and the dtype-keeping cast.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from fo_kernels.errors import ScaleError, ShapeError
from fo_kernels.ops import fp8_input_meta, fp8_refused_grads
from fo_kernels.scaling import FP8_ALIGN, FP8_DTYPE, Scales, fp8_aligned, scaled_mm

# The largest finite float8_e4m3fn value (448).
FP8_MAX = torch.finfo(FP8_DTYPE).max
# An all-zero block's amax is taken as this, so its scale is not 0 (torchao's float8 EPS, 1e-12).
AMAX_FLOOR = 1e-12
SCALINGS = ("tensorwise", "rowwise")


def check_scaling(scaling: object) -> str:
    """``scaling`` when it is one of ``SCALINGS``, else ``ScaleError`` listing them."""
    if scaling not in SCALINGS:
        raise ScaleError(f"fp8: {scaling!r} is not one of {', '.join(SCALINGS)}")
    return scaling  # type: ignore[return-value]


def _codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows(
    x: torch.Tensor, scaling: str, *, shared: bool = False, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_a) of an (M, K) activation: scale_a 0-dim (tensorwise; ``shared``: one scale
    for every rank of ``group``) or (M, 1) (rowwise)."""
    mags = x.detach().abs().float()
    if check_scaling(scaling) == "rowwise":
        scale = mags.amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR) / FP8_MAX
        return _codes(x, scale), scale
    amax = mags.amax() if x.numel() else torch.zeros((), device=x.device)
    if shared:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax.clamp_min(AMAX_FLOOR) / FP8_MAX
    return _codes(x, scale), scale


def quantize_weight(
    weight: torch.Tensor,
    scaling: str,
    owner: str,
    *,
    shared: bool = False,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_b) of an (N, K) ``nn.Linear`` weight (shard), for ``b = codes.t()``: scale_b
    0-dim (tensorwise) or (1, N) (rowwise, one per output feature); ``shared``: the amax is the
    largest over ``group`` (one small all_reduce), so the scale is the full weight's when the
    shards split what one scale covers. ``ShapeError`` naming ``owner`` unless N and K are
    multiples of ``FP8_ALIGN`` (no fp8 GEMM takes such a weight); ``ScaleError`` for a weight with
    a non-finite value (its scale would be inf or NaN, and the codes of its block 0 or NaN)."""
    n, k = weight.shape
    if not fp8_aligned(n, k):
        raise ShapeError(
            f"{owner}: an fp8 weight shard needs its (out, in) = ({n}, {k}) multiples of {FP8_ALIGN} "
            "(torch._scaled_mm's rule)"
        )
    mags = weight.detach().abs().float()
    rowwise = check_scaling(scaling) == "rowwise"
    # (NaN as inf: the all_reduce's MAX carries it to every rank, so every rank raises alike)
    amax = mags.amax(dim=1, keepdim=True) if rowwise else mags.amax()
    amax = amax.nan_to_num(nan=math.inf, posinf=math.inf)
    # (a meta weight, a model built before its weights are loaded, has no values to share or check)
    if shared and not amax.is_meta:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    if not amax.is_meta and not bool(amax.isfinite().all()):
        raise ScaleError(f"{owner}: the weight to quantize to fp8 holds inf or NaN")
    scale = amax.clamp_min(AMAX_FLOOR) / FP8_MAX
    codes = _codes(weight.detach(), scale)
    return codes, (scale.t().contiguous() if rowwise else scale)


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) weight in ``dtype`` of fp8 ``codes`` and their ``scale_b`` (``quantize_weight``'s:
    0-dim, or (1, N) for ``b = codes.t()``)."""
    per_row = scale if scale.dim() == 0 else scale.reshape(-1, 1)
    return (codes.float() * per_row.float()).to(dtype)


class LocalScaledMatmul(torch.autograd.Function):
    """A column-parallel fp8 layer's local GEMM (its input is the same on every rank; the layers'
    and the styles', ``fo_kernels.parallel_fp8``): the scaled GEMM forward; training in fp8 is
    out of scope, so its backward raises."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, scales: Scales) -> torch.Tensor:
        ctx.input_meta = fp8_input_meta((a, b, scales))
        return scaled_mm(a, b, scales)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # (raises Fp8TrainingError when it runs; an op, so torch.compile can trace it: fo_kernels.ops)
        return fp8_refused_grads(dy, ctx.input_meta, ctx.needs_input_grad)


class Fp8Refused(torch.autograd.Function):
    """``a @ b`` (``add``: ``a + b``) of an fp8 layer outside its scaled ops: the GEMM of an input
    with no rows (``_ParallelLinear._empty_forward``), the bias added to the output
    (``linear_autograd.add_bias``); training in fp8 is out of scope, so its backward raises as
    ``LocalScaledMatmul``'s does."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, add: bool) -> torch.Tensor:
        ctx.input_meta = fp8_input_meta((a, b, add))
        return a + b if add else a @ b

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return fp8_refused_grads(dy, ctx.input_meta, ctx.needs_input_grad)


def fp8_operands(
    rows: torch.Tensor,
    scaling: str,
    weight_scale: torch.Tensor,
    *,
    shared: bool = False,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict]:
    """(codes, the op's fp8 keyword arguments) of a call's activation rows against a weight of
    ``weight_scale`` (``shared``: one tensorwise scale for every rank of ``group``, before an
    AllGather); the output in the rows' dtype (bfloat16, float16 or float32)."""
    codes, scale_a = quantize_rows(rows, scaling, shared=shared, group=group)
    return codes, dict(scale_a=scale_a, scale_b=weight_scale, out_dtype=rows.dtype)


def local_fp8_matmul(codes: torch.Tensor, w: torch.Tensor, fp8: dict, scaling: str) -> torch.Tensor:
    """The local scaled GEMM ``codes @ w`` of a replicated input, with ``fp8_operands``'s arguments."""
    scales = Scales(
        fp8["scale_a"].reshape(-1), fp8["scale_b"].reshape(-1), fp8["out_dtype"], scaling == "rowwise"
    )
    return LocalScaledMatmul.apply(codes, w, scales)


def keeping_dtypes(
    fn: Callable[[torch.Tensor], torch.Tensor], kept: tuple[torch.Tensor, ...]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn``, the function ``nn.Module._apply`` maps over a module's tensors (``to``, ``half``,
    ``cuda``...), but the tensors in ``kept`` (an fp8 weight's codes and its float32 scale) keep
    their dtypes: cast, the codes would become plain numbers without their scale and the scale
    lose precision; a device move still moves them."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if any(t is k for k in kept) and out.dtype != t.dtype:
            return t.to(device=out.device)
        return out

    return keep
