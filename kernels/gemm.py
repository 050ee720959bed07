"""The signalled persistent GEMM and the tile-major restore, in Triton.

Math: C = A @ B with A (M, K), B (K, N) (row-major, or the transposed view of an (N, K) weight),
bf16/fp16/fp32 in, fp32 accumulation, output in the input dtype.

Protocol, per persistent program p of G (symbols as in ``fo_kernels.plan``):

    for t in p, p + G, p + 2G, ... < T:             # wave w = tiles [wG, (w+1)G)
        l, s = t // S, t % S                         # local tile position, shard
        tm, tn = grouped_swizzle(l)                  # GROUP_M tile rows per band
        acc = sum_k A[s*Ms + tm*BM : +BM, k] @ B[k, tn*BN : +BN]
        g = unit_group[t // U]                       # group of the tile's signal unit
        store acc at its layout position in group g's chunk
        barrier (all threads' stores issued); atomic_add(counter[g], 1, release, gpu scope)

The release increment is cumulative over the CTA barrier, so a reader that observes the counter at
its target (``cuStreamWaitValue32`` or the spin kernel, which acquire) sees every element of the
group's tiles. Stores are plain ``tl.store`` (not TMA stores, which are asynchronous and not ordered
by the release; ``../shared/DESIGN.md``). Loads use TMA descriptors where the strides allow it
(16-byte aligned) and masked pointer loads otherwise, so any M, N, K works.

Counters are never reset: each call's targets are the running totals the host keeps (see
``fo_kernels.runtime``), and every comparison is wrap-around safe in int32.

``rows_gemm`` runs the same kernel for the copy engine's tiled mode (``LAYOUT_ROWS``): one shard,
a plain row-major destination, groups of whole tile rows, optionally waiting per group for a flag
and adding what the copy engine put in the destination (the counters there are reset by their
reader each call).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .plan import Plan
from .schedule import Tile

# TMA needs every stride but the last and the base address 16-byte aligned (CUDA driver API,
# cuTensorMapEncodeTiled).
TMA_ALIGN_BYTES = 16
# Hopper is the first architecture with TMA (compute capability 9.0).
TMA_MIN_CAPABILITY = 9
LAYOUT_ROW_BAND = 0
LAYOUT_TILE_MAJOR = 1
# The copy engine's tiled mode (``rows_gemm``): a plain row-major destination, one group per run of
# whole tile rows (``unit_group`` indexed by tile row), optionally adding what is already there.
LAYOUT_ROWS = 2
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def interpreting() -> bool:
    """True under the Triton CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _tile_coords(l, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped swizzle: local tile position l -> (tile row, tile column)."""
    per_band = GROUP_M * tiles_n
    first = (l // per_band) * GROUP_M
    rows_in_band = tl.minimum(tiles_m - first, GROUP_M)
    tm = first + (l % per_band) % rows_in_band
    tn = (l % per_band) // rows_in_band
    return tm, tn


@triton.jit
def _mma(a_blk, b_blk, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a_blk @ b_blk`` in float32: upcast first under the interpreter (its bf16 ``tl.dot``
    is wrong), IEEE precision when the inputs are (or were upcast to) float32 (no TF32)."""
    if UPCAST:
        a_blk = a_blk.to(tl.float32)
        b_blk = b_blk.to(tl.float32)
    if IEEE:
        return tl.dot(a_blk, b_blk, acc, input_precision="ieee")
    return tl.dot(a_blk, b_blk, acc)


@triton.jit
def _tile_acc(
    a, b, row0, col0, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    """One output tile's float32 sum: A[row0 : row0 + BLOCK_M, :] @ B[:, col0 : col0 + BLOCK_N]
    (TMA descriptor loads, or masked pointer loads; rows past M and columns past N read padding)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for kk in tl.range(k_tiles, warp_specialize=WARP_SPECIALIZE):
            a_blk = a.load([row0, kk * BLOCK_K])
            if B_KMAJOR:
                b_blk = b.load([col0, kk * BLOCK_K]).T
            else:
                b_blk = b.load([kk * BLOCK_K, col0])
            acc = _mma(a_blk, b_blk, acc, UPCAST, IEEE)
    else:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        offs_m = tl.where(offs_m < M, offs_m, 0)  # rows past M only feed padding, never stored
        offs_n = tl.where(offs_n < N, offs_n, 0)
        for kk in range(k_tiles):
            offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
            a_blk = tl.load(
                a + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                mask=offs_k[None, :] < K,
                other=0.0,
            )
            b_blk = tl.load(
                b + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=offs_k[:, None] < K,
                other=0.0,
            )
            acc = _mma(a_blk, b_blk, acc, UPCAST, IEEE)
    return acc


@triton.jit
def _downcast(acc, OUT_DTYPE: tl.constexpr):
    """A float32 tile in the output dtype, rounded to nearest even."""
    if tl.float32 == OUT_DTYPE:
        return acc
    return acc.to(OUT_DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def _signalled_gemm_kernel(
    a,
    b,
    out,
    counters,
    unit_group,
    group_info,  # tensors (a, b: or TMA descriptors)
    M,
    N,
    K,
    rows_per_shard,
    tiles_m,
    tiles_n,
    num_tiles,
    shards,
    unit_tiles,  # sizes
    ready,
    out2,  # LAYOUT_ROWS only: the ready flags ACCUMULATE waits on, a second destination (COPY)
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,  # strides
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    LAYOUT: tl.constexpr,
    SIGNAL: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    ACCUMULATE: tl.constexpr = False,
    COPY: tl.constexpr = False,
    SYS_SIGNAL: tl.constexpr = False,  # the counters are in the peer GPU's memory (system scope)
):
    pid = tl.program_id(0)
    for t in range(pid, num_tiles, tl.num_programs(0)):
        l = t // shards
        s = t % shards
        tm, tn = _tile_coords(l, tiles_m, tiles_n, GROUP_M)
        row0 = s * rows_per_shard + tm * BLOCK_M  # first row of A (global)
        col0 = tn * BLOCK_N
        acc = _tile_acc(
            a, b, row0, col0, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE, WARP_SPECIALIZE,
        )  # fmt: skip

        ii = tl.arange(0, BLOCK_M)
        jj = tl.arange(0, BLOCK_N)
        if LAYOUT == 2:  # LAYOUT_ROWS: row-major (rows_per_shard, N) at ``out``, groups of whole tile rows
            g = tl.load(unit_group + tm)
            local_row = tm * BLOCK_M + ii
            cols = col0 + jj
            mask = (local_row[:, None] < rows_per_shard) & (cols[None, :] < N)
            offs = local_row.to(tl.int64)[:, None] * N + cols[None, :]
            if ACCUMULATE:  # add what the copy engine put there: wait until its group has landed
                seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="sys")
                while seen == 0:
                    seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="sys")
                prev = tl.load(out + offs, mask=mask, other=0.0, cache_modifier=".cg")
                acc += prev.to(tl.float32)
            c = _downcast(acc, OUT_DTYPE)
            tl.store(out + offs, c, mask=mask)
            if COPY:
                tl.store(out2 + offs, c, mask=mask)
        else:
            c = _downcast(acc, OUT_DTYPE)
            g = tl.load(unit_group + t // unit_tiles)
            base = tl.load(group_info + 2 * g)  # a0 of the group (local tile or shard-local row)
            span = tl.load(group_info + 2 * g + 1)  # a1 - a0
            if LAYOUT == 1:  # tile_major: the whole padded tile as one contiguous slot
                slot = (shards * base + s * span + (l - base)).to(tl.int64)
                ptrs = out + slot * (BLOCK_M * BLOCK_N) + ii[:, None] * BLOCK_N + jj[None, :]
                tl.store(ptrs, c)
            else:  # row_band: rows of the group's chunk, shard-major
                local_row = tm * BLOCK_M + ii
                phys_row = (shards * base + s * span + (local_row - base)).to(tl.int64)
                cols = col0 + jj
                mask = (local_row[:, None] < rows_per_shard) & (cols[None, :] < N)
                tl.store(out + phys_row[:, None] * N + cols[None, :], c, mask=mask)
        if SIGNAL:
            tl.debug_barrier()
            if SYS_SIGNAL:
                tl.atomic_add(counters + g, 1, sem="release", scope="sys")
            else:
                tl.atomic_add(counters + g, 1, sem="release", scope="gpu")


@triton.jit
def _restore_kernel(
    src,
    dst,  # tile-major slots in local order, row-major (rows, N) output
    rows,
    N,
    tiles_m,
    tiles_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    l = tl.program_id(0)
    tm, tn = _tile_coords(l, tiles_m, tiles_n, GROUP_M)
    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    blk = tl.load(src + l.to(tl.int64) * (BLOCK_M * BLOCK_N) + ii[:, None] * BLOCK_N + jj[None, :])
    r = tm * BLOCK_M + ii
    c = tn * BLOCK_N + jj
    mask = (r[:, None] < rows) & (c[None, :] < N)
    tl.store(dst + r.to(tl.int64)[:, None] * N + c[None, :], blk, mask=mask)


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


def tma_usable(a: torch.Tensor, b: BOperand) -> bool:
    """TMA loads need a Hopper GPU (or the interpreter, which emulates them) and aligned strides."""
    if a.is_cuda and torch.cuda.get_device_capability(a.device)[0] < TMA_MIN_CAPABILITY:
        return False
    if not a.is_cuda and not interpreting():
        return False
    b_lead = b.tensor.stride(1) if b.kmajor else b.tensor.stride(0)
    return _aligned(a, a.stride(0)) and _aligned(b.tensor, b_lead)


def _operand_args(a: torch.Tensor, b: BOperand, tile: Tile, use_tma: bool | None) -> tuple:
    """(a, b kernel arguments, USE_TMA): TMA descriptors where usable, else the tensors."""
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


def _strides(a: torch.Tensor, b: BOperand) -> tuple[int, int, int, int]:
    return a.stride(0), a.stride(1), b.tensor.stride(0), b.tensor.stride(1)


def _meta(a: torch.Tensor, b: BOperand, out: torch.Tensor, tile: Tile, use_tma: bool) -> dict:
    """The kernels' compile-time arguments the launchers share (operands, dtypes, tile)."""
    upcast = interpreting() and a.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    return dict(
        USE_TMA=use_tma,
        B_KMAJOR=b.kmajor,
        OUT_DTYPE=_TL_DTYPES[out.dtype],
        UPCAST=upcast,
        IEEE=upcast or a.dtype == torch.float32,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m,
        WARP_SPECIALIZE=tile.warp_specialize,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def signalled_gemm(
    a: torch.Tensor,
    b: BOperand,
    out: torch.Tensor,
    plan: Plan,
    tile: Tile,
    *,
    counters: torch.Tensor,
    unit_group: torch.Tensor,
    group_info: torch.Tensor,
    signal: bool = True,
    use_tma: bool | None = None,
) -> None:
    """Launch the persistent GEMM on the current stream, writing ``out`` in the plan's layout.

    ``a`` must be row-major (M, K); ``out`` a flat buffer of ``plan.buffer_numel()`` elements.
    ``unit_group`` (int32, one per signal unit) and ``group_info`` (int32, (a0, a1 - a0) per group)
    are the plan's tables on the device; ``counters`` (int32) gets one release increment per tile
    at index ``unit_group[t // U]`` when ``signal`` is set.
    """
    m, k = a.shape
    n = b.tensor.shape[1]
    a_arg, b_arg, use_tma = _operand_args(a, b, tile, use_tma)
    _signalled_gemm_kernel[(plan.grid,)](
        a_arg,
        b_arg,
        out,
        counters,
        unit_group,
        group_info,
        m,
        n,
        k,
        plan.rows_per_shard,
        plan.tiles_m,
        plan.tiles_n,
        plan.num_tiles,
        plan.shards,
        plan.unit_tiles,
        counters,  # ready: unused outside LAYOUT_ROWS
        out,  # out2: likewise
        *_strides(a, b),
        LAYOUT=LAYOUT_TILE_MAJOR if plan.layout == "tile_major" else LAYOUT_ROW_BAND,
        SIGNAL=signal,
        **_meta(a, b, out, tile, use_tma),
    )


def rows_gemm(
    a: torch.Tensor,
    b: BOperand,
    out: torch.Tensor,
    tile: Tile,
    *,
    grid: int,
    row_group: torch.Tensor,
    counters: torch.Tensor | None = None,
    ready: torch.Tensor | None = None,
    out2: torch.Tensor | None = None,
    use_tma: bool | None = None,
    remote_counters: bool = False,
) -> None:
    """``out = a @ b`` (or ``out += a @ b`` once ready, see ``ready``) by the persistent kernel on
    the current stream, for the copy engine's tiled mode (``fo_kernels.copy_engine``).

    ``a`` is row-major (rows, K); ``out`` (and ``out2``) are row-major (rows, N) with row stride N.
    ``row_group`` (int32, one per tile row of ``BLOCK_M`` rows) gives each tile row its group.
    ``counters``: each tile adds 1 (release) to ``counters[group]`` once its stores are issued.
    ``ready``: each tile first waits until ``ready[group]`` is nonzero (acquire, system scope: a
    flag the copy engine's stream sets after its copy into ``out``), then adds ``out``'s tile to its
    sum in float32. ``out2``: the result is stored there too (it may be the peer GPU's memory).
    ``remote_counters``: ``counters`` are in the peer's memory (release at system scope, so the
    stores before it, ``out2``'s too, land first). The grid must not exceed the SMs (every program
    must be resident while others wait on ``ready``).
    """
    rows, k = a.shape
    n = b.tensor.shape[1]
    tiles_m, tiles_n = -(-rows // tile.block_m), -(-n // tile.block_n)
    a_arg, b_arg, use_tma = _operand_args(a, b, tile, use_tma)
    _signalled_gemm_kernel[(max(1, min(grid, tiles_m * tiles_n)),)](
        a_arg,
        b_arg,
        out,
        counters if counters is not None else row_group,
        row_group,
        row_group,  # group_info: unused by LAYOUT_ROWS
        rows,
        n,
        k,
        rows,
        tiles_m,
        tiles_n,
        tiles_m * tiles_n,
        1,
        1,
        ready if ready is not None else row_group,
        out2 if out2 is not None else out,
        *_strides(a, b),
        LAYOUT=LAYOUT_ROWS,
        SIGNAL=counters is not None,
        ACCUMULATE=ready is not None,
        COPY=out2 is not None,
        SYS_SIGNAL=remote_counters,
        **_meta(a, b, out, tile, use_tma),
    )


def restore_tile_major(src: torch.Tensor, dst: torch.Tensor, plan: Plan, tile: Tile) -> None:
    """Copy one shard's tile-major slots (local order) into the row-major (Ms, N) ``dst``."""
    _restore_kernel[(plan.tiles_per_shard,)](
        src,
        dst,
        plan.rows_per_shard,
        plan.n,
        plan.tiles_m,
        plan.tiles_n,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        GROUP_M=tile.group_m,
        num_warps=4 if tile.block_m * tile.block_n <= 128 * 128 else 8,
    )
