"""The copy engine's rows GEMM: the persistent GEMM into a plain row-major destination, its tile
rows in groups, optionally waiting for and adding what the copy engine brought.

Protocol, per persistent program p of G (T = tiles_m x tiles_n tiles of one shard, no layout):

    for t in p, p + G, p + 2G, ... < T:
        (tm, tn) = grouped_swizzle(t)                 # as the signalled GEMM's tiles (.tiles)
        acc = sum over K of A[tm*BM : +BM, :] @ B[:, tn*BN : +BN]; fp8: acc *= its scales
        g = row_group[tm]
        if ready: spin until ready[g] != 0 (acquire, system scope); acc += out's tile
        store acc at rows [tm*BM, +BM) of out (and of out2, which may be a peer GPU's memory)
        if counters: barrier; atomic_add(counters[g], 1, release, gpu or system scope)

Each tile signals at once (the copy engine's schedules were measured so); the counters are reset
by their reader each call. Used by ``fo_kernels.engines.copy_engine`` (tiled mode) and the Triton engine's
AllGather + GEMM (``fo_kernels.engines.triton.executor``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fo_kernels.gemm.epilogue import _scale, _signal, _store_tile
from fo_kernels.gemm.operands import (
    LAYOUT_ROWS,
    BOperand,
    epilogue_pieces,
    kernel_meta,
    operand_args,
    scale_args,
    strides,
)
from fo_kernels.gemm.tiles import _tile_acc, _tile_coords
from fo_kernels.scaling import Scales
from fo_kernels.tile import Tile

# The store layout, as a constexpr a jit function may read (Triton reads no other globals).
_ROWS = tl.constexpr(LAYOUT_ROWS)


@triton.jit
def _finish_rows_tile(
    acc, t, out, out2, counters, row_group, ready, rows, N, tiles_m, tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SIGNAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr, SUBTILE: tl.constexpr, PTX: tl.constexpr, ACCUMULATE: tl.constexpr,
    COPY: tl.constexpr, SYS_SIGNAL: tl.constexpr,
):  # fmt: skip
    """Tile t's epilogue: wait for its group's flag (ACCUMULATE), its stores, its signal."""
    tm, tn = _tile_coords(t, tiles_m, tiles_n, GROUP_M)
    g = tl.load(row_group + tm)
    row0 = tm * BLOCK_M
    col0 = tn * BLOCK_N
    if ACCUMULATE:  # wait until the copy engine's part of this tile's group has landed
        seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="sys")
        while seen == 0:
            seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="sys")
    _store_tile(
        acc, out, out2, row0, t, row0, col0, rows, N,
        BLOCK_M, BLOCK_N, SUBTILE, _ROWS, ACCUMULATE, COPY, OUT_DTYPE,
    )  # fmt: skip
    if SIGNAL:
        _signal(counters, g, PTX, SYS_SIGNAL)


@triton.jit
def _rows_kernel(
    a, b, out, out2, counters, row_group, ready, scale_a, scale_b,  # tensors (a, b: or TMA
    # descriptors; scale_a, scale_b: an fp8 call's scales of these rows, else unread)
    rows, N, K, tiles_m, tiles_n, tiles,  # sizes (tiles = tiles_m x tiles_n)
    stride_am, stride_ak, stride_bk, stride_bn,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, SIGNAL: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr, FLATTEN: tl.constexpr, SUBTILE: tl.constexpr,
    PTX: tl.constexpr, ACCUMULATE: tl.constexpr, COPY: tl.constexpr, SYS_SIGNAL: tl.constexpr,
    SCALE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # the epilogue's tile from a counter of its own, as the whole waves' (``.waves``)
    tile_c = pid - progs
    for t in tl.range(pid, tiles, progs, flatten=FLATTEN):
        tm, tn = _tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = _tile_acc(
            a, b, tm * BLOCK_M, tn * BLOCK_N, 0, k_tiles, rows, N, K,
            stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
        )  # fmt: skip
        acc = _scale(acc, scale_a, scale_b, tm * BLOCK_M, tn * BLOCK_N, rows, N, BLOCK_M, BLOCK_N, SCALE)
        tile_c += progs
        _finish_rows_tile(
            acc, tile_c, out, out2, counters, row_group, ready, rows, N, tiles_m, tiles_n,
            BLOCK_M, BLOCK_N, GROUP_M, SIGNAL, OUT_DTYPE, SUBTILE, PTX, ACCUMULATE, COPY, SYS_SIGNAL,
        )  # fmt: skip


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
    scales: Scales | None = None,
) -> None:
    """``out = a @ b`` (or ``out += a @ b`` once ready, see ``ready``) by the persistent kernel on
    the current stream, for the copy engine's tiled mode (``fo_kernels.engines.copy_engine``).

    ``a`` is row-major (rows, K); ``out`` (and ``out2``) are row-major (rows, N) with row stride N.
    ``row_group`` (int32, one per tile row of ``BLOCK_M`` rows) gives each tile row its group.
    ``counters``: each tile adds 1 (release) to ``counters[group]`` once its stores are issued.
    ``ready``: each tile first waits until ``ready[group]`` is nonzero (acquire, system scope: a
    flag the copy engine's stream sets after its copy into ``out``), then adds ``out``'s tile to its
    sum in float32. ``out2``: the result is stored there too (it may be the peer GPU's memory).
    ``remote_counters``: ``counters`` are in the peer's memory (release at system scope, so the
    stores before it, ``out2``'s too, land first). The grid must not exceed the SMs (every program
    must be resident while others wait on ``ready``). The loop is not flattened while it waits on
    ``ready`` (a spin loop in the epilogue). ``scales``: an fp8 call's scales of ``a``'s rows
    (``fo_kernels.scaling``), applied before the sum with what ``ready`` brought; ``out`` in its
    ``out_dtype``.
    """
    rows, k = a.shape
    n = b.tensor.shape[1]
    tiles_m, tiles_n = -(-rows // tile.block_m), -(-n // tile.block_n)
    a_arg, b_arg, use_tma = operand_args(a, b, tile, use_tma)
    _rows_kernel[(max(1, min(grid, tiles_m * tiles_n)),)](
        a_arg, b_arg, out, out2 if out2 is not None else out,
        counters if counters is not None else row_group, row_group,
        ready if ready is not None else row_group, *scale_args(scales, row_group),
        rows, n, k, tiles_m, tiles_n, tiles_m * tiles_n, *strides(a, b),
        SIGNAL=counters is not None,
        ACCUMULATE=ready is not None,
        COPY=out2 is not None,
        SYS_SIGNAL=remote_counters,
        FLATTEN=use_tma and ready is None,
        SUBTILE=epilogue_pieces(tile),
        **kernel_meta(a, b, out, tile, use_tma, scales),
    )  # fmt: skip
