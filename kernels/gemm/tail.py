"""The signalled GEMM's last, partial wave: the split tail and the stream-K tail.

Where the tiles leave a last wave of fewer tiles than programs, ``fo_kernels.plan.tail_plan``
picks how it runs (the tiles [main_tiles, T) after the whole waves):

    split tail (SPLIT_M x SPLIT_N pieces a tile, one program a piece):
        piece q: tile i = q // (SPLIT_M*SPLIT_N), its piece (pm, pn)
        acc = the piece's (BM/SPLIT_M) x (BN/SPLIT_N) sum over all of K; fp8: times its scales
        store acc at its place in the tile's layout position
        barrier; if atomic_add(arrive[i], 1, acq_rel) == pieces - 1:   # the tile's last piece
            signal the tile's group (it acquired the other pieces' stores)

    stream-K tail (the tail's K blocks, tile after tile, one run of `share` blocks a program):
        for each of the (at most two) tiles program p's run covers, in aligned order (_sk_step):
            partial[2p + slot] = its float32 sum over its K blocks of the tile
            barrier; if atomic_add(arrive[i], 1, acq_rel) == programs on tile i - 1:
                total = the tile's parts added in program order (the same bits whoever is last)
                fp8: total *= its scales
                store total at the tile's layout position; signal its group

Both run in the whole waves' launch, each program going on to its piece or its run once its last
whole tile is done (``fo_kernels.gemm.waves``). The split tail also has a launch of its own
(``_split_tail_kernel``): after the ping-pong kernel's whole waves, and where a forced split's
pieces outnumber the programs. Measured: ``docs/perf-notes.md``, "The split tail", "The tail in
the whole waves' launch" and "The rule from the K blocks stream-K saves".
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from fo_kernels.gemm.epilogue import _cta_barrier, _finish_tile, _scale, _signal, _store_piece
from fo_kernels.gemm.operands import BOperand, kernel_meta, layout_code, operand_args, scale_args, strides
from fo_kernels.gemm.tiles import _tile_acc, _tile_acc_into, _tile_dst, _tile_pos
from fo_kernels.plan import Plan, TailPlan, cdiv
from fo_kernels.scaling import Scales
from fo_kernels.tile import Tile

# The split tail's own launch gives its pieces this many warps: one warpgroup fed 128x128 and
# 64x128 pieces at least as fast as two (a probe on one H200: a wave of 128x128 pieces took 22.7 us
# on 4 warps, 23.6 on 8; docs/perf-notes.md, "The split tail"). In the whole waves' launch the
# pieces run on that launch's warps.
SPLIT_WARPS = 4


@triton.jit
def _sk_step(pid, j: tl.constexpr, sk_iters, tail_iters, k_tiles):
    """Step j (0 or 1) of program pid in the stream-K tail: (valid, tail tile, slot, K blocks
    [k0, k1), then [k2, k3), summed into one part).

    The tail's K blocks, tile after tile, are cut into one run of ``sk_iters`` per program: the
    suffix of a tile (slot 0), then the next tile's prefix (slot 1), or one stretch inside a tile.
    A program with a prefix runs it first, so it reads K block tau at its step tau and, in its
    suffix, K block tau + k_tiles - sk_iters; a stretch [s, s + L) inside a tile with s <= L runs
    [L, s + L) first, then [s, L) at step s on: every program is at one of three K offsets (0,
    k_tiles - sk_iters, sk_iters) from the common step, and the programs at one offset read the
    same A rows' and B columns' K blocks together, as a wave does. (Each program's run in order,
    from scattered K blocks, was 0.1-6.4% slower at K >= 9472 and 7.3% at 3000x5120x6912 on 124
    programs: docs/perf-notes.md, "Tried and dropped", unaligned stream-K.)"""
    lo = pid * sk_iters
    hi = tl.minimum(lo + sk_iters, tail_iters)
    first_tile = lo // k_tiles
    s = lo - first_tile * k_tiles
    two = hi > (first_tile + 1) * k_tiles  # a suffix, then the next tile's prefix
    end = tl.minimum(hi - first_tile * k_tiles, k_tiles)
    slot = tl.where(two, 1 - j, j)  # the prefix first
    valid = (lo < hi) & (two | (j == 0))
    k0 = tl.where(slot == 1, 0, s)
    k1 = tl.where(slot == 1, hi - (first_tile + 1) * k_tiles, end)
    k2 = k1 * 0
    k3 = k1 * 0
    length = end - s
    rotate = (slot == 0) & (s > 0) & (end < k_tiles) & (s <= length)
    k0 = tl.where(rotate, length, k0)
    k2 = tl.where(rotate, s, k2)
    k3 = tl.where(rotate, length, k3)
    return valid, first_tile + slot, slot, k0, k1, k2, k3


@triton.jit
def _split_piece(
    q, a, b, out, counters, unit_group, group_info, scale_a, scale_b, arrive, main_tiles, k_tiles,
    M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_M: tl.constexpr, SPLIT_N: tl.constexpr, USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PTX: tl.constexpr, SCALE: tl.constexpr,
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
    row0 = s * rows_per_shard + tm * TILE_M + pm * BLOCK_M
    col0 = tn * TILE_N + pn * BLOCK_N
    acc = _tile_acc(
        a, b, row0, col0, 0, k_tiles, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
    )  # fmt: skip
    acc = _scale(acc, scale_a, scale_b, row0, col0, M, N, BLOCK_M, BLOCK_N, SCALE)
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
        acc, 0, BLOCK_N, base, out, dst_row0 + pm * BLOCK_M, SPLIT_M * slot + pm,
        local_row0 + pm * BLOCK_M, col0 + pn * BLOCK_N, rows_per_shard, N,
        BLOCK_M, TILE_N, LAYOUT, False, False, OUT_DTYPE,
    )  # fmt: skip
    if SIGNAL:
        _cta_barrier(PTX)
        done = tl.atomic_add(arrive + i, 1, sem="acq_rel", scope="gpu")
        if done == PIECES - 1:  # the others' stores are acquired: the signal covers them
            _signal(counters, g, PTX, False)


@triton.jit
def _sk_tail(
    pid, a, b, out, counters, unit_group, group_info, scale_a, scale_b, arrive, partial,
    M, N, K, rows_per_shard, tiles_m, tiles_n, num_tiles, shards, unit_tiles, main_tiles, sk_iters,
    k_tiles, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr, SUBTILE: tl.constexpr,
    PTX: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    """Program pid's part of the stream-K tail (tiles [main_tiles, num_tiles), fewer than a wave):
    its K blocks, tile after tile, cut into one run of sk_iters per program, so each program covers
    parts of at most two tiles (``_sk_step``: which, in which order). Each part's float32 sum goes
    to this program's slot; the last of a tile's programs to arrive adds the others' parts and
    finishes the tile (stores and signal)."""
    tail_iters = (num_tiles - main_tiles) * k_tiles
    for j in tl.static_range(2):
        valid, i, slot, k0, k1, k2, k3 = _sk_step(pid, j, sk_iters, tail_iters, k_tiles)
        if valid:
            t = main_tiles + i
            _l, s, tm, tn = _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
            acc = _tile_acc(
                a, b, s * rows_per_shard + tm * BLOCK_M, tn * BLOCK_N, k0, k1, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
            )  # fmt: skip
            acc = _tile_acc_into(  # a stretch inside a tile, in two runs
                acc, a, b, s * rows_per_shard + tm * BLOCK_M, tn * BLOCK_N, k2, k3, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn,
                BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
            )  # fmt: skip
            in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(partial + (pid * 2 + slot).to(tl.int64) * (BLOCK_M * BLOCK_N) + in_tile, acc)
            _cta_barrier(PTX)
            first = (i * k_tiles) // sk_iters  # the programs that cover tile i: first..last
            last = ((i + 1) * k_tiles - 1) // sk_iters
            arrived = tl.atomic_add(arrive + i, 1, sem="acq_rel", scope="gpu")
            if arrived == last - first:  # every part is written: add them in program order
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (the same bits whoever is last)
                for q in range(first, last + 1):  # its own part too: acc is dead after its store
                    jq = ((q * sk_iters) // k_tiles < i).to(tl.int32)  # tile i: q's slot 0 or 1
                    part = partial + (q * 2 + jq).to(tl.int64) * (BLOCK_M * BLOCK_N) + in_tile
                    total += tl.load(part, cache_modifier=".cg")
                total = _scale(
                    total, scale_a, scale_b, s * rows_per_shard + tm * BLOCK_M, tn * BLOCK_N, M, N,
                    BLOCK_M, BLOCK_N, SCALE,
                )  # fmt: skip
                _finish_tile(
                    total, t, out, counters, unit_group, group_info, N, rows_per_shard, tiles_m,
                    tiles_n, shards, unit_tiles, BLOCK_M, BLOCK_N, GROUP_M, LAYOUT, SIGNAL, OUT_DTYPE,
                    SUBTILE, PTX, False,
                )  # fmt: skip


@triton.jit
def _split_tail_kernel(
    a, b, out, counters, unit_group, group_info, scale_a, scale_b, arrive,  # tensors (a, b: or the
    # pieces' descriptors; scale_a, scale_b: an fp8 call's scales, else unread)
    M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, main_tiles,  # sizes
    stride_am, stride_ak, stride_bk, stride_bn,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_M: tl.constexpr, SPLIT_N: tl.constexpr, USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PTX: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    """The split tail in a launch of its own: one piece (BLOCK_M x BLOCK_N) a program."""
    _split_piece(
        tl.program_id(0), a, b, out, counters, unit_group, group_info, scale_a, scale_b, arrive,
        main_tiles, tl.cdiv(K, BLOCK_K), M, N, K, rows_per_shard, tiles_m, tiles_n, shards,
        unit_tiles, stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_M, SPLIT_N, USE_TMA, B_KMAJOR, UPCAST, IEEE,
        LAYOUT, SIGNAL, OUT_DTYPE, PTX, SCALE,
    )  # fmt: skip


def tail_buffers(
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


def piece_tile(tile: Tile, split: tuple[int, int]) -> Tile:
    """The split tail's piece: the tile cut SPLIT_M x SPLIT_N, on ``SPLIT_WARPS`` warps."""
    return dataclasses.replace(
        tile,
        block_m=tile.block_m // split[0],
        block_n=tile.block_n // split[1],
        num_warps=SPLIT_WARPS,
        pingpong=False,
    )


def split_tail(
    a: torch.Tensor,
    b: BOperand,
    out: torch.Tensor,
    plan: Plan,
    tile: Tile,
    tail: TailPlan,
    *,
    counters: torch.Tensor,
    unit_group: torch.Tensor,
    group_info: torch.Tensor,
    arrive: torch.Tensor,
    signal: bool,
    use_tma: bool,
    scales: Scales | None = None,
) -> None:
    """Launch the split tail of ``tail`` on the current stream, one program a piece (after a launch
    that ran the tiles before ``tail.main_tiles``); ``arrive`` from ``tail_buffers``; ``scales``
    an fp8 call's."""
    m, k = a.shape
    piece = piece_tile(tile, tail.split)
    a_arg, b_arg, use_tma = operand_args(a, b, piece, use_tma)
    pieces = (plan.num_tiles - tail.main_tiles) * tail.split[0] * tail.split[1]
    _split_tail_kernel[(pieces,)](
        a_arg, b_arg, out, counters, unit_group, group_info, *scale_args(scales, counters), arrive,
        m, plan.n, k, plan.rows_per_shard, plan.tiles_m, plan.tiles_n, plan.shards, plan.unit_tiles,
        tail.main_tiles, *strides(a, b),
        SPLIT_M=tail.split[0],
        SPLIT_N=tail.split[1],
        LAYOUT=layout_code(plan),
        SIGNAL=signal,
        **kernel_meta(a, b, out, piece, use_tma, scales),
    )  # fmt: skip
