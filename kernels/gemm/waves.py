"""The signalled persistent GEMM's whole waves, and ``signalled_gemm``, the launcher of a call.

Math: C = A @ B with A (M, K), B (K, N) (row-major, or the transposed view of an (N, K) weight),
bf16/fp16/fp32 in, fp32 accumulation, output in the input dtype, written in the plan's layout.
fp8 (float8_e4m3fn) in: C = (A * scale_a) @ (B * scale_b), the scales applied to each tile's
float32 sum in the epilogue (``.epilogue._scale``), output in the call's ``out_dtype``.

Protocol, per persistent program p of G (symbols as in ``fo_kernels.plan`` and ``.tiles``):

    g' = -1                                          # the group stored but not yet signalled
    for t in p, p + G, p + 2G, ... < main_tiles:    # wave w = tiles [wG, (w+1)G)
        acc = sum over K of the tile (.tiles._tile_acc); fp8: acc *= its scales
        if g' >= 0: barrier; atomic_add(counter[g'], 1, release, gpu scope)
        g' = unit_group[t // U]; store acc at its layout position in group g''s chunk
    if g' >= 0: barrier; atomic_add(counter[g'], 1, release, gpu scope)
    then this program's piece of the split tail or its run of the stream-K tail (``.tail``)

Each tile's signal goes out at the next tile's epilogue, when its stores have long been issued
(signalled at once, the fence stalled the CTA on the stores just issued: 0-4% slower at full grid
on 9 of 9 shapes, 0.959 -> 0.918x cuBLAS at 8192x4096x2048; docs/perf-notes.md, "The
deferred signal"); a group then completes up to one tile's time later. The release increment
is cumulative over the CTA barrier (``.epilogue``). Counters are never reset: each call's targets
are the running totals the host keeps (see ``fo_kernels.runtime``), and every comparison is
wrap-around safe in int32.

With TMA loads the two loops (tiles, K blocks) are one flattened, software-pipelined loop
(``tl.range(flatten=True)``): the next tile's loads are in flight while a tile's epilogue runs
(+0.4% at K = 14336 to +6% at short K over a loop per tile; docs/perf-notes.md, "The signalled
GEMM at cuBLAS speed (one H200)"). The masked-pointer loads (strides that are not 16-byte aligned)
keep a loop per tile. The CTA barrier is inline PTX there (``tl.debug_barrier`` stops Triton 3.6
from pipelining the flattened loop).

The last, partial wave runs in the same launch (``_waves_split_kernel``, ``_waves_stream_k_kernel``):
one launch a call, within the timing's noise of a launch of its own on the GPU (-1.4..+3.5%, mean
+0.6% over 40 shape-grid pairs) and 21-57% faster where the calls are bound by their host's
launches (docs/perf-notes.md, "The tail in the whole waves' launch"). A ``Tile.pingpong`` tile runs
the warp-specialized ping-pong kernel instead (``.pingpong``: the same tile order, layouts and
signal; its last wave as its own K-split tail, or as the split tail's own launch after it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fo_kernels.gemm.epilogue import _finish_tile, _scale, _signal_if
from fo_kernels.gemm.operands import (
    BOperand,
    epilogue_pieces,
    kernel_meta,
    layout_code,
    operand_args,
    scale_args,
    strides,
)
from fo_kernels.gemm.pingpong import pingpong_blocker, pingpong_gemm
from fo_kernels.gemm.tail import _sk_tail, _split_piece, piece_tile, split_tail, tail_buffers
from fo_kernels.gemm.tiles import _tile_acc, _tile_pos
from fo_kernels.plan import Plan, tail_plan
from fo_kernels.scaling import Scales
from fo_kernels.tile import Tile


@triton.jit
def _whole_waves(
    pid, progs, k_tiles, a, b, out, counters, unit_group, group_info, scale_a, scale_b,
    M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, main_tiles,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr, FLATTEN: tl.constexpr,
    SUBTILE: tl.constexpr, PTX: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    """Program pid's tiles pid, pid + progs, ... < main_tiles, each signalled at the next one's
    epilogue (the last after the loop)."""
    # The epilogue recomputes its tile from a counter of its own (as Triton's persistent-matmul
    # tutorial does), so a flattened, pipelined loop's prologue (next tile's loads) and epilogue
    # (this tile's stores) share no value.
    tile_c = pid - progs
    prev_g = pid * 0 - 1  # the group of the tile stored but not yet signalled (-1: none)
    for t in tl.range(pid, main_tiles, progs, flatten=FLATTEN):
        _l, s, tm, tn = _tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
        row0 = s * rows_per_shard + tm * BLOCK_M
        acc = _tile_acc(
            a, b, row0, tn * BLOCK_N, 0, k_tiles, M, N, K,
            stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, B_KMAJOR, UPCAST, IEEE,
        )  # fmt: skip
        acc = _scale(acc, scale_a, scale_b, row0, tn * BLOCK_N, M, N, BLOCK_M, BLOCK_N, SCALE)
        tile_c += progs
        # the previous tile's stores were issued a whole tile ago, so its fence is short
        if SIGNAL:  # (a constexpr; the tensor test inside is a separate if)
            _signal_if(counters, prev_g, PTX)
        prev_g = _finish_tile(
            acc, tile_c, out, counters, unit_group, group_info, N, rows_per_shard, tiles_m, tiles_n,
            shards, unit_tiles, BLOCK_M, BLOCK_N, GROUP_M, LAYOUT, SIGNAL, OUT_DTYPE, SUBTILE, PTX, True,
        )  # fmt: skip
    if SIGNAL:
        _signal_if(counters, prev_g, PTX)


@triton.jit
def _waves_kernel(
    a, b, out, counters, unit_group, group_info, scale_a, scale_b,  # tensors (a, b: or TMA
    # descriptors; scale_a, scale_b: an fp8 call's scales, else unread)
    M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, main_tiles,  # sizes
    stride_am, stride_ak, stride_bk, stride_bn,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr, FLATTEN: tl.constexpr,
    SUBTILE: tl.constexpr, PTX: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    """The whole waves alone (tiles [0, main_tiles); a split tail, if any, runs after it)."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    _whole_waves(
        pid, progs, k_tiles, a, b, out, counters, unit_group, group_info, scale_a, scale_b,
        M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, main_tiles,
        stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        USE_TMA, B_KMAJOR, LAYOUT, SIGNAL, UPCAST, IEEE, OUT_DTYPE, FLATTEN, SUBTILE, PTX, SCALE,
    )  # fmt: skip


@triton.jit
def _waves_split_kernel(
    a, b, a_piece, b_piece, out, counters, unit_group, group_info, scale_a, scale_b, arrive,  # tensors
    # (a_piece, b_piece: the pieces' operands, TMA descriptors of their blocks or the tensors)
    M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, main_tiles, num_tiles,  # sizes
    stride_am, stride_ak, stride_bk, stride_bn,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr, FLATTEN: tl.constexpr,
    SUBTILE: tl.constexpr, PTX: tl.constexpr, SCALE: tl.constexpr, SPLIT_M: tl.constexpr,
    SPLIT_N: tl.constexpr,
):  # fmt: skip
    """The whole waves, then the split tail: a piece a program (SPLIT_M x SPLIT_N pieces a tile)."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    _whole_waves(
        pid, progs, k_tiles, a, b, out, counters, unit_group, group_info, scale_a, scale_b,
        M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, main_tiles,
        stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        USE_TMA, B_KMAJOR, LAYOUT, SIGNAL, UPCAST, IEEE, OUT_DTYPE, FLATTEN, SUBTILE, PTX, SCALE,
    )  # fmt: skip
    if pid < (num_tiles - main_tiles) * (SPLIT_M * SPLIT_N):
        _split_piece(
            pid, a_piece, b_piece, out, counters, unit_group, group_info, scale_a, scale_b, arrive,
            main_tiles, k_tiles, M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles,
            stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_M // SPLIT_M, BLOCK_N // SPLIT_N, BLOCK_K, GROUP_M, SPLIT_M, SPLIT_N, USE_TMA,
            B_KMAJOR, UPCAST, IEEE, LAYOUT, SIGNAL, OUT_DTYPE, PTX, SCALE,
        )  # fmt: skip


@triton.jit
def _waves_stream_k_kernel(
    a, b, out, counters, unit_group, group_info, scale_a, scale_b, arrive, partial,  # tensors
    M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, main_tiles, num_tiles,  # sizes
    sk_iters,  # the stream-K tail's K blocks a program
    stride_am, stride_ak, stride_bk, stride_bn,  # strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, LAYOUT: tl.constexpr, SIGNAL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, OUT_DTYPE: tl.constexpr, FLATTEN: tl.constexpr,
    SUBTILE: tl.constexpr, PTX: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    """The whole waves, then this program's run of the stream-K tail."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    _whole_waves(
        pid, progs, k_tiles, a, b, out, counters, unit_group, group_info, scale_a, scale_b,
        M, N, K, rows_per_shard, tiles_m, tiles_n, shards, unit_tiles, main_tiles,
        stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        USE_TMA, B_KMAJOR, LAYOUT, SIGNAL, UPCAST, IEEE, OUT_DTYPE, FLATTEN, SUBTILE, PTX, SCALE,
    )  # fmt: skip
    _sk_tail(
        pid, a, b, out, counters, unit_group, group_info, scale_a, scale_b, arrive, partial,
        M, N, K, rows_per_shard, tiles_m, tiles_n, num_tiles, shards, unit_tiles, main_tiles, sk_iters,
        k_tiles, stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, USE_TMA, B_KMAJOR, LAYOUT, SIGNAL, UPCAST, IEEE,
        OUT_DTYPE, SUBTILE, PTX, SCALE,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelOptions:
    """The last partial wave's choice, where a call wants another than the measured rules'.

    ``stream_k``: when the tiles leave a last, partial wave, its tiles' K blocks are shared out
    over the programs (``fo_kernels.plan.stream_k_split``), so the last wave takes its share of
    the time instead of a whole tile's. None: where the measured rule says it pays (it saves each
    program at least ``STREAM_K_MIN_SAVED_BLOCKS`` of a tile's K blocks); True: for every partial
    last wave; False: never. For a ping-pong tile (``Tile.pingpong``) it is the kernel's K-split
    tail instead (``fo_kernels.plan.pingpong_parts``: each tail tile's K blocks in 2-4 parts, one
    program each, before its whole tiles), which None runs, before the split tail, where its parts
    fit and the call has ``SPLIT_MIN_MACS`` multiply-adds; True wherever its parts fit.
    ``split_tail``: when the last, partial wave holds at most half the grid, its tiles are cut into
    halves or quarters (``fo_kernels.plan.tail_split``) that run as one wave of pieces: a wave of
    128x128 pieces of 128x256 tiles took 0.53-0.58 of a whole tile's wave, of 64x128 pieces
    0.36-0.38. None: where ``tail_split`` cuts (calls of at least ``SPLIT_MIN_MACS`` multiply-adds,
    and the pieces fit the grid; before stream-K, which it matched wherever both apply); True:
    every partial last wave (halves at least, on as many programs as there are pieces; where they
    outnumber the grid, in a launch of their own); False: never. ``stream_k=True`` takes
    precedence (docs/perf-notes.md, "The split tail", "The rule from the K blocks stream-K saves").
    """

    stream_k: bool | None = None
    split_tail: bool | None = None


DEFAULT_OPTIONS = KernelOptions()


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
    scales: Scales | None = None,
) -> None:
    """Launch the persistent GEMM on the current stream, writing ``out`` in the plan's layout.

    ``a`` must be row-major (M, K); ``out`` a flat buffer of ``plan.buffer_numel()`` elements.
    ``unit_group`` (int32, one per signal unit) and ``group_info`` (int32, (a0, a1 - a0) per group)
    are the plan's tables on the device; ``counters`` (int32) gets one release increment per tile
    at index ``unit_group[t // U]`` when ``signal`` is set. ``use_tma`` (loads) overrides the
    automatic choice (False: the masked-pointer loads on any operands). ``scales``: an fp8 call's
    (``fo_kernels.scaling``), applied to each tile in the epilogue; ``out`` in its ``out_dtype``.
    A ``tile.pingpong`` call runs the ping-pong kernel (``fo_kernels.gemm.pingpong``: TMA stores;
    its last partial wave as its own K-split tail, or as the split tail's pieces in a launch after
    it, as ``tail_plan`` says) where ``pingpong_blocker`` accepts it and ``use_tma`` is not False;
    else the plain kernels with the same tile, under their tail rules.
    """
    pingpong = tile.pingpong and use_tma is not False and not pingpong_blocker(a, b, out, plan, tile)
    m, k = a.shape
    n = b.tensor.shape[1]
    # where the plain kernels run a ping-pong tile, their tail rules apply
    kernel_tile = tile if pingpong or not tile.pingpong else dataclasses.replace(tile, pingpong=False)
    tail = tail_plan(
        plan.num_tiles, plan.grid, kernel_tile, k, m * n * k, options.stream_k, options.split_tail
    )
    arrive, partial, _ = tail_buffers(a, tile, plan.grid, tail, plan.num_tiles)
    # the split tail runs in the whole waves' launch, one piece a program, where its pieces fit
    # the grid (a forced split's may not) and the plain kernel runs the whole waves
    pieces = (plan.num_tiles - tail.main_tiles) * tail.split[0] * tail.split[1]
    own_split = tail.split != (1, 1) and (pingpong or pieces > plan.grid)
    if pingpong:  # its own operands and store descriptors; the blocker found TMA loads usable
        pingpong_gemm(
            a, b, out, plan, tile, counters=counters, unit_group=unit_group, group_info=group_info,
            signal=signal, tiles=tail.main_tiles, parts=tail.parts, arrive=arrive, partial=partial,
        )  # fmt: skip
        use_tma = True
    else:
        a_arg, b_arg, use_tma = operand_args(a, b, tile, use_tma)
        sizes = (m, n, k, plan.rows_per_shard, plan.tiles_m, plan.tiles_n, plan.shards, plan.unit_tiles)
        tables = (counters, unit_group, group_info, *scale_args(scales, counters))
        consts = dict(
            LAYOUT=layout_code(plan),
            SIGNAL=signal,
            FLATTEN=use_tma,  # the flattened loop needs TMA loads
            SUBTILE=epilogue_pieces(tile),
            **kernel_meta(a, b, out, tile, use_tma, scales),
        )
        if tail.share:
            _waves_stream_k_kernel[(plan.grid,)](
                a_arg, b_arg, out, *tables, arrive, partial, *sizes, tail.main_tiles, plan.num_tiles,
                tail.share, *strides(a, b), **consts,
            )  # fmt: skip
        elif tail.split != (1, 1) and not own_split:
            a_piece, b_piece, _ = operand_args(a, b, piece_tile(tile, tail.split), use_tma)
            _waves_split_kernel[(plan.grid,)](
                a_arg, b_arg, a_piece, b_piece, out, *tables, arrive, *sizes, tail.main_tiles,
                plan.num_tiles, *strides(a, b), SPLIT_M=tail.split[0], SPLIT_N=tail.split[1], **consts,
            )  # fmt: skip
        else:
            _waves_kernel[(plan.grid,)](
                a_arg, b_arg, out, *tables, *sizes, tail.main_tiles, *strides(a, b), **consts
            )
    if own_split:
        split_tail(
            a, b, out, plan, tile, tail, counters=counters, unit_group=unit_group,
            group_info=group_info, arrive=arrive, signal=signal, use_tma=use_tma, scales=scales,
        )  # fmt: skip
