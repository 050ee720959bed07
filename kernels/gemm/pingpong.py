"""The warp-specialized ping-pong kernel of the signalled persistent GEMM (Hopper, Gluon).

The same protocol as ``fo_kernels.gemm.waves`` (tile order, layouts, groups, one release increment
of the tile's group counter per tile), written out in Triton's Gluon dialect with three partitions per
program:

- a loader warp: TMA loads of each tile's A and B blocks into a ring of ``num_stages`` shared
  memory stages (``ready`` / ``empty`` mbarriers per stage);
- two consumer warpgroups that take the program's tiles in turn (local tiles 0, 2, 4, ... and
  1, 3, 5, ...). A consumer starts a tile's wgmma main loop only once the other has finished the
  previous tile's (``turn`` mbarriers), so the stages are consumed in the loader's order, and one
  consumer's epilogue (its TMA store and signal) runs while the other's main loop does.

A consumer's epilogue: the float32 sum in the output dtype into its own shared memory buffer, one
TMA store at the tile's layout position, then (``SIGNAL``) a wait until the store is written
(``cp.async.bulk.wait_group 0``, not ``.read``, and the async-proxy fence), the partition's
barrier, and one release increment (GPU scope) of the group counter, which covers the whole
warpgroup's part by cumulativity. The wait is hidden behind the
other consumer's main loop, so nothing defers the signal.

Triton's automatic warp specialization does not serve here: on sm_90 it builds only 4-warp loops
that are not flattened, and there it dropped the release atomic or refused the deferred signal
(``docs/perf-notes.md``, "Warp specialization on sm_90"). The kernel runs the schedule's first
``tiles`` tiles in its persistent loop; given ``parts``, the rest (fewer than a wave) is its
K-split tail, run first: each tail tile's K blocks in ``parts`` ranges, one program each as its
first item, the last of them to arrive adding the float32 parts and finishing the tile while the
program's other consumer runs its first whole tile (so the fix-up is off the critical path); else
``fo_kernels.gemm.signalled_gemm`` runs a split tail after it (``fo_kernels.gemm.tail``). Measured:
``docs/perf-notes.md``, "The product kernel (``fo_kernels.gemm.pingpong``, ``Tile.pingpong``)",
"The K-split tail in the ping-pong kernel" and "The K-split tail run first".

``pingpong_blocker`` says why a call cannot use it (the caller then runs the plain kernel); the
kernel is defined on first use, so importing this module needs no Gluon.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from fo_kernels.gemm.operands import (
    LAYOUT_ROW_BAND,
    LAYOUT_TILE_MAJOR,
    BOperand,
    cuda_major,
    interpreting,
    store_view,
    tma_usable,
)
from fo_kernels.tile import PINGPONG_WARPS, Tile

if TYPE_CHECKING:
    from fo_kernels.plan import Plan

# setmaxnreg's split of the register file (65536 32-bit registers per SM): 232 a thread for the
# two consumer warpgroups (a 128x128 float32 accumulator is 128 of them) and 40 for the loader's
# warpgroup slot, 232 * 256 + 40 * 128 <= 65536. The kernel is compiled at MAXNREG before the
# split (ptxas: no spills at 168 for 128x128x64 in 3-5 stages, compiled for sm_90a on the CPU).
CONSUMER_REGS = 232
LOADER_REGS = 40
MAXNREG = 168
# Hopper's wgmma (sm_90); later GPUs drop it (tcgen05 on sm_100).
PINGPONG_CAPABILITY = 9
PINGPONG_DTYPES = (torch.bfloat16, torch.float16)


def pingpong_blocker(a: torch.Tensor, b: BOperand, out: torch.Tensor, plan: Plan, tile: Tile) -> str:
    """Why the ping-pong kernel cannot run this call ("" when it can): it needs a Hopper GPU (not
    the interpreter), 16-bit inputs and output of one dtype, an (N, K) weight (k-major B), TMA loads
    (16-byte aligned strides) and a TMA store view of the destination (``fo_kernels.gemm.store_view``)."""

    if not tile.pingpong:
        return "the tile does not ask for it"
    if interpreting() or not a.is_cuda:
        return "it runs on CUDA GPUs only (not under TRITON_INTERPRET)"
    if cuda_major(a.device.index) != PINGPONG_CAPABILITY:
        return "it needs a Hopper GPU (compute capability 9.x: wgmma)"
    if a.dtype not in PINGPONG_DTYPES or out.dtype != a.dtype or b.tensor.dtype != a.dtype:
        return "it takes bfloat16 or float16 inputs and output of one dtype"
    if not b.kmajor:
        return "B must be the transposed view of an (N, K) weight"
    if not tma_usable(a, b):
        return "TMA loads need 16-byte aligned strides"
    if store_view(out, plan, tile) is None:
        return "the destination has no TMA store view"
    try:
        _kernel()
    except ImportError as exc:  # a Triton without Gluon's Hopper modules
        return f"this Triton has no Gluon for Hopper ({exc})"
    return ""


def pingpong_gemm(
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
    tiles: int | None = None,
    parts: int = 0,
    arrive: torch.Tensor | None = None,
    partial: torch.Tensor | None = None,
) -> None:
    """Launch the ping-pong kernel on the current stream (``fo_kernels.gemm.signalled_gemm``'s
    contract, for a call ``pingpong_blocker`` accepts): ``out`` in the plan's layout, one release
    increment of ``counters[unit_group[t // U]]`` per tile t when ``signal`` is set. ``tiles``:
    only the schedule's first tiles in its whole waves (default all). ``parts`` (>= 2): the tiles
    after them, fewer than a wave, run as the K-split tail (``fo_kernels.plan.pingpong_parts``),
    each tile's K blocks cut into ``parts`` ranges, one program each, before its whole tiles; it
    needs ``arrive`` (int32, a zero per tail tile) and ``partial`` (float32, a tile per part)."""
    kernel = _kernel()
    desc = _descriptor()
    m, k = a.shape
    n = b.tensor.shape[1]
    main_tiles = plan.num_tiles if tiles is None else tiles
    tail_tiles = plan.num_tiles - main_tiles if parts else 0
    if tail_tiles and (arrive is None or partial is None):
        raise ValueError("the K-split tail needs its arrival counts (arrive) and float32 parts (partial)")
    if not tail_tiles:
        arrive = partial = counters  # not read
    view = store_view(out, plan, tile)
    a_desc = desc(a, [tile.block_m, tile.block_k])
    b_desc = desc(b.tensor.t(), [tile.block_n, tile.block_k])
    c_desc = desc(view, [tile.block_m, tile.block_n])
    kernel[(plan.grid,)](
        a_desc, b_desc, c_desc, counters, unit_group, group_info, arrive, partial,
        m, n, k, plan.rows_per_shard, plan.tiles_m, plan.tiles_n, main_tiles, tail_tiles,
        max(1, parts), plan.shards, plan.unit_tiles,
        tile.num_stages, tile.group_m, LAYOUT_TILE_MAJOR if plan.layout == "tile_major" else LAYOUT_ROW_BAND,
        signal, tail_tiles > 0, CONSUMER_REGS, LOADER_REGS,
        num_warps=PINGPONG_WARPS, maxnreg=MAXNREG,
    )  # fmt: skip


@functools.cache
def _descriptor():
    """``desc(tensor, block)``: a host TMA descriptor with the default NVMMA shared layout."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtypes = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}

    def desc(t: torch.Tensor, block: list[int]) -> object:
        layout = gl.NVMMASharedLayout.get_default_for(block, dtypes[t.dtype])
        return TensorDescriptor.from_tensor(t, block, layout)

    return desc


@functools.cache
def _kernel():
    """Define the Gluon kernel (once): Gluon is imported only by a call that runs it."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # A partition's barrier (its warps' named barrier): Triton 3.6 calls it thread_barrier, 3.7 barrier.
    barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # The TMA copies: Triton 3.6 and 3.7 call them async_copy_global_to_shared and
    # async_copy_shared_to_global; 3.9 renames them async_load and async_store (the old names raise).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @gluon.jit
    def tile_pos(t, shards, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """Tile t -> (local position l, shard s, tile row, tile column), as ``.tiles._tile_pos``."""
        lt = t // shards
        s = t % shards
        per_band = GROUP_M * tiles_n
        first = (lt // per_band) * GROUP_M
        rows_in_band = gl.minimum(tiles_m - first, GROUP_M)
        tm = first + (lt % per_band) % rows_in_band
        tn = (lt % per_band) // rows_in_band
        return lt, s, tm, tn

    @gluon.jit
    def has_part(pid, tail_tiles, parts):
        """1 where program pid runs a part of the K-split tail (programs [0, tail_tiles x parts)), else 0."""
        return (pid < tail_tiles * parts).to(gl.int32)

    @gluon.jit
    def item_count(pid, progs, main_tiles, part):
        """How many items program pid runs: its part of the K-split tail (``part``: 0 or 1), then
        its whole tiles of the whole waves."""
        return part + gl.cdiv(main_tiles - pid, progs)

    @gluon.jit
    def item(j, pid, progs, main_tiles, parts, k_tiles, part, KSPLIT: gl.constexpr):
        """Program pid's item j: (tile, its K blocks [k0, k1)). With ``part`` set, item 0 is the
        program's part of the K-split tail: tile main_tiles + pid // parts, its K range pid % parts
        of parts. The other items are whole tiles of the whole waves: pid, pid + progs, ..."""
        t = pid + (j - part) * progs
        k0 = gl.to_tensor(0)
        k1 = k_tiles
        if KSPLIT:  # noqa: SIM102 (a compile-time test: launches without a tail compile no part)
            if j < part:
                p = pid % parts
                t = main_tiles + pid // parts
                k0 = p * k_tiles // parts
                k1 = (p + 1) * k_tiles // parts
        return t, k0, k1

    @gluon.jit
    def loader(
        a_desc, b_desc, a_bufs, b_bufs, empty, ready, K, rows_per_shard, tiles_m, tiles_n, main_tiles,
        tail_tiles, parts, shards, GROUP_M: gl.constexpr, KSPLIT: gl.constexpr,
    ):  # fmt: skip
        """The program's items in order, each item's K blocks into the ring's next stages."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        S: gl.constexpr = a_bufs.shape[0]
        k_tiles = gl.cdiv(K, BK)
        pid = gl.program_id(0)
        progs = gl.num_programs(0)
        part = has_part(pid, tail_tiles, parts)
        i = 0
        for j in range(item_count(pid, progs, main_tiles, part)):
            t, k0, k1 = item(j, pid, progs, main_tiles, parts, k_tiles, part, KSPLIT)
            _lt, s, tm, tn = tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
            row0 = s * rows_per_shard + tm * BM
            for kk in range(k0, k1):
                st = i % S
                mbarrier.wait(empty.index(st), ((i // S) & 1) ^ 1)  # a stage's first use passes at once
                mbarrier.expect(ready.index(st), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma_load(a_desc, [row0, kk * BK], ready.index(st), a_bufs.index(st))
                tma_load(b_desc, [tn * BN, kk * BK], ready.index(st), b_bufs.index(st))
                i += 1

    @gluon.jit
    def stores_written():
        """This thread's TMA stores are written and ordered before its later generic accesses."""
        gl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
            "=r",
            [],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def finish(
        acc, t, c_desc, c_smem, counters, unit_group, group_info, tiles_m, tiles_n, shards, unit_tiles,
        GROUP_M: gl.constexpr, LAYOUT: gl.constexpr, SIGNAL: gl.constexpr,
    ):  # fmt: skip
        """Tile t's epilogue: its sum through c_smem in one TMA store at the layout position
        (``fo_kernels.gemm.tiles._tile_dst``: its group's chunk, row_band rows or a tile-major slot),
        then (SIGNAL) the wait for the store's write and one release increment of its group."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        lt, s, tm, tn = tile_pos(t, shards, tiles_m, tiles_n, GROUP_M)
        g = gl.load(unit_group + t // unit_tiles)
        base = gl.load(group_info + 2 * g)
        span = gl.load(group_info + 2 * g + 1)
        tma.store_wait(0)  # this consumer's previous tile has left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        if LAYOUT == 1:
            slot = shards * base + s * span + (lt - base)
            tma_store(c_desc, [slot * BM, 0], c_smem)
        else:
            dst_row0 = shards * base + s * span + (tm * BM - base)
            tma_store(c_desc, [dst_row0, tn * BN], c_smem)
        if SIGNAL:
            stores_written()
            barrier()
            gl.atomic_add(counters + g, 1, sem="release", scope="gpu")

    @gluon.jit
    def part_sum(partial, slot0, count, BM: gl.constexpr, BN: gl.constexpr):
        """The float32 sum of ``count`` parts in slots slot0, slot0 + 1, ... of ``partial``, added
        in slot order, each part read a warp's row at a time: coalesced, where the accumulator's
        layout reads 8-byte pieces of many rows (a 4-part sum took 27 us in it, 19 us so, against
        the other consumer's 22 us main loop: docs/perf-notes.md, "The fix-up's reads")."""
        layout: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0]
        )
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        in_tile = gl.expand_dims(rows, 1) * BN + gl.expand_dims(cols, 0)
        total = gl.zeros((BM, BN), gl.float32, layout)
        for q in range(count):
            total += gl.load(partial + (slot0 + q).to(gl.int64) * (BM * BN) + in_tile, cache_modifier=".cg")
        return total

    @gluon.jit
    def consumer(
        a_desc, b_desc, c_desc, a_bufs, b_bufs, c_smem, empty, ready, turn, counters, unit_group,
        group_info, arrive, partial, K, tiles_m, tiles_n, main_tiles, tail_tiles, parts, shards,
        unit_tiles, ME: gl.constexpr, GROUP_M: gl.constexpr, LAYOUT: gl.constexpr,
        SIGNAL: gl.constexpr, KSPLIT: gl.constexpr,
    ):  # fmt: skip
        """Consumer ME of 2: the program's items ME, ME + 2, ... A whole tile is finished at once
        (``finish``); a part of the K-split tail (item 0) stores its float32 sum in the program's
        slot of ``partial``, and the last of the tile's programs to arrive adds the tile's parts in
        order (the same bits whoever is last) and finishes the tile, while the other consumer runs
        item 1's main loop."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        S: gl.constexpr = a_bufs.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
        )
        k_tiles = gl.cdiv(K, BK)
        progs = gl.num_programs(0)
        pid = gl.program_id(0)
        part = has_part(pid, tail_tiles, parts)
        _t, pk0, pk1 = item(0, pid, progs, main_tiles, parts, k_tiles, part, KSPLIT)
        part_blocks = (pk1 - pk0) * part  # the ring stages item 0 takes when it is a part
        for j in range(ME, item_count(pid, progs, main_tiles, part), 2):
            if j > 0:  # the other consumer's main loop of item j - 1 is done
                mbarrier.wait(turn.index(1 - ME), ((j - 1) // 2) & 1)
            t, k0, k1 = item(j, pid, progs, main_tiles, parts, k_tiles, part, KSPLIT)
            # the ring's position: the items before j are the part (if any), then whole tiles
            i0 = k_tiles * 0
            if j > 0:
                i0 = (j - part) * k_tiles + part_blocks
            acc = gl.zeros((BM, BN), gl.float32, acc_layout)
            for kk in range(k1 - k0):
                i = i0 + kk
                st = i % S
                mbarrier.wait(ready.index(st), (i // S) & 1)
                acc = warpgroup_mma(
                    a_bufs.index(st), b_bufs.index(st).permute((1, 0)), acc, use_acc=kk > 0, is_async=True
                )
                acc = warpgroup_mma_wait(1, deps=(acc, a_bufs.index(st), b_bufs.index(st)))[0]
                if kk > 0:  # the step before has finished reading its stage
                    mbarrier.arrive(empty.index((i - 1) % S), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((i0 + k1 - k0 - 1) % S), count=1)
            mbarrier.arrive(turn.index(ME), count=1)  # the other consumer may start its next item
            if not KSPLIT or j >= part:  # (KSPLIT: a compile-time test, then a runtime one)
                finish(
                    acc, t, c_desc, c_smem, counters, unit_group, group_info, tiles_m, tiles_n, shards,
                    unit_tiles, GROUP_M, LAYOUT, SIGNAL,
                )  # fmt: skip
            else:  # a part of the K-split tail: slot pid, the tile's parts in slots first, first + 1, ...
                rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
                cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
                in_tile = gl.expand_dims(rows, 1) * BN + gl.expand_dims(cols, 0)
                gl.store(partial + pid.to(gl.int64) * (BM * BN) + in_tile, acc)
                barrier()  # every thread's part is stored before the arrival's release
                arrived = gl.atomic_add(arrive + (t - main_tiles), 1, sem="acq_rel", scope="gpu")
                if arrived == parts - 1:  # every part is written: add them in slot order
                    # its own part too (acc is dead after its store)
                    total = part_sum(partial, pid - pid % parts, parts, BM, BN)
                    finish(
                        total, t, c_desc, c_smem, counters, unit_group, group_info, tiles_m, tiles_n,
                        shards, unit_tiles, GROUP_M, LAYOUT, SIGNAL,
                    )  # fmt: skip
        tma.store_wait(0)

    @gluon.jit
    def pingpong_kernel(
        a_desc, b_desc, c_desc, counters, unit_group, group_info, arrive, partial,
        M, N, K, rows_per_shard, tiles_m, tiles_n, main_tiles, tail_tiles, parts, shards, unit_tiles,
        STAGES: gl.constexpr, GROUP_M: gl.constexpr, LAYOUT: gl.constexpr, SIGNAL: gl.constexpr,
        KSPLIT: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):  # fmt: skip
        # (Gluon builds these shapes by list concatenation, not starred lists)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)  # noqa: RUF005
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)  # noqa: RUF005
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(empty.index(st), count=1)
            mbarrier.init(ready.index(st), count=1)
        c0 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        c1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(turn.index(c), count=1)
        # fmt: off
        gl.warp_specialize(
            [
                (consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c0, empty, ready, turn, counters,
                            unit_group, group_info, arrive, partial, K, tiles_m, tiles_n, main_tiles,
                            tail_tiles, parts, shards, unit_tiles, 0, GROUP_M, LAYOUT, SIGNAL, KSPLIT)),
                (consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c1, empty, ready, turn, counters,
                            unit_group, group_info, arrive, partial, K, tiles_m, tiles_n, main_tiles,
                            tail_tiles, parts, shards, unit_tiles, 1, GROUP_M, LAYOUT, SIGNAL, KSPLIT)),
                (loader, (a_desc, b_desc, a_bufs, b_bufs, empty, ready, K, rows_per_shard, tiles_m,
                          tiles_n, main_tiles, tail_tiles, parts, shards, GROUP_M, KSPLIT)),
            ],
            [4, 1],  # the second consumer's warpgroup, the loader's warp
            [CONSUMER_REGS, LOADER_REGS],
        )
        # fmt: on

    return pingpong_kernel
