"""fp8 operands: ``torch._scaled_mm``'s scales on the three ops, checked before any collective.

With ``a`` and ``b`` of dtype ``torch.float8_e4m3fn`` an op computes, as ``torch._scaled_mm`` does,

    y = collective((a * scale_a) @ (b * scale_b))     products summed in float32, y in out_dtype

    tensorwise   scale_a, scale_b: 0-dim float32 tensors (one number each; any one-element
                 shape, (1,) or (1, 1), is taken as torch._scaled_mm takes it)
    rowwise      scale_a: (M, 1) float32, one per row of a; scale_b: (1, N), one per column of b
    out_dtype    bfloat16 (default), float16 or float32

``all_gather_gemm`` takes this rank's (M/w, K) shard of ``a`` and, rowwise, its (M/w, 1) rows of
``scale_a``; both are gathered (fp8 bytes on the wire). ``b`` is (K, N) row-major or the transposed
view of an (N, K) weight, as for the other dtypes; N and K must be multiples of ``FP8_ALIGN``.

``check_scales`` refuses what the ops cannot take, with a ``ScaleError`` (a ``ValueError``) naming
the problem, before any collective: scales or ``out_dtype`` on other operands, fp8 without scales,
wrong scale shapes or dtypes, mixed operand dtypes, another fp8 variant. ``Scales`` is the checked
form every path below the ops takes: the fallback's ``scaled_mm`` (the library GEMM), the Triton
engine's signalled GEMM (scales applied in the epilogue, ``fo_kernels.gemm``) and the copy engine's
chunk GEMMs. Forward only: a backward through an fp8 op raises ``Fp8TrainingError``
(``fo_kernels.ops``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fo_kernels.autocast import autocast_off
from fo_kernels.collectives import all_gather_now
from fo_kernels.errors import ScaleError, ShapeError

FP8_DTYPE = torch.float8_e4m3fn
# Every float8 dtype this torch knows; only FP8_DTYPE runs (the variant both operands of Hopper's
# fp8 tensor cores and of torch._scaled_mm take; e5m2 is for gradients, the fnuz ones for AMD).
_FP8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
FP8_VARIANTS = tuple(getattr(torch, name) for name in _FP8_NAMES if hasattr(torch, name))
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_OUT_DTYPE = torch.bfloat16
# N and K of an fp8 call must be multiples of this: torch._scaled_mm (cuBLASLt's fp8 GEMM) refuses
# other sizes, and 16 one-byte elements are the 16 bytes a TMA row stride must be a multiple of.
FP8_ALIGN = 16
# The kernels' SCALE constexpr (``fo_kernels.gemm``): none, one number each, a vector each.
SCALE_NONE, SCALE_TENSORWISE, SCALE_ROWWISE = 0, 1, 2


def fp8_aligned(n: int, k: int) -> bool:
    """Whether an fp8 GEMM of N output columns and depth K is one the fp8 ops (and
    ``torch._scaled_mm``) take: N and K multiples of ``FP8_ALIGN``."""
    return n % FP8_ALIGN == 0 and k % FP8_ALIGN == 0


def is_fp8(dtype: torch.dtype) -> bool:
    """True for any float8 dtype (the supported one or another variant)."""
    return dtype in FP8_VARIANTS


@dataclass(frozen=True, slots=True)
class Scales:
    """A call's checked scales: ``a`` (float32, contiguous; one element tensorwise, one per row of
    this call's A rowwise), ``b`` (one element, or one per column of B) and the output dtype."""

    a: torch.Tensor
    b: torch.Tensor
    out_dtype: torch.dtype
    rowwise: bool

    @property
    def mode(self) -> int:
        """The kernels' SCALE constexpr."""
        return SCALE_ROWWISE if self.rowwise else SCALE_TENSORWISE

    def scale_a(self) -> torch.Tensor:
        """``scale_a`` as torch._scaled_mm takes it: 0-dim, or (rows, 1)."""
        return self.a.view(-1, 1) if self.rowwise else self.a.view(())

    def scale_b(self) -> torch.Tensor:
        """``scale_b`` as torch._scaled_mm takes it: 0-dim, or (1, N)."""
        return self.b.view(1, -1) if self.rowwise else self.b.view(())

    def rows(self, r0: int, r1: int) -> Scales:
        """The scales of rows [r0, r1) of this call's A (tensorwise: the same scales)."""
        return dataclasses.replace(self, a=self.a[r0:r1]) if self.rowwise else self

    def with_rows(self, a: torch.Tensor) -> Scales:
        """These scales with ``a`` as A's (rowwise: the gathered rows' scales)."""
        return dataclasses.replace(self, a=a)


def scale_type_problem(scale_a: object, scale_b: object, out_dtype: object = None, a: object = None) -> str:
    """Why a call's scales or ``out_dtype`` are refused before its op is called ("" when they are
    not): a scale that is neither None nor a tensor (a Python number), or an ``out_dtype`` that is
    neither None nor a torch.dtype (a string), which the custom ops' schema would refuse with a
    ``RuntimeError`` before ``check_scales`` could name it. With fp8 operand ``a``, also a scale on
    another device: through the dispatcher a meta scale beside real operands would run the op's
    fake implementation, an output of uninitialized memory, in a compiled graph as eagerly. (A
    traced call refused here raises its ``ScaleError`` when the graph runs: ``fo_kernels.refusal``.)"""
    fp8 = isinstance(a, torch.Tensor) and is_fp8(a.dtype)
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale is not None and not isinstance(scale, torch.Tensor):
            return (
                f"{name} is a {type(scale).__name__}; scales are float32 tensors (0-dim tensorwise, "
                "or rowwise), as torch._scaled_mm's"
            )
        if fp8 and scale is not None and scale.device != a.device:
            return f"{name} is on {scale.device} but the operands are on {a.device}"
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        return (
            f"out_dtype is a {type(out_dtype).__name__} ({out_dtype!r}); pass a torch.dtype: "
            "torch.bfloat16, torch.float16 or torch.float32"
        )
    return ""


def _check_scale(name: str, scale: object, a: torch.Tensor) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        raise ScaleError(
            f"{name}: float8_e4m3fn operands need {name} as a float32 tensor (0-dim tensorwise, "
            f"or rowwise), got {type(scale).__name__}"
        )
    if scale.dtype != torch.float32:
        raise ScaleError(f"{name} is {scale.dtype}; scales must be float32 (as torch._scaled_mm's)")
    if scale.device != a.device:
        raise ScaleError(f"{name} is on {scale.device} but the operands are on {a.device}")
    return scale


def _check_shapes(
    collective: str, a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor
) -> bool:
    """True for rowwise scales, False for tensorwise (one element each, whatever its shape, as
    torch._scaled_mm's; a rowwise scale_b has N >= FP8_ALIGN elements, so none is one element);
    ``ScaleError`` for anything else."""
    if sa.numel() == 1 and sb.numel() == 1:
        return False
    rows, n = a.shape[0], b.shape[1]
    if tuple(sa.shape) == (rows, 1) and tuple(sb.shape) == (1, n):
        return True
    mine = " (this rank's rows of the gathered A)" if collective == "all_gather" else ""
    raise ScaleError(
        f"scale shapes: scale_a is {tuple(sa.shape)} and scale_b {tuple(sb.shape)}; tensorwise both "
        f"are 0-dim (one element), rowwise scale_a is (M, 1) = ({rows}, 1){mine} and scale_b "
        f"(1, N) = (1, {n})"
    )


def check_scales(
    collective: str,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> Scales | None:
    """The checked scales of a call (None for bf16/fp16/fp32 operands); see the module docstring.
    ``a`` and ``b`` are 2-D with matching K (checked before)."""
    if not is_fp8(a.dtype) and not is_fp8(b.dtype):
        if scale_a is not None or scale_b is not None:
            raise ScaleError(
                f"scale_a and scale_b are for float8_e4m3fn operands; a is {a.dtype} and b {b.dtype} "
                "(leave the scales out, or quantize both operands to float8_e4m3fn)"
            )
        if out_dtype is not None and out_dtype != a.dtype:
            raise ScaleError(
                f"out_dtype {out_dtype}: a call on {a.dtype} operands returns {a.dtype}; out_dtype is "
                "for float8_e4m3fn operands"
            )
        return None
    for name, t in (("a", a), ("b", b)):
        if is_fp8(t.dtype) and t.dtype != FP8_DTYPE:
            raise ScaleError(
                f"{name} is {t.dtype}, an fp8 variant fo-tune does not run; fp8 operands must both "
                "be torch.float8_e4m3fn (as torch._scaled_mm's on Hopper)"
            )
    if a.dtype != b.dtype:
        raise ScaleError(
            f"a is {a.dtype} but b is {b.dtype}: mixed operand dtypes; both must be float8_e4m3fn"
        )
    sa = _check_scale("scale_a", scale_a, a)
    sb = _check_scale("scale_b", scale_b, a)
    out = DEFAULT_OUT_DTYPE if out_dtype is None else out_dtype
    if out not in OUT_DTYPES:
        raise ScaleError(f"out_dtype {out_dtype} is not one of bfloat16, float16, float32")
    n, k = b.shape[1], a.shape[1]
    if not fp8_aligned(n, k):
        raise ShapeError(
            f"float8_e4m3fn operands need N and K multiples of {FP8_ALIGN} (torch._scaled_mm's and "
            f"the fp8 tensor cores' rule), got N={n}, K={k}"
        )
    rowwise = _check_shapes(collective, a, b, sa, sb)
    return Scales(a=_flat(sa), b=_flat(sb), out_dtype=out, rowwise=rowwise)


def _flat(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as a 1-D tensor of stride 1. ``contiguous()`` alone keeps a one-element view's
    stride (an ``expand`` of a 0-dim scale to (1, 1) has stride 0, which torch counts contiguous),
    and torch._scaled_mm refuses a rowwise scale whose last stride is not 1."""
    flat = scale.reshape(-1)
    return flat if flat.stride() == (1,) else flat.clone(memory_format=torch.contiguous_format)


def out_dtype_of(a: torch.Tensor, scales: Scales | None) -> torch.dtype:
    """The dtype of a call's output: the operands' dtype, or an fp8 call's ``out_dtype``."""
    return a.dtype if scales is None else scales.out_dtype


def wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the collectives move it: fp8 as its bytes (uint8; gloo has no fp8 type, and a
    gather is a copy), anything else as it is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def gather_scales(scales: Scales, world: int, group: dist.ProcessGroup | None) -> Scales:
    """The scales of the gathered A (rank r's rows at [r*Ms, (r+1)*Ms)): rowwise, every rank's rows
    of ``scale_a`` gathered; tensorwise the same scales (every rank's ``scale_a`` is the one the
    caller gave: the ranks must quantize their shards with one scale)."""
    if not scales.rowwise:
        return scales
    gathered = torch.empty(scales.a.shape[0] * world, dtype=torch.float32, device=scales.a.device)
    all_gather_now(gathered, scales.a, group)
    return scales.with_rows(gathered)


# cuBLASLt refused a rowwise-scaled fp8 product whose rows are not a multiple of 16
# (CUBLAS_STATUS_NOT_SUPPORTED at 43 rows: a copy-engine chunk, one H100, torch 2.11); such an A
# (and its scale rows) is padded to the next multiple.
ROWWISE_ROW_MULTIPLE = 16
# cuBLASLt's rowwise (outer-vector) scaling refuses a scale vector that does not start on a 16-byte
# boundary (CUBLAS_STATUS_NOT_SUPPORTED; measured on one H100, torch 2.11): a chunk's rows of a
# scale buffer start at any row, so such a slice is copied first.
SCALE_ALIGN_BYTES = 16


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scales: Scales, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The library's scaled GEMM, ``(a * scale_a) @ (b * scale_b)`` in ``scales.out_dtype``
    (``torch._scaled_mm``; into ``out`` when given). ``b`` is (K, N): torch._scaled_mm takes it
    column-major (the transposed view of an (N, K) weight); a row-major ``b`` is copied so.

    Rowwise scales with a float16 or float32 output run as the unscaled product in float32, then
    scaled and rounded: torch's CUDA rowwise kernels write bfloat16 only."""
    a = a.contiguous()
    if b.stride(0) != 1 or b.stride(1) < max(1, b.shape[0]):
        b = b.t().contiguous().t()
    rows = a.shape[0]
    pad = -rows % ROWWISE_ROW_MULTIPLE if scales.rowwise and a.is_cuda else 0
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    if scales.rowwise and scales.out_dtype != torch.bfloat16 and a.is_cuda:
        one = torch.ones((), dtype=torch.float32, device=a.device)
        y = _library_scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)[:rows]
        y.mul_(scales.scale_a()).mul_(scales.scale_b())
        if out is None:
            return y.to(scales.out_dtype)
        return out.copy_(y)
    scale_a, scale_b = scales.scale_a(), _aligned(scales.scale_b(), scales)
    if pad:  # (a new tensor, aligned as allocated)
        scale_a = torch.cat([scale_a, scale_a.new_ones(pad, 1)])
        y = _library_scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=scales.out_dtype)
        return y[:rows] if out is None else out.copy_(y[:rows])
    kw = dict(scale_a=_aligned(scale_a, scales), scale_b=scale_b, out_dtype=scales.out_dtype)
    if out is None:
        return _library_scaled_mm(a, b, **kw)
    return _library_scaled_mm(a, b, **kw, out=out)


def _library_scaled_mm(a: torch.Tensor, b: torch.Tensor, **kw: object) -> torch.Tensor:
    """``torch._scaled_mm(a, b, **kw)`` with autocast off (``fo_kernels.autocast``): a call's output
    dtype is its ``out_dtype``, whatever the caller's autocast region. Inside
    ``torch.autocast("cpu")`` torch's CPU rowwise ``_scaled_mm`` runs ops that autocast lowers: a
    float32-out product would be rounded to bfloat16 (2.6e-3 relative against float64, where
    float32's is 1e-7)."""
    with autocast_off(a.device.type):
        return torch._scaled_mm(a, b, **kw)


def _aligned(scale: torch.Tensor, scales: Scales) -> torch.Tensor:
    """``scale``, or its copy where rowwise scaling on a GPU needs it to start on
    ``SCALE_ALIGN_BYTES`` (read from its offset into its storage, whose start the allocator
    aligns, so a traced call decides it too)."""
    if not (scales.rowwise and scale.is_cuda):
        return scale
    return scale.clone() if scale.storage_offset() * scale.element_size() % SCALE_ALIGN_BYTES else scale


def matmul(
    a: torch.Tensor, b: torch.Tensor, scales: Scales | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b`` (into ``out`` when given), scaled as ``scaled_mm`` for an fp8 call. The product is
    in the operands' dtype whatever the caller's ``torch.autocast`` region: autocast does not cast
    a custom op's arguments, so the op's output is its operands' dtype (its fake implementation's,
    a compiled call's and a Triton engine call's), and autocast would lower a float32 product to
    bfloat16 here (3e-3 relative against float64, where float32's is 1e-7)."""
    if scales is not None:
        return scaled_mm(a, b, scales, out)
    with autocast_off(a.device.type):
        return _dense_mm(a, b, out)


def _dense_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``a @ b``, into ``out`` when given."""
    if out is None:
        return a @ b
    return torch.matmul(a, b, out=out)
