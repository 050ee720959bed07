"""The Triton engine's grouped GEMMs: persistent kernels over segments of rows, each segment one
expert's rows of one source slot, optionally signalling a counter per slot.

A segment is ``(row0, rows, expert, group)``: rows [row0, row0 + rows) of A, multiplied by
B[expert], counted in ``counters[group]``. Only segments with rows are listed. Tiles go segment
by segment (a slot's segments are consecutive, so its tiles are), each segment's in the grouped
swizzle of the dense kernels (``fo_kernels.gemm.tiles``)::

    seg_tiles[s] = sum over segments before s of cdiv(rows, BM) x tiles_n     (S + 1 prefix sums)
    for t in p, p + G, p + 2G, ... < seg_tiles[S]:            (persistent program p of G)
        s = the segment with seg_tiles[s] <= t < seg_tiles[s + 1]             (binary search)
        (tm, tn) = grouped_swizzle(t - seg_tiles[s])
        acc = A[row0 + tm*BM : +BM, :] @ B[expert][:, tn*BN : +BN]            (float32)
        store acc at those rows of out (rows < row0 + rows, columns < N)
        SIGNAL: barrier; atomic_add(counters[group], 1, release)              (as the dense GEMM)

``grouped_gemm`` is that kernel (phase 2: h @ W2, a counter per source slot, which the
communication stream waits on before it sends the slot's rows back). ``swiglu_gemm`` is the
first GEMM with the activation in its epilogue (phase 1: x @ W13): per tile two accumulators of
BN/2 columns, the gate's (columns [tn*BN/2, +BN/2) of B[e]) and the up projection's (the same
columns + I) in one K loop that loads each A block once, stored as silu(gate) * up: (R, I) in
A's dtype, never the (R, 2I) product.

Loads are TMA descriptors over A (R, K) and B as (E x K, N) rows where TMA is usable and K is
a multiple of BLOCK_K (a K block then never reads the next expert's rows), masked pointer loads
otherwise; rows past a segment's end read rows that are never stored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fo_kernels.gemm.epilogue import _downcast, _signal
from fo_kernels.gemm.operands import TMA_ALIGN_BYTES, BOperand, kernel_meta, tma_usable
from fo_kernels.gemm.tiles import _mma, _tile_coords
from fo_kernels.moe.grouped import device_ints
from fo_kernels.tile import MIN_BLOCK, Tile

Segment = tuple[int, int, int, int]  # (row0, rows, expert, group)
# What these kernels take of the dense kernels' compile-time arguments (``kernel_meta``); the SwiGLU
# kernel takes no PTX (it signals nothing).
_META = ("UPCAST", "IEEE", "BLOCK_M", "BLOCK_K", "GROUP_M", "PTX", "num_warps", "num_stages")


@triton.jit
def _find_segment(t, seg_tiles, segments, LOG_SEGMENTS: tl.constexpr):
    """The segment s with seg_tiles[s] <= t < seg_tiles[s + 1] (every listed segment has tiles)."""
    lo = t * 0
    hi = lo + segments
    for _ in tl.static_range(LOG_SEGMENTS):
        mid = (lo + hi) // 2
        go = tl.load(seg_tiles + mid) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _pointer_offsets(a_row0, rows_end, col0, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows and columns a pointer-loaded tile reads: rows from ``rows_end`` on read row a_row0
    and columns from N on read column 0 (never stored)."""
    offs_m = a_row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    offs_m = tl.where(offs_m < rows_end, offs_m, a_row0).to(tl.int64)
    offs_n = tl.where(offs_n < N, offs_n, 0)
    return offs_m, offs_n


@triton.jit
def _a_block(a, a_row0, offs_m, kk, K, stride_am, stride_ak, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr):
    """K block ``kk`` of the tile's A rows: a TMA load at row ``a_row0``, or a masked pointer load
    of rows ``offs_m`` (K past its end reads zeros)."""
    if USE_TMA:
        blk = a.load([a_row0, kk * BLOCK_K])
    else:
        offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        blk = tl.load(
            a + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak, mask=offs_k[None, :] < K, other=0.0
        )
    return blk


@triton.jit
def _b_block(b, b_ptr, b_row0, b_col0, offs_n, kk, K, stride_bk, stride_bn, BLOCK_K: tl.constexpr,
             USE_TMA: tl.constexpr):  # fmt: skip
    """K block ``kk`` of B_e's columns: a TMA load of ``b``'s block at row ``b_row0`` + kk x BK and
    column ``b_col0``, or a masked pointer load of columns ``offs_n`` of ``b_ptr`` (B_e)."""
    if USE_TMA:
        blk = b.load([b_row0 + kk * BLOCK_K, b_col0])
    else:
        offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        blk = tl.load(
            b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=offs_k[:, None] < K,
            other=0.0,
        )
    return blk


@triton.jit
def _segment_acc(
    a, b, b_ptr, a_row0, rows_end, b_row0, b_col0, col0, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A[a_row0 : +BM, :] @ B_e[:, col0 : +BN] in float32: TMA (``a``, ``b``: descriptors; B_e's
    block at row ``b_row0`` and column ``b_col0`` of ``b``) or masked pointer loads (``b_ptr``: B_e;
    ``_pointer_offsets``)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_m, offs_n = _pointer_offsets(a_row0, rows_end, col0, N, BLOCK_M, BLOCK_N)
    for kk in range(tl.cdiv(K, BLOCK_K)):
        a_blk = _a_block(a, a_row0, offs_m, kk, K, stride_am, stride_ak, BLOCK_K, USE_TMA)
        b_blk = _b_block(b, b_ptr, b_row0, b_col0, offs_n, kk, K, stride_bk, stride_bn, BLOCK_K, USE_TMA)
        acc = _mma(a_blk, b_blk, acc, UPCAST, IEEE)
    return acc


@triton.jit
def _swiglu_acc(
    a, b, b_ptr, a_row0, rows_end, b_row0, col0, I, K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """(gate, up) in float32: A[a_row0 : +BM, :] @ B_e[:, col0 : +BH] and @ B_e[:, I + col0 : +BH],
    one K loop that loads each A block once for both products (two loops, one per product, load A
    twice and run as two half-width tiles). Loads as ``_segment_acc``'s."""
    gate = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    offs_m, offs_n = _pointer_offsets(a_row0, rows_end, col0, I, BLOCK_M, BLOCK_H)
    for kk in range(tl.cdiv(K, BLOCK_K)):
        a_blk = _a_block(a, a_row0, offs_m, kk, K, stride_am, stride_ak, BLOCK_K, USE_TMA)
        g_blk = _b_block(b, b_ptr, b_row0, col0, offs_n, kk, K, stride_bk, stride_bn, BLOCK_K, USE_TMA)
        u_blk = _b_block(
            b, b_ptr + I * stride_bn, b_row0, I + col0, offs_n, kk, K, stride_bk, stride_bn, BLOCK_K, USE_TMA
        )
        gate = _mma(a_blk, g_blk, gate, UPCAST, IEEE)
        up = _mma(a_blk, u_blk, up, UPCAST, IEEE)
    return gate, up


@triton.jit
def _store_rows(acc, out, row0, rows_end, col0, N, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                OUT_DTYPE: tl.constexpr):  # fmt: skip
    """Store a float32 tile at rows [row0, rows_end) and columns < N of ``out``."""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = (rows < rows_end)[:, None] & (cols < N)[None, :]
    tl.store(
        out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], _downcast(acc, OUT_DTYPE), mask=mask
    )


@triton.jit
def _tile_of(t, seg_info, seg_tiles, segments, tiles_n, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
             LOG_SEGMENTS: tl.constexpr):  # fmt: skip
    """Tile t -> (first row, end of its segment's rows, expert, group, tile column)."""
    s = _find_segment(t, seg_tiles, segments, LOG_SEGMENTS)
    row0 = tl.load(seg_info + 4 * s)
    rows = tl.load(seg_info + 4 * s + 1)
    expert = tl.load(seg_info + 4 * s + 2)
    group = tl.load(seg_info + 4 * s + 3)
    tm, tn = _tile_coords(t - tl.load(seg_tiles + s), tl.cdiv(rows, BLOCK_M), tiles_n, GROUP_M)
    return row0 + tm * BLOCK_M, row0 + rows, expert, group, tn


@triton.jit
def _grouped_kernel(
    a, b, b_raw, out, counters, seg_info, seg_tiles,  # tensors (a, b: or TMA descriptors)
    segments, tiles, tiles_n, N, K,  # sizes
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_om,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    LOG_SEGMENTS: tl.constexpr, USE_TMA: tl.constexpr, SIGNAL: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    for t in tl.range(pid, tiles, tl.num_programs(0)):
        row0, rows_end, expert, group, tn = _tile_of(
            t, seg_info, seg_tiles, segments, tiles_n, BLOCK_M, GROUP_M, LOG_SEGMENTS
        )
        acc = _segment_acc(
            a, b, b_raw + expert.to(tl.int64) * stride_be, row0, rows_end, expert * K, tn * BLOCK_N,
            tn * BLOCK_N, N, K,
            stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, UPCAST, IEEE,
        )  # fmt: skip
        _store_rows(acc, out, row0, rows_end, tn * BLOCK_N, N, stride_om, BLOCK_M, BLOCK_N, OUT_DTYPE)
        if SIGNAL:
            _signal(counters, group, PTX, False)


@triton.jit
def _swiglu_kernel(
    a, b, b_raw, out, seg_info, seg_tiles,  # tensors (a, b: or TMA descriptors)
    segments, tiles, tiles_n, I, K,  # sizes (I: the intermediate size, B has 2I columns)
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_om,  # strides
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    LOG_SEGMENTS: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    for t in tl.range(pid, tiles, tl.num_programs(0)):
        row0, rows_end, expert, _group, tn = _tile_of(
            t, seg_info, seg_tiles, segments, tiles_n, BLOCK_M, GROUP_M, LOG_SEGMENTS
        )
        col0 = tn * BLOCK_H
        gate, up = _swiglu_acc(
            a, b, b_raw + expert.to(tl.int64) * stride_be, row0, rows_end, expert * K, col0, I, K,
            stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_H, BLOCK_K, USE_TMA, UPCAST, IEEE,
        )  # fmt: skip
        h = gate * tl.sigmoid(gate) * up
        _store_rows(h, out, row0, rows_end, col0, I, stride_om, BLOCK_M, BLOCK_H, OUT_DTYPE)


# ----------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class SegmentTables:
    """The kernels' segment tables on the device (``segment_tables``): made once, they let a
    launch be captured in a CUDA graph (no host-to-device copy inside it)."""

    info: torch.Tensor  # (S, 4) int32: row0, rows, expert, group
    prefix: torch.Tensor  # (S + 1,) int32: seg_tiles
    count: int  # S, the segments with rows
    tiles: int  # seg_tiles[S]
    block_m: int
    tiles_n: int


def segment_tables(
    segments: Sequence[Segment], block_m: int, tiles_n: int, device: torch.device
) -> SegmentTables:
    """The tables of the segments with rows, for tiles of ``block_m`` rows and ``tiles_n`` columns."""
    kept = [s for s in segments if s[1] > 0]
    prefix = [0]
    for _, rows, _, _ in kept:
        prefix.append(prefix[-1] + -(-rows // block_m) * tiles_n)
    info = device_ints([x for s in kept for x in s] or [0], torch.int32, device)
    prefix_t = device_ints(prefix, torch.int32, device)
    return SegmentTables(info, prefix_t, len(kept), prefix[-1], block_m, tiles_n)


def _tables(segments, block_m: int, tiles_n: int, device: torch.device) -> SegmentTables:
    if isinstance(segments, SegmentTables):
        if (segments.block_m, segments.tiles_n) != (block_m, tiles_n):
            raise ValueError(f"segment tables for {segments.block_m}-row tiles, {segments.tiles_n} columns")
        return segments
    return segment_tables(segments, block_m, tiles_n, device)


def _operands(
    a: torch.Tensor, w: torch.Tensor, block_k: int, block_n: int, tile: Tile, use_tma, col_align: int
):
    """(a, b kernel arguments, USE_TMA, kernel meta): TMA where usable, K % BLOCK_K == 0 and the
    column blocks start on ``col_align`` elements 16-byte aligned (TMA_ALIGN_BYTES)."""
    experts, k, n = w.shape
    flat = w.reshape(experts * k, n)
    operand = BOperand(flat, False)
    if use_tma is None:
        aligned = (col_align * w.element_size()) % TMA_ALIGN_BYTES == 0
        use_tma = aligned and k % block_k == 0 and tma_usable(a, operand)
    full = kernel_meta(a, operand, a, tile, use_tma)
    meta = {key: full[key] for key in _META}
    if not use_tma:
        return a, w, False, meta
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_arg = TensorDescriptor.from_tensor(a, [tile.block_m, block_k])
    return a_arg, TensorDescriptor.from_tensor(flat, [block_k, block_n]), True, meta


def _out_dtype(out: torch.Tensor):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[out.dtype]


def _log2(segments: int) -> int:
    return max(1, math.ceil(math.log2(max(segments, 1))) + 1)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    segments: Sequence[Segment] | SegmentTables,
    tile: Tile,
    *,
    grid: int,
    counters: torch.Tensor | None = None,
    use_tma: bool | None = None,
) -> None:
    """``out[rows of s] = a[rows of s] @ w[expert of s]`` for every segment s, on the current
    stream; with ``counters``, each tile then adds 1 (release) to ``counters[group of s]``.
    ``segments``: the list, or its ``SegmentTables`` for tiles of this tile's size.
    ``a`` (R, K) row-major, ``w`` (E, K, N) contiguous, ``out`` (R, N) with unit column stride."""
    _, k, n = w.shape
    t = _tables(segments, tile.block_m, -(-n // tile.block_n), a.device)  # the segment tables
    if not t.tiles:
        return
    a_arg, b_arg, use_tma, meta = _operands(a, w, tile.block_k, tile.block_n, tile, use_tma, tile.block_n)
    _grouped_kernel[(max(1, min(grid, t.tiles)),)](
        a_arg, b_arg, w, out, counters if counters is not None else t.info, t.info, t.prefix,
        t.count, t.tiles, t.tiles_n, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        BLOCK_N=tile.block_n, LOG_SEGMENTS=_log2(t.count), USE_TMA=use_tma, SIGNAL=counters is not None,
        OUT_DTYPE=_out_dtype(out), **meta,
    )  # fmt: skip


def swiglu_block(tile: Tile) -> int:
    """Columns of the gate (and of the up projection) one SwiGLU tile computes."""
    return max(tile.block_n // 2, MIN_BLOCK)


def swiglu_gemm(
    a: torch.Tensor,
    w13: torch.Tensor,
    out: torch.Tensor,
    segments: Sequence[Segment] | SegmentTables,
    tile: Tile,
    *,
    grid: int,
    use_tma: bool | None = None,
) -> None:
    """``out[rows of s] = silu(g) * u`` with ``[g | u] = a[rows of s] @ w13[expert of s]``, on the
    current stream. ``a`` (R, K), ``w13`` (E, K, 2I) contiguous, ``out`` (R, I)."""
    _, k, n2 = w13.shape
    inter = n2 // 2
    block_h = swiglu_block(tile)
    t = _tables(segments, tile.block_m, -(-inter // block_h), a.device)  # the segment tables
    if not t.tiles:
        return
    # (the up projection's blocks start at column I)
    a_arg, b_arg, use_tma, meta = _operands(a, w13, tile.block_k, block_h, tile, use_tma, inter)
    meta.pop("PTX")
    _swiglu_kernel[(max(1, min(grid, t.tiles)),)](
        a_arg, b_arg, w13, out, t.info, t.prefix, t.count, t.tiles, t.tiles_n, inter, k,
        a.stride(0), a.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), out.stride(0),
        BLOCK_H=block_h, LOG_SEGMENTS=_log2(t.count), USE_TMA=use_tma, OUT_DTYPE=_out_dtype(out), **meta,
    )  # fmt: skip
