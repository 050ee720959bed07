"""The signalled persistent GEMM and the tile-major restore, in Triton.

Math: C = A @ B with A (M, K), B (K, N) (row-major, or the transposed view of an (N, K) weight),
bf16/fp16/fp32 in, fp32 accumulation, output in the input dtype.

Protocol, per persistent program p of G (symbols as in ``fo_kernels.plan``):

    for t in p, p + G, p + 2G, ... < T:             # wave w = tiles [wG, (w+1)G)
        l, s = t // S, t % S                         # local tile position, shard
        tm, tn = grouped_swizzle(l)                  # GROUP_M tile rows per band
        acc = sum_k A[s*Ms + tm*BM : +BM, k] @ B[k, tn*BN : +BN]
        g = unit_group[t // U]                       # group of the tile's signal unit
        barrier (all threads' stores issued); atomic_add(counter[g'], 1, release, gpu scope)
                                                     # g': the previous tile's group (none at first)
        store acc at its layout position in group g's chunk
    barrier; atomic_add(counter[g], 1, release, gpu scope)   # the last tile's group

The release increment is cumulative over the CTA barrier, so a reader that observes the counter at
its target (``cuStreamWaitValue32`` or the spin kernel, which acquire) sees every element of the
group's tiles (``tests/test_gpu.py`` reads each group from another SM the moment its counter is
complete). Stores are plain ``tl.store`` by default; with ``KernelOptions(tma_store=True)`` they
are TMA descriptor stores, which are asynchronous, so the issuing thread waits until they are
written before the barrier (``fo_kernels.gemm_epilogue``). Loads use TMA descriptors where the
strides allow it (16-byte aligned) and masked pointer loads otherwise, so any M, N, K works.

With TMA loads the two loops above are one flattened, software-pipelined loop over (tile, k)
(``tl.range(flatten=True)``): the next tile's loads are in flight while a tile's epilogue runs.
The CTA barrier is inline PTX there (``tl.debug_barrier`` stops Triton 3.6 from pipelining the
flattened loop). Each tile's signal is sent at the next tile's epilogue (``KernelOptions.
defer_signal``), when its stores have long been issued. Where a last, partial wave would leave
programs idle, the programs go on to it once their last whole tile is done (``KernelOptions.
fuse_tail``; else a second launch runs it): where it holds at most half the grid, its tiles cut
into halves or quarters, one wave of pieces (the split tail, ``tail_split``), each tile signalled
by the last of its pieces to finish; else, where the measured rule in ``stream_k_split`` says it
pays, its tiles' K blocks shared out over the programs (stream-K, in the order of ``_sk_step``),
each tail tile finished, stored and signalled by the last of its programs to arrive
(``docs/perf-notes.md``, "The signalled GEMM at cuBLAS speed (one H200)", "The split tail" and
"The tail in the whole waves' launch").

A ``Tile.pingpong`` tile runs the warp-specialized ping-pong kernel instead
(``fo_kernels.gemm_pingpong``: the same tile order, layouts and signal), then its split tail, if
any, in this kernel's split launch.

Counters are never reset: each call's targets are the running totals the host keeps (see
``fo_kernels.runtime``), and every comparison is wrap-around safe in int32.

``rows_gemm`` runs the same kernel for the copy engine's tiled mode (``LAYOUT_ROWS``): one shard,
a plain row-major destination, groups of whole tile rows, optionally waiting per group for a flag
and adding what the copy engine put in the destination (the counters there are reset by their
reader each call).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .errors import ScheduleError
from .gemm_epilogue import _bulk_stores_done, _cta_barrier, _store_piece, _store_tile
from .gemm_pingpong import pingpong_blocker, pingpong_gemm
from .plan import Plan, TailPlan, cdiv, tail_plan
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
# The narrowest epilogue piece: tl.dot and the store layouts want >= 16 columns (as MIN_BLOCK).
MIN_PIECE = 16
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
def _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile t of the schedule -> (local position l, shard s, tile row, tile column)."""
    l = t // shards
    s = t % shards
    tm, tn = _tile_coords(l, tiles_m, tiles_n, GROUP_M)
    return l, s, tm, tn


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
def _sk_step(pid, j: tl.constexpr, sk_iters, tail_iters, k_tiles, ALIGN: tl.constexpr):
    """Step j (0 or 1) of program pid in the stream-K tail: (valid, tail tile, slot, K blocks
    [k0, k1), then [k2, k3), summed into one part).

    The tail's K blocks, tile after tile, are cut into one run of ``sk_iters`` per program: the
    suffix of a tile (slot 0), then the next tile's prefix (slot 1), or one stretch inside a tile.
    In order (ALIGN off) the programs start at scattered K blocks, so few read the same A or B
    block at once. ALIGN: a program with a prefix runs it first, so it reads K block tau at its
    step tau and, in its suffix, K block tau + k_tiles - sk_iters; a stretch [s, s + L) inside a
    tile with s <= L runs [L, s + L) first, then [s, L) at step s on: every program is at one of
    three K offsets (0, k_tiles - sk_iters, sk_iters) from the common step, and the programs at
    one offset read the same A rows' and B columns' K blocks together, as a wave does."""
    lo = pid * sk_iters
    hi = tl.minimum(lo + sk_iters, tail_iters)
    first_tile = lo // k_tiles
    s = lo - first_tile * k_tiles
    two = hi > (first_tile + 1) * k_tiles  # a suffix, then the next tile's prefix
    end = tl.minimum(hi - first_tile * k_tiles, k_tiles)
    if ALIGN:
        slot = tl.where(two, 1 - j, j)  # the prefix first
    else:
        slot = two * 0 + j
    valid = (lo < hi) & (two | (j == 0))
    k0 = tl.where(slot == 1, 0, s)
    k1 = tl.where(slot == 1, hi - (first_tile + 1) * k_tiles, end)
    k2 = k1 * 0
    k3 = k1 * 0
    if ALIGN:
        length = end - s
        rotate = (slot == 0) & (s > 0) & (end < k_tiles) & (s <= length)
        k0 = tl.where(rotate, length, k0)
        k2 = tl.where(rotate, s, k2)
        k3 = tl.where(rotate, length, k3)
    return valid, first_tile + slot, slot, k0, k1, k2, k3


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


@triton.jit
def _finish_tile(
    acc, t, out, out_desc, out2, counters, unit_group, group_info, ready, N, rows_per_shard,
    tiles_m, tiles_n, shards, unit_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, LAYOUT: tl.constexpr,
    SIGNAL: tl.constexpr, OUT_DTYPE: tl.constexpr, SUBTILE: tl.constexpr, TMA_STORE: tl.constexpr,
    PTX: tl.constexpr, ACCUMULATE: tl.constexpr, COPY: tl.constexpr, SYS_SIGNAL: tl.constexpr,
    DEFER: tl.constexpr = False,
):  # fmt: skip
    """Tile t's epilogue: its group, its stores at the layout position, then its signal (with
    DEFER, the caller signals the returned group later, ``_signal``). Returns the tile's group."""
    if LAYOUT == 2:  # LAYOUT_ROWS: row-major (rows_per_shard, N) at ``out``, groups of whole tile rows
        l, _s, tm, tn = _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
        g = tl.load(unit_group + tm)
        slot = l  # (tile_major only)
        local_row0 = tm * BLOCK_M
        dst_row0 = local_row0
        col0 = tn * BLOCK_N
        if ACCUMULATE:  # wait until the copy engine's part of this tile's group has landed
            seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="sys")
            while seen == 0:
                seen = tl.atomic_add(ready + g, 0, sem="acquire", scope="sys")
    else:
        g, slot, dst_row0, local_row0, col0 = _tile_dst(
            t, unit_group, group_info, shards, unit_tiles, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M
        )
    _store_tile(
        acc, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
        BLOCK_M, BLOCK_N, SUBTILE, LAYOUT, TMA_STORE, ACCUMULATE, COPY, OUT_DTYPE,
    )  # fmt: skip
    if SIGNAL and not DEFER:
        _signal(counters, g, TMA_STORE, PTX, SYS_SIGNAL)
    return g


@triton.jit
def _signal(counters, g, TMA_STORE: tl.constexpr, PTX: tl.constexpr, SYS_SIGNAL: tl.constexpr):
    """Group g's counter + 1 (release), once every thread's stores before this point are issued
    (and, with TMA stores, written): the counter then covers all of them."""
    if TMA_STORE and PTX:
        _bulk_stores_done()
    _cta_barrier(PTX)
    if SYS_SIGNAL:
        tl.atomic_add(counters + g, 1, sem="release", scope="sys")
    else:
        tl.atomic_add(counters + g, 1, sem="release", scope="gpu")


@triton.jit
def _signal_if(counters, g, TMA_STORE: tl.constexpr, PTX: tl.constexpr, SYS_SIGNAL: tl.constexpr):
    """``_signal`` for a group g >= 0 (a deferred signal; -1: no tile waits for one)."""
    if g >= 0:
        _signal(counters, g, TMA_STORE, PTX, SYS_SIGNAL)


@triton.jit
def _split_piece(
    q, a, b, out, counters, unit_group, group_info, sk_arrive, main_tiles, k_tiles,
    M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_M: tl.constexpr, SPLIT_N: tl.constexpr, USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PTX: tl.constexpr, SYS_SIGNAL: tl.constexpr,
):  # fmt: skip
    """Piece q of the split tail: tiles [main_tiles, ...) of SPLIT_M*BLOCK_M x SPLIT_N*BLOCK_N (the
    schedule's tile), each cut into SPLIT_M x SPLIT_N pieces of BLOCK_M x BLOCK_N. The piece is
    stored at its place in its tile's layout position; the last of a tile's pieces to finish (an
    arrival count a tile, acquire-release) sends the tile's signal."""
    PIECES: tl.constexpr = SPLIT_M * SPLIT_N
    TILE_M: tl.constexpr = SPLIT_M * BLOCK_M
    TILE_N: tl.constexpr = SPLIT_N * BLOCK_N
    i = q // PIECES
    pm = (q % PIECES) // SPLIT_N
    pn = q % SPLIT_N
    t = main_tiles + i
    _l, s, tm, tn = _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
    acc = _tile_acc(
        a, b, s * rows_per_shard + tm * TILE_M + pm * BLOCK_M, tn * TILE_N + pn * BLOCK_N, 0, k_tiles,
        M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
    )  # fmt: skip
    g, slot, dst_row0, local_row0, col0 = _tile_dst(
        t, unit_group, group_info, shards, unit_tiles, tiles_m, tiles_n, TILE_M, TILE_N, GROUP_M
    )
    # tile_major: the piece's rows are slot SPLIT_M * slot + pm of BLOCK_M rows of TILE_N
    # columns, from column pn * BLOCK_N (the base moved there); row_band: its rows and columns.
    if LAYOUT == 1:
        base = out + pn * BLOCK_N
    else:
        base = out
    _store_piece(
        acc, 0, BLOCK_N, base, out, out, dst_row0 + pm * BLOCK_M,
        SPLIT_M * slot + pm, local_row0 + pm * BLOCK_M, col0 + pn * BLOCK_N, rows_per_shard, N,
        BLOCK_M, TILE_N, LAYOUT, False, False, False, OUT_DTYPE,
    )  # fmt: skip
    if SIGNAL:
        _cta_barrier(PTX)
        done = tl.atomic_add(sk_arrive + i, 1, sem="acq_rel", scope="gpu")
        if done == PIECES - 1:  # the others' stores are acquired: the signal covers them
            _signal(counters, g, False, PTX, SYS_SIGNAL)


@triton.jit
def _sk_tail(
    pid, a, b, out, out_desc, out2, counters, unit_group, group_info, ready, sk_arrive, sk_partial,
    M, N, K, rows_per_shard, tiles_m, tiles_n, num_tiles, shards, unit_tiles, main_tiles, sk_iters,
    k_tiles, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr, SUBTILE: tl.constexpr,
    TMA_STORE: tl.constexpr, PTX: tl.constexpr, ACCUMULATE: tl.constexpr, COPY: tl.constexpr,
    SYS_SIGNAL: tl.constexpr, SK_ALIGN: tl.constexpr,
):  # fmt: skip
    """Program pid's part of the stream-K tail (tiles [main_tiles, num_tiles), fewer than a wave):
    its K blocks, tile after tile, cut into one run of sk_iters per program, so each program covers
    parts of at most two tiles (``_sk_step``: which, in which order). Each part's float32 sum goes
    to this program's slot; the last of a tile's programs to arrive adds the others' parts and
    finishes the tile (stores and signal)."""
    tail_iters = (num_tiles - main_tiles) * k_tiles
    for j in tl.static_range(2):
        valid, i, slot, k0, k1, k2, k3 = _sk_step(pid, j, sk_iters, tail_iters, k_tiles, SK_ALIGN)
        if valid:
            t = main_tiles + i
            _l, s, tm, tn = _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
            acc = _tile_acc(
                a, b, s * rows_per_shard + tm * BLOCK_M, tn * BLOCK_N, k0, k1, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
            )  # fmt: skip
            if SK_ALIGN:  # a stretch inside a tile, in two runs
                acc = _tile_acc_into(
                    acc, a, b, s * rows_per_shard + tm * BLOCK_M, tn * BLOCK_N, k2, k3, M, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn,
                    BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
                )  # fmt: skip
            in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(sk_partial + (pid * 2 + slot).to(tl.int64) * (BLOCK_M * BLOCK_N) + in_tile, acc)
            _cta_barrier(PTX)
            first = (i * k_tiles) // sk_iters  # the programs that cover tile i: first..last
            last = ((i + 1) * k_tiles - 1) // sk_iters
            arrived = tl.atomic_add(sk_arrive + i, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:  # every part is written: add them in program order
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (the same bits whoever is last)
                for q in range(first, last + 1):  # its own part too: acc is dead after its store
                    jq = ((q * sk_iters) // k_tiles < i).to(tl.int32)  # tile i: q's slot 0 or 1
                    part = sk_partial + (q * 2 + jq).to(tl.int64) * (BLOCK_M * BLOCK_N) + in_tile
                    total += tl.load(part, cache_modifier=".cg")
                _finish_tile(
                    total, t, out, out_desc, out2, counters, unit_group, group_info, ready, N,
                    rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, BLOCK_M, BLOCK_N, GROUP_M,
                    LAYOUT, SIGNAL, OUT_DTYPE, SUBTILE, TMA_STORE, PTX, ACCUMULATE, COPY, SYS_SIGNAL,
                )  # fmt: skip


@triton.jit
def _signalled_gemm_kernel(
    a, b, a_piece, b_piece, out, out_desc, counters, unit_group, group_info,  # tensors (a, b, a_piece,
    # b_piece, out_desc: or TMA descriptors; a_piece, b_piece: the fused split tail's pieces' operands)
    M, N, K, rows_per_shard, tiles_m, tiles_n, num_tiles, shards, unit_tiles,  # sizes
    ready, out2,  # LAYOUT_ROWS only: the ready flags ACCUMULATE waits on, a second destination (COPY)
    sk_arrive, sk_partial, main_tiles, sk_iters,  # stream-K tail (STREAM_K only)
    stride_am, stride_ak, stride_bk, stride_bn,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    FLATTEN: tl.constexpr, SUBTILE: tl.constexpr,
    TMA_STORE: tl.constexpr, PTX: tl.constexpr, STREAM_K: tl.constexpr,
    ACCUMULATE: tl.constexpr = False, COPY: tl.constexpr = False,
    SYS_SIGNAL: tl.constexpr = False,  # the counters are in the peer GPU's memory (system scope)
    DEFER: tl.constexpr = False,  # signal each tile at the next tile's epilogue (KernelOptions)
    SPLIT_M: tl.constexpr = 1, SPLIT_N: tl.constexpr = 1,  # > 1: a launch of the split tail only
    SK_ALIGN: tl.constexpr = False,  # the stream-K tail's runs in aligned order (``_sk_step``)
    FUSE_M: tl.constexpr = 1, FUSE_N: tl.constexpr = 1,  # > 1: the whole waves, then the split tail
    FUSE_SK: tl.constexpr = False,  # the whole waves, then the stream-K tail
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if SPLIT_M * SPLIT_N > 1:  # a launch of the split tail: one piece a program
        _split_piece(
            pid, a, b, out, counters, unit_group, group_info, sk_arrive, main_tiles, k_tiles,
            M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles,
            stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_M, SPLIT_N, USE_TMA, B_KMAJOR, UPCAST, IEEE,
            LAYOUT, SIGNAL, OUT_DTYPE, PTX, SYS_SIGNAL,
        )  # fmt: skip
    elif not STREAM_K:  # the whole waves (STREAM_K: a launch of the stream-K tail only, below)
        # The epilogue recomputes its tile from a counter of its own (as Triton's persistent-matmul
        # tutorial does), so a flattened, pipelined loop's prologue (next tile's loads) and epilogue
        # (this tile's stores) share no value.
        tile_c = pid - progs
        prev_g = pid * 0 - 1  # DEFER: the group of the tile stored but not yet signalled (-1: none)
        for t in tl.range(pid, main_tiles, progs, flatten=FLATTEN):
            _l, s, tm, tn = _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
            acc = _tile_acc(
                a, b, s * rows_per_shard + tm * BLOCK_M, tn * BLOCK_N, 0, k_tiles, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
            )  # fmt: skip
            tile_c += progs
            # DEFER: the previous tile's stores were issued a whole tile ago, so its fence is short
            if DEFER and SIGNAL:  # (constexprs; the tensor test below is a separate if)
                _signal_if(counters, prev_g, TMA_STORE, PTX, SYS_SIGNAL)
            prev_g = _finish_tile(
                acc, tile_c, out, out_desc, out2, counters, unit_group, group_info, ready, N,
                rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, BLOCK_M, BLOCK_N, GROUP_M, LAYOUT,
                SIGNAL, OUT_DTYPE, SUBTILE, TMA_STORE, PTX, ACCUMULATE, COPY, SYS_SIGNAL, DEFER,
            )  # fmt: skip
        if DEFER and SIGNAL:
            _signal_if(counters, prev_g, TMA_STORE, PTX, SYS_SIGNAL)
        if FUSE_M * FUSE_N > 1:  # noqa: SIM102 (a compile-time test, then a runtime one)
            # the split tail in this launch: a piece a program (FUSE_M x FUSE_N pieces a tile)
            if pid < (num_tiles - main_tiles) * (FUSE_M * FUSE_N):
                _split_piece(
                    pid, a_piece, b_piece, out, counters, unit_group, group_info, sk_arrive, main_tiles,
                    k_tiles, M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles,
                    stride_am, stride_ak, stride_bk, stride_bn,
                    BLOCK_M // FUSE_M, BLOCK_N // FUSE_N, BLOCK_K, GROUP_M, FUSE_M, FUSE_N, USE_TMA,
                    B_KMAJOR, UPCAST, IEEE, LAYOUT, SIGNAL, OUT_DTYPE, PTX, SYS_SIGNAL,
                )  # fmt: skip
    if STREAM_K or FUSE_SK:  # the stream-K tail: a launch of its own, or after the whole waves
        _sk_tail(
            pid, a, b, out, out_desc, out2, counters, unit_group, group_info, ready, sk_arrive,
            sk_partial, M, N, K, rows_per_shard, tiles_m, tiles_n, num_tiles, shards, unit_tiles,
            main_tiles, sk_iters, k_tiles, stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, B_KMAJOR, LAYOUT, SIGNAL, UPCAST, IEEE,
            OUT_DTYPE, SUBTILE, TMA_STORE, PTX, ACCUMULATE, COPY, SYS_SIGNAL, SK_ALIGN,
        )  # fmt: skip


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


@functools.cache
def _cuda_major(index: int) -> int:
    """The compute capability's major number of CUDA device ``index`` (fixed for the process; asked
    once, since ``torch.cuda.get_device_capability`` costs microseconds on every launch)."""
    return torch.cuda.get_device_capability(index)[0]


def _has_tma(t: torch.Tensor) -> bool:
    """``t``'s device runs TMA: a Hopper or later GPU, or the interpreter, which emulates it."""
    if t.is_cuda:
        return _cuda_major(t.device.index) >= TMA_MIN_CAPABILITY
    return interpreting()


def tma_usable(a: torch.Tensor, b: BOperand) -> bool:
    """TMA loads need a Hopper GPU (or the interpreter, which emulates them) and aligned strides."""
    if not _has_tma(a):
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


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelOptions:
    """How the persistent kernel is built, beside its tile (the defaults are the measured best,
    ``docs/perf-notes.md``, "The signalled GEMM at cuBLAS speed (one H200)").

    ``flatten``: one flattened, software-pipelined loop over (tile, k) (``tl.range(flatten=True)``),
    so the next tile's loads are in flight during this tile's epilogue; TMA loads only (the
    masked-pointer path keeps a loop per tile). Measured +0.4-6% over a loop per tile.
    ``subtile``: the epilogue stores its tile in 1, 2 or 4 column pieces (within noise of each
    other; 2 is never worse than 1% behind). ``tma_store``: the epilogue stores through a TMA
    descriptor and waits for the writes before the signal (1-2% slower than plain stores on the
    large shapes, 20% at 2048x4096x4096); None: wherever the layout and strides allow it.
    ``stream_k``: when the tiles leave a last, partial wave, its tiles' K blocks are shared out
    over the programs (``stream_k_split``), so the last wave takes its share of the time instead
    of a whole tile's. None: where the measured rule says it pays (it saves each program at least
    ``STREAM_K_MIN_SAVED_BLOCKS`` of a tile's K blocks); True: for every partial last wave; False:
    never. For a ping-pong tile (``Tile.pingpong``) it is the kernel's K-split tail instead
    (``fo_kernels.plan.pingpong_parts``: each tail tile's K blocks in 2-4 parts, one program each,
    before its whole tiles), which None runs, before the split tail, where its parts fit and the
    call has ``SPLIT_MIN_MACS`` multiply-adds; True wherever its parts fit.
    ``defer_signal``: each tile's signal is sent at the next tile's epilogue
    (the last after the loop), so the release fence waits on stores issued a tile earlier instead
    of stalling the CTA on those just issued: +0-4% at full grid on 9 of 9 shapes (0.918 -> 0.959x
    cuBLAS at 8192x4096x2048); a group then completes up to one tile's time later (the last group
    does not: its last tiles have no next tile).
    ``split_tail``: when the last, partial wave holds at most half the grid, its tiles are cut into
    halves or quarters (``tail_split``) that run as one wave of pieces (in a launch of their own,
    ``SPLIT_WARPS`` warps each): a wave of 128x128 pieces of 128x256 tiles took 0.53-0.58 of a whole
    tile's wave, of 64x128 pieces 0.36-0.38. None: where ``tail_split`` cuts (calls of at least
    ``SPLIT_MIN_MACS`` multiply-adds, and the pieces fit the grid; before stream-K, which it
    matched wherever both apply); True: every partial last wave (halves at least, on as many
    programs as there are pieces, which may exceed the grid); False: never. ``stream_k=True``
    takes precedence. ``stream_k_aligned``: the stream-K tail's programs run their K blocks in the
    order that keeps them at three K offsets from a common step (``_sk_step``), so that programs
    read the same A and B blocks together, as a wave's do: forced stream-K gained 0.1-6.4% over
    each program's run in order at K >= 9472 (12 of 12 shape-grid pairs) and 7.3% at
    3000x5120x6912 on 124 programs, within 1.2% elsewhere; off: each program's run in order, from
    scattered K blocks. ``fuse_tail``: the last partial wave runs in the whole waves' launch, each
    program going on to its piece of the split tail (the launch's warps, not ``SPLIT_WARPS``) or
    its stream-K runs once its last whole tile is done, so a call is one launch: on the GPU within
    the timing's noise of the tail's own launch (-1.4..+3.5%, mean +0.6% over 40 shape-grid
    pairs), and 21-57% faster where the calls are bound by their host's launches
    (2048x4096x4096, forced stream-K); a forced split whose pieces outnumber the programs keeps
    its own launch. Off: a launch of its own (``docs/perf-notes.md``, "The tail in the whole
    waves' launch" and the "Measured" section after it).
    """

    flatten: bool = True
    subtile: int = 2
    tma_store: bool | None = False
    stream_k: bool | None = None
    defer_signal: bool = True
    split_tail: bool | None = None
    stream_k_aligned: bool = True
    fuse_tail: bool = True

    def __post_init__(self) -> None:
        if self.subtile not in SUBTILES:
            raise ScheduleError(f"subtile: must be one of {SUBTILES}, got {self.subtile!r}")


SUBTILES = (1, 2, 4)
# The split tail's pieces (``tail_split``) have this many warps: one warpgroup fed 128x128 and
# 64x128 pieces at least as fast as two (docs/perf-notes.md, "The split tail").
SPLIT_WARPS = 4
DEFAULT_OPTIONS = KernelOptions()


def _tail_buffers(
    a: torch.Tensor, tile: Tile, grid: int, tail: TailPlan, num_tiles: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(arrive, partial, stream-K programs) of the last partial wave ``tail`` runs apart from the
    whole waves: a zeroed arrival count per tail tile (the split tail's pieces, the stream-K tail's
    or the ping-pong kernel's K-split tail's parts arrive on it), float32 tile slots for the parts
    (two a program for stream-K, one a part for the K-split tail) and the stream-K tail's programs
    (0: none); ``a`` for a buffer the tail does not read. From torch's allocator on the current
    stream, so calls on other streams never share them."""
    tail_tiles = num_tiles - tail.main_tiles
    if tail.split == (1, 1) and not tail.share and not tail.parts:
        return a, a, 0
    arrive = torch.zeros(tail_tiles, dtype=torch.int32, device=a.device)
    slots = 2 * grid if tail.share else tail_tiles * tail.parts
    partial = a
    if slots:
        partial = torch.empty(slots * tile.block_m * tile.block_n, dtype=torch.float32, device=a.device)
    k_tiles = cdiv(a.shape[1], tile.block_k)
    return arrive, partial, cdiv(tail_tiles * k_tiles, tail.share) if tail.share else 0


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


def _store_desc(out: torch.Tensor, plan: Plan, tile: Tile, subtile: int, want: bool | None) -> object | None:
    """The TMA descriptor the epilogue stores through (``store_view``, in pieces of BLOCK_N //
    subtile columns), or None where it cannot (or must not)."""
    if want is False or not _has_tma(out):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    width = tile.block_n // subtile
    view = store_view(out, plan, tile)
    if view is None or width * out.element_size() < TMA_ALIGN_BYTES:
        return None
    return TensorDescriptor.from_tensor(view, [tile.block_m, width])


def _meta(
    a: torch.Tensor, b: BOperand, out: torch.Tensor, tile: Tile, use_tma: bool, flatten: bool, subtile: int
) -> Mapping[str, object]:
    """The kernels' compile-time arguments the launchers share (operands, dtypes, tile, options:
    ``flatten`` as ``KernelOptions.flatten``, which needs TMA loads; ``subtile`` the pieces)."""
    return _meta_of(a.dtype, out.dtype, b.kmajor, tile, use_tma, flatten and use_tma, subtile, interpreting())


@functools.lru_cache(maxsize=256)
def _meta_of(
    a_dtype: torch.dtype, out_dtype: torch.dtype, kmajor: bool, tile: Tile, use_tma: bool, flatten: bool,
    subtile: int, interp: bool,
) -> Mapping[str, object]:  # fmt: skip
    """``_meta``'s mapping, built once per distinct launch (read-only: every launch shares it)."""
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
            FLATTEN=flatten,
            SUBTILE=subtile,
            PTX=not interp,  # inline PTX (barrier, TMA store wait) in compiled kernels only
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
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
    options: KernelOptions = DEFAULT_OPTIONS,
) -> None:
    """Launch the persistent GEMM on the current stream, writing ``out`` in the plan's layout.

    ``a`` must be row-major (M, K); ``out`` a flat buffer of ``plan.buffer_numel()`` elements.
    ``unit_group`` (int32, one per signal unit) and ``group_info`` (int32, (a0, a1 - a0) per group)
    are the plan's tables on the device; ``counters`` (int32) gets one release increment per tile
    at index ``unit_group[t // U]`` when ``signal`` is set. ``use_tma`` (loads) and
    ``options.tma_store`` override the automatic choices (tests time and check both paths).
    A ``tile.pingpong`` call runs the ping-pong kernel (``fo_kernels.gemm_pingpong``: TMA stores;
    its last partial wave as its own K-split tail, or as the split tail's pieces in this kernel's
    launch after it, as ``tail_plan`` says; of ``options`` only ``stream_k`` and ``split_tail``
    apply) where ``pingpong_blocker`` accepts it and ``use_tma`` is not False; else this kernel
    with the same tile, under this kernel's tail rules.
    """
    pingpong = tile.pingpong and use_tma is not False and not pingpong_blocker(a, b, out, plan, tile)
    m, k = a.shape
    n = b.tensor.shape[1]
    if pingpong:  # its own operands and store descriptors; the blocker found TMA loads usable
        a_arg = b_arg = desc = None
        use_tma, subtile = True, 1
    else:
        a_arg, b_arg, use_tma = _operand_args(a, b, tile, use_tma)
        subtile = min(options.subtile, tile.block_n // MIN_PIECE)
        desc = _store_desc(out, plan, tile, subtile, options.tma_store)
    # a ping-pong tile's tail runs in its kernel (the K-split tail) or the split tail's launch; where
    # the plain kernel runs the tile instead, that kernel's rules apply
    kernel_tile = tile if pingpong or not tile.pingpong else dataclasses.replace(tile, pingpong=False)
    tail = tail_plan(
        plan.num_tiles, plan.grid, kernel_tile, k, m * n * k, options.stream_k, options.split_tail
    )
    split, main_tiles, share = tail.split, tail.main_tiles, tail.share
    arrive, partial, tail_grid = _tail_buffers(a, tile, plan.grid, tail, plan.num_tiles)
    layout = LAYOUT_TILE_MAJOR if plan.layout == "tile_major" else LAYOUT_ROW_BAND

    def launch(grid: int, operands: tuple, meta: Mapping[str, object], **mode: object) -> None:
        _signalled_gemm_kernel[(grid,)](
            *operands, out, desc if desc is not None else out, counters, unit_group, group_info,
            m, n, k, plan.rows_per_shard, plan.tiles_m, plan.tiles_n, plan.num_tiles, plan.shards,
            plan.unit_tiles,
            counters, out,  # ready, out2: unused outside LAYOUT_ROWS
            arrive, partial, main_tiles, share,
            *_strides(a, b),
            DEFER=options.defer_signal,
            LAYOUT=layout,
            SIGNAL=signal,
            **mode,
            **meta,
        )  # fmt: skip

    unused = (counters, counters)  # operands a launch does not read: plain pointers, nothing to encode
    pieces = unused  # the split tail's operands (TMA descriptors of its pieces' blocks)
    if split != (1, 1):
        piece = dataclasses.replace(
            tile,
            block_m=tile.block_m // split[0],
            block_n=tile.block_n // split[1],
            num_warps=SPLIT_WARPS,
            pingpong=False,
        )
        pieces = _operand_args(a, b, piece, use_tma)[:2]
    # fused: one piece a program, so the pieces must fit the grid (a forced split's may not)
    fits = (plan.num_tiles - main_tiles) * split[0] * split[1] <= plan.grid
    # (the ping-pong kernel runs the whole waves alone: its split tail takes a launch of its own)
    fuse = split if options.fuse_tail and fits and not pingpong else (1, 1)
    fuse_sk = bool(tail_grid) and options.fuse_tail
    if pingpong:
        pingpong_gemm(
            a, b, out, plan, tile, counters=counters, unit_group=unit_group, group_info=group_info,
            signal=signal, tiles=main_tiles, parts=tail.parts, arrive=arrive, partial=partial,
        )  # fmt: skip
    else:
        meta = _meta(a, b, out, tile, use_tma, options.flatten, subtile)
        launch(
            plan.grid, (a_arg, b_arg, *(pieces if fuse != (1, 1) else unused)), meta, STREAM_K=False,
            TMA_STORE=desc is not None, FUSE_M=fuse[0], FUSE_N=fuse[1], FUSE_SK=fuse_sk,
            SK_ALIGN=options.stream_k_aligned and fuse_sk,
        )  # fmt: skip
    if tail_grid and not fuse_sk:  # the stream-K tail as a kernel of its own (the programs with a share)
        launch(
            tail_grid, (a_arg, b_arg, *unused), meta, STREAM_K=True, TMA_STORE=desc is not None,
            SK_ALIGN=options.stream_k_aligned,
        )  # fmt: skip
    elif split != (1, 1) and fuse == (1, 1):  # the split tail's own launch: one program a piece
        launch(
            (plan.num_tiles - main_tiles) * split[0] * split[1], (*pieces, *unused),
            _meta(a, b, out, piece, use_tma, False, 1), STREAM_K=False, TMA_STORE=False,
            SPLIT_M=split[0], SPLIT_N=split[1],
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
    options: KernelOptions = DEFAULT_OPTIONS,
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
    must be resident while others wait on ``ready``). Stores are plain (``options.tma_store`` is
    not used); the loop is not flattened while it waits on ``ready`` (a spin loop in the epilogue).
    """
    rows, k = a.shape
    n = b.tensor.shape[1]
    tiles_m, tiles_n = -(-rows // tile.block_m), -(-n // tile.block_n)
    a_arg, b_arg, use_tma = _operand_args(a, b, tile, use_tma)
    subtile = min(options.subtile, tile.block_n // MIN_PIECE)
    _signalled_gemm_kernel[(max(1, min(grid, tiles_m * tiles_n)),)](
        a_arg, b_arg, row_group, row_group,  # a_piece, b_piece: no split tail here
        out, out, counters if counters is not None else row_group, row_group,
        row_group,  # group_info: unused by LAYOUT_ROWS
        rows, n, k, rows, tiles_m, tiles_n, tiles_m * tiles_n, 1, 1,
        ready if ready is not None else row_group, out2 if out2 is not None else out,
        row_group, row_group, tiles_m * tiles_n, 0,  # no stream-K tail
        *_strides(a, b),
        STREAM_K=False,
        LAYOUT=LAYOUT_ROWS,
        SIGNAL=counters is not None,
        ACCUMULATE=ready is not None,
        COPY=out2 is not None,
        SYS_SIGNAL=remote_counters,
        TMA_STORE=False,
        **_meta(a, b, out, tile, use_tma, options.flatten and ready is None, subtile),
    )  # fmt: skip


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
