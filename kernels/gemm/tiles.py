"""The signalled GEMM's tile order and main loop: ``@triton.jit`` helpers every plain kernel shares.

Symbols as in ``fo_kernels.plan``:

    tile t = l * S + s                     (local position l of shard s)
    (tm, tn) = grouped_swizzle(l)          GROUP_M tile rows a band, column by column in a band
    acc(t) = sum over K blocks kk of A[s*Ms + tm*BM : +BM, kk*BK : +BK] @ B[kk*BK : +BK, tn*BN : +BN]
    row_band:   rows [S*a0 + s*(a1 - a0) + (tm*BM - a0), +BM) of the buffer seen as (rows, N)
    tile_major: slot S*a0 + s*(a1 - a0) + (l - a0) of BM*BN elements
                with (a0, a1 - a0) = group_info[g], g = unit_group[t // U]

Loads are TMA descriptor loads (USE_TMA) or masked pointer loads (rows past M and columns past N
read padding that is never stored; K past its end reads zeros).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile t of the schedule -> (local position l, shard s, tile row, tile column)."""
    l = t // shards
    s = t % shards
    tm, tn = _tile_coords(l, tiles_m, tiles_n, GROUP_M)
    return l, s, tm, tn


@triton.jit
def _mma(a_blk, b_blk, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``acc + a_blk @ b_blk`` in float32: upcast first under the interpreter (its bf16 ``tl.dot``
    is wrong), IEEE precision when the inputs are (or were upcast to) float32 (no TF32).

    fp8 operands accumulate as Triton's default on sm_90 has them (``max_num_imprecise_acc``
    2**30): the whole K loop in the wgmma's own reduced-precision accumulator, as
    ``torch._scaled_mm(use_fast_accum=True)``; 1.3e-3 relative against float64 at K = 4096 (one
    H100). Promoting each K block into the float32 accumulator (``max_num_imprecise_acc =
    BLOCK_K``) read 1.3e-4 at K = 1024 but made the GEMM 1.5-1.6x slower (docs/perf-notes.md,
    "Tried and dropped"), so it does not ship."""
    if UPCAST:
        a_blk = a_blk.to(tl.float32)
        b_blk = b_blk.to(tl.float32)
    if IEEE:
        return tl.dot(a_blk, b_blk, acc, input_precision="ieee")
    return tl.dot(a_blk, b_blk, acc)


@triton.jit
def _tile_acc(
    a, b, row0, col0, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One output tile's float32 sum over K blocks [k_lo, k_hi): A[row0 : row0 + BLOCK_M, k] @
    B[k, col0 : col0 + BLOCK_N] (TMA descriptor loads, or masked pointer loads; rows past M and
    columns past N read padding)."""
    return _tile_acc_into(
        tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a, b, row0, col0, k_lo, k_hi, M, N, K,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
    )  # fmt: skip


@triton.jit
def _tile_acc_into(
    acc, a, b, row0, col0, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
    B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """``acc`` plus ``_tile_acc``'s sum over K blocks [k_lo, k_hi) (none when k_lo >= k_hi)."""
    if USE_TMA:
        for kk in range(k_lo, k_hi):
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
        for kk in range(k_lo, k_hi):
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
def _tile_dst(
    t, unit_group, group_info, shards, unit_tiles, tiles_m, tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Where tile t goes in the row_band and tile_major layouts: (its group, its tile-major slot,
    its first destination row (row_band), its first shard-local row, its first column)."""
    l, s, tm, tn = _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
    g = tl.load(unit_group + t // unit_tiles)
    base = tl.load(group_info + 2 * g)  # a0 of the group (local tile or shard-local row)
    span = tl.load(group_info + 2 * g + 1)  # a1 - a0
    local_row0 = tm * BLOCK_M
    slot = shards * base + s * span + (l - base)
    dst_row0 = shards * base + s * span + (local_row0 - base)
    return g, slot, dst_row0, local_row0, tn * BLOCK_N
