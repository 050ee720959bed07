"""The signalled GEMM's epilogue: a finished tile's stores and its release signal (``@triton.jit``
helpers every plain kernel shares).

    store acc (float32, rounded to the output dtype) at the tile's layout position,
        in SUBTILE column pieces of BLOCK_N / SUBTILE (plain ``tl.store``)
    barrier                                   # every thread of the CTA has issued its stores
    atomic_add(counters[g], 1, release)       # one thread's increment covers the CTA's stores

An fp8 tile's float32 sum is first multiplied by its scales (``_scale``: one number each, or
scale_a per row and scale_b per column, as ``torch._scaled_mm``), before it is rounded and stored,
so a signal always covers scaled values.

The release increment is cumulative over the CTA barrier, so a reader that acquires the counter
at its target sees every element of the group's tiles (``tests/test_gpu.py`` reads each group from
another SM the moment its counter is complete). The whole waves defer each tile's increment to
the next tile's epilogue (``_finish_tile(DEFER=True)``, then ``_signal_if``): its fence then waits
on stores issued a whole tile earlier.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fo_kernels.gemm.tiles import _tile_dst


@triton.jit
def _scale(
    acc, scale_a, scale_b, row0, col0, M, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    """A tile's float32 sum times its fp8 scales (``fo_kernels.scaling``): SCALE 0 none; 1
    tensorwise, ``scale_a[0] * scale_b[0]``; 2 rowwise, ``scale_a[r]`` for each row r of A from
    ``row0`` and ``scale_b[c]`` for each column c from ``col0`` (rows past M and columns past N
    read 0: they are never stored)."""
    if SCALE == 1:
        acc = acc * (tl.load(scale_a) * tl.load(scale_b))
    elif SCALE == 2:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        sa = tl.load(scale_a + rows, mask=rows < M, other=0.0)
        sb = tl.load(scale_b + cols, mask=cols < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def _downcast(acc, OUT_DTYPE: tl.constexpr):
    """A float32 tile in the output dtype, rounded to nearest even."""
    if tl.float32 == OUT_DTYPE:
        return acc
    return acc.to(OUT_DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def _halves(x, ROWS: tl.constexpr, W: tl.constexpr):
    """A (ROWS, 2W) block -> its left and right (ROWS, W) halves (epilogue subtiling)."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, W)), (0, 2, 1)))


@triton.jit
def _cta_barrier(PTX: tl.constexpr):
    """Every thread of the program reaches this point, its earlier stores issued. Compiled, it is
    ``bar.sync 0`` in inline PTX: ``tl.debug_barrier`` there keeps Triton 3.6 from software-
    pipelining a flattened loop (one stage of shared memory instead of ``num_stages``)."""
    if PTX:
        tl.inline_asm_elementwise(
            "bar.sync 0;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        tl.debug_barrier()


@triton.jit
def _store_piece(
    piece, OFF: tl.constexpr, W: tl.constexpr, out, out2, dst_row0, slot, local_row0, col0,
    rows_per_shard, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LAYOUT: tl.constexpr,
    ACCUMULATE: tl.constexpr, COPY: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Store columns [OFF, OFF + W) of one tile (``piece``, float32) at the layout's position:
    tile-major slot ``slot``, or rows from ``dst_row0`` of a row-major (rows, N) destination
    (rows whose shard-local index ``local_row0 + i`` reaches ``rows_per_shard`` are skipped).
    ACCUMULATE: add what is there first (the rows GEMM); COPY: store to ``out2`` too."""
    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, W)
    if LAYOUT == 1:  # tile_major: the whole padded tile as one contiguous slot
        ptrs = out + slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + ii[:, None] * BLOCK_N + (OFF + jj)[None, :]
        tl.store(ptrs, _downcast(piece, OUT_DTYPE))
    else:
        cols = col0 + OFF + jj
        mask = ((local_row0 + ii)[:, None] < rows_per_shard) & (cols[None, :] < N)
        offs = (dst_row0 + ii).to(tl.int64)[:, None] * N + cols[None, :]
        if ACCUMULATE:  # add what the copy engine put there (its group has landed)
            prev = tl.load(out + offs, mask=mask, other=0.0, cache_modifier=".cg")
            piece += prev.to(tl.float32)
        c = _downcast(piece, OUT_DTYPE)
        tl.store(out + offs, c, mask=mask)
        if COPY:
            tl.store(out2 + offs, c, mask=mask)


@triton.jit
def _store_tile(
    acc, out, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUBTILE: tl.constexpr, LAYOUT: tl.constexpr,
    ACCUMULATE: tl.constexpr, COPY: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """The epilogue's stores, in SUBTILE (1 or 2) column pieces of BLOCK_N // SUBTILE: each piece
    needs a fraction of the registers and shared memory a whole tile's store conversion needs."""
    if SUBTILE == 1:
        _store_piece(
            acc, 0, BLOCK_N, out, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
            BLOCK_M, BLOCK_N, LAYOUT, ACCUMULATE, COPY, OUT_DTYPE,
        )  # fmt: skip
    else:
        H: tl.constexpr = BLOCK_N // 2
        h0, h1 = _halves(acc, BLOCK_M, H)
        _store_piece(
            h0, 0, H, out, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
            BLOCK_M, BLOCK_N, LAYOUT, ACCUMULATE, COPY, OUT_DTYPE,
        )  # fmt: skip
        _store_piece(
            h1, H, H, out, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
            BLOCK_M, BLOCK_N, LAYOUT, ACCUMULATE, COPY, OUT_DTYPE,
        )  # fmt: skip


@triton.jit
def _signal(counters, g, PTX: tl.constexpr, SYS_SIGNAL: tl.constexpr):
    """Group g's counter + 1 (release), once every thread's stores before this point are issued:
    the counter then covers all of them. SYS_SIGNAL: the counters are in a peer GPU's memory
    (system scope)."""
    _cta_barrier(PTX)
    if SYS_SIGNAL:
        tl.atomic_add(counters + g, 1, sem="release", scope="sys")
    else:
        tl.atomic_add(counters + g, 1, sem="release", scope="gpu")


@triton.jit
def _signal_if(counters, g, PTX: tl.constexpr):
    """``_signal`` for a group g >= 0 (a deferred signal; -1: no tile waits for one)."""
    if g >= 0:
        _signal(counters, g, PTX, False)


@triton.jit
def _finish_tile(
    acc, t, out, counters, unit_group, group_info, N, rows_per_shard, tiles_m, tiles_n, shards,
    unit_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    LAYOUT: tl.constexpr, SIGNAL: tl.constexpr, OUT_DTYPE: tl.constexpr, SUBTILE: tl.constexpr,
    PTX: tl.constexpr, DEFER: tl.constexpr,
):  # fmt: skip
    """Tile t's epilogue in the row_band or tile_major layout: its group, its stores at the layout
    position, then its signal (DEFER: the caller signals the returned group later, ``_signal_if``).
    Returns the tile's group."""
    g, slot, dst_row0, local_row0, col0 = _tile_dst(
        t, unit_group, group_info, shards, unit_tiles, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M
    )
    _store_tile(
        acc, out, out, dst_row0, slot, local_row0, col0, rows_per_shard, N,
        BLOCK_M, BLOCK_N, SUBTILE, LAYOUT, False, False, OUT_DTYPE,
    )  # fmt: skip
    if SIGNAL and not DEFER:
        _signal(counters, g, PTX, False)
    return g
