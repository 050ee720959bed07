"""How the signalled GEMM's kernels take their operands: A, B, the destination and the build.

    A       row-major (M, K)
    B       row-major (K, N), or the transposed view of a contiguous (N, K) weight (``BOperand``)
    loads   TMA descriptors where the device has TMA (Hopper, or the interpreter's emulation) and
            every leading stride and base address is 16-byte aligned; masked pointer loads else,
            so any M, N, K works
    out     row_band: the (M, N) rows of the plan's layout; tile_major: one BM x BN slot a tile;
            rows: the copy engine's plain row-major destination (``rows_gemm``)
    fp8     A and B in float8_e4m3fn, their scales (``fo_kernels.scaling.Scales``) as two float32
            vectors the epilogue reads (``scale_args``, the SCALE constexpr); the output in the
            call's ``out_dtype``. Triton's CPU interpreter loads fp8 and runs ``tl.dot`` on fp8
            blocks correctly (within float32 rounding of the float64 product, Triton 3.7.1), so
            the interpreter runs the same fp8 kernels as a GPU: no upcast, unlike bf16

The whole waves' launcher (``fo_kernels.gemm.waves``), the tail (``.tail``), the rows GEMM
(``.rows``) and the ping-pong kernel (``.pingpong``) import this module and it imports none of
them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton.language as tl

from fo_kernels.plan import Plan
from fo_kernels.scaling import SCALE_NONE, Scales
from fo_kernels.tile import Tile

# TMA needs every stride but the last and the base address 16-byte aligned (CUDA driver API,
# cuTensorMapEncodeTiled).
TMA_ALIGN_BYTES = 16
# Hopper is the first architecture with TMA (compute capability 9.0).
TMA_MIN_CAPABILITY = 9
# The kernels' LAYOUT constexpr.
LAYOUT_ROW_BAND = 0
LAYOUT_TILE_MAJOR = 1
# The copy engine's tiled mode (``rows_gemm``): a plain row-major destination, one group per run of
# whole tile rows (``unit_group`` indexed by tile row), optionally adding what is already there.
LAYOUT_ROWS = 2
# The narrowest epilogue piece: tl.dot and the store layouts want >= 16 columns (as MIN_BLOCK).
MIN_PIECE = 16
# The epilogue stores a tile in this many column pieces (fewer where a piece would be narrower than
# MIN_PIECE): each piece needs half the registers a whole tile's store conversion does. One, two
# and four pieces read within the timing's noise of each other at full grid on one H200 (128x256
# tiles, six shapes; docs/perf-notes.md, "The signalled GEMM at cuBLAS speed (one H200)").
EPILOGUE_PIECES = 2
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def interpreting() -> bool:
    """True under the Triton CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True, slots=True)
class BOperand:
    """How B is passed: row-major (K, N), or the transposed view of a contiguous (N, K) weight."""

    tensor: torch.Tensor  # the (K, N) view the caller gave
    kmajor: bool  # True when the storage is (N, K) row-major (an nn.Linear weight)

    @classmethod
    def of(cls, b: torch.Tensor) -> BOperand | None:
        if b.stride(1) == 1 and b.stride(0) >= max(1, b.shape[1]):
            return cls(b, False)
        if b.stride(0) == 1 and b.stride(1) >= max(1, b.shape[0]):
            return cls(b, True)
        return None


def _aligned(t: torch.Tensor, lead_stride: int) -> bool:
    e = t.element_size()
    return t.data_ptr() % TMA_ALIGN_BYTES == 0 and (lead_stride * e) % TMA_ALIGN_BYTES == 0


@functools.cache
def cuda_major(index: int) -> int:
    """The compute capability's major number of CUDA device ``index`` (fixed for the process; asked
    once, since ``torch.cuda.get_device_capability`` costs microseconds on every launch)."""
    return torch.cuda.get_device_capability(index)[0]


def _has_tma(t: torch.Tensor) -> bool:
    """``t``'s device runs TMA: a Hopper or later GPU, or the interpreter, which emulates it."""
    if t.is_cuda:
        return cuda_major(t.device.index) >= TMA_MIN_CAPABILITY
    return interpreting()


def tma_usable(a: torch.Tensor, b: BOperand) -> bool:
    """TMA loads need a Hopper GPU (or the interpreter, which emulates them) and aligned strides."""
    if not _has_tma(a):
        return False
    b_lead = b.tensor.stride(1) if b.kmajor else b.tensor.stride(0)
    return _aligned(a, a.stride(0)) and _aligned(b.tensor, b_lead)


def store_view(out: torch.Tensor, plan: Plan, tile: Tile) -> torch.Tensor | None:
    """The 2-D view of the destination a TMA store descriptor covers, or None where there is none.

    tile_major: the buffer as (tiles x BLOCK_M, BLOCK_N). row_band: the output as (M, N), which
    needs N's rows 16-byte aligned and, with several shards, whole tile rows per shard (a TMA
    store clips only at the tensor's edge, not at a shard's)."""
    if plan.layout == "tile_major":
        view = out[: plan.num_tiles * tile.block_m * tile.block_n].view(-1, tile.block_n)
    elif plan.shards == 1 or plan.rows_per_shard % tile.block_m == 0:
        view = out[: plan.m * plan.n].view(plan.m, plan.n)
    else:
        return None
    return view if _aligned(view, view.stride(0)) else None


def layout_code(plan: Plan) -> int:
    """The kernels' LAYOUT constexpr of the plan's layout."""
    return LAYOUT_TILE_MAJOR if plan.layout == "tile_major" else LAYOUT_ROW_BAND


def operand_args(a: torch.Tensor, b: BOperand, tile: Tile, use_tma: bool | None) -> tuple:
    """(a, b kernel arguments, USE_TMA): TMA descriptors of the tile's blocks where usable (or
    ``use_tma`` says so), else the tensors."""
    if use_tma is None:
        use_tma = tma_usable(a, b)
    if not use_tma:
        return a, b.tensor, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_arg = TensorDescriptor.from_tensor(a, [tile.block_m, tile.block_k])
    if b.kmajor:
        b_arg = TensorDescriptor.from_tensor(b.tensor.t(), [tile.block_n, tile.block_k])
    else:
        b_arg = TensorDescriptor.from_tensor(b.tensor, [tile.block_k, tile.block_n])
    return a_arg, b_arg, True


def strides(a: torch.Tensor, b: BOperand) -> tuple[int, int, int, int]:
    """(stride_am, stride_ak, stride_bk, stride_bn): the masked-pointer loads' strides."""
    return a.stride(0), a.stride(1), b.tensor.stride(0), b.tensor.stride(1)


def epilogue_pieces(tile: Tile) -> int:
    """The SUBTILE constexpr: ``EPILOGUE_PIECES`` column pieces, one where they would be too narrow."""
    return min(EPILOGUE_PIECES, tile.block_n // MIN_PIECE)


def scale_args(scales: Scales | None, unread: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' (scale_a, scale_b) arguments: an fp8 call's scale vectors, else ``unread`` twice
    (SCALE 0: never read)."""
    if scales is None:
        return unread, unread
    return scales.a, scales.b


def kernel_meta(
    a: torch.Tensor,
    b: BOperand,
    out: torch.Tensor,
    tile: Tile,
    use_tma: bool,
    scales: Scales | None = None,
) -> Mapping[str, object]:
    """The compile-time arguments every plain kernel takes (operands, dtypes, tile, launch, the
    SCALE mode of an fp8 call's scales)."""
    scale = SCALE_NONE if scales is None else scales.mode
    return _meta_of(a.dtype, out.dtype, b.kmajor, tile, use_tma, interpreting(), scale)


@functools.lru_cache(maxsize=256)
def _meta_of(
    a_dtype: torch.dtype,
    out_dtype: torch.dtype,
    kmajor: bool,
    tile: Tile,
    use_tma: bool,
    interp: bool,
    scale: int,
) -> Mapping[str, object]:
    """``kernel_meta``'s mapping, built once per distinct launch (read-only: every launch shares it;
    building it per call cost 12% of a launch's host time on one H200, docs/perf-notes.md, "Host
    time")."""
    upcast = interp and a_dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    return MappingProxyType(
        dict(
            USE_TMA=use_tma,
            B_KMAJOR=kmajor,
            OUT_DTYPE=_TL_DTYPES[out_dtype],
            UPCAST=upcast,
            IEEE=upcast or a_dtype == torch.float32,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            GROUP_M=tile.group_m,
            PTX=not interp,  # inline PTX (the CTA barrier) in compiled kernels only
            SCALE=scale,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
    )
