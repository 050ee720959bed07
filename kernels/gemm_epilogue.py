"""The signalled GEMM's epilogue, in Triton: a finished tile's stores and its release signal.

Used by ``fo_kernels.gemm`` (the protocol is in its docstring). A tile's float32 sum is stored in
``SUBTILE`` column pieces at its layout position (plain ``tl.store``, or TMA descriptor stores),
then every thread reaches a CTA barrier and one thread adds 1 to its group's counter with release
semantics, which covers the whole CTA's stores (cumulativity through the barrier). TMA stores are
asynchronous: the issuing thread first waits until they are written (``_bulk_stores_done``).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _bulk_stores_done():
    """Wait until this thread's TMA (bulk) stores have been written, not just read from shared
    memory, and order them before its later generic-proxy accesses (PTX: ``cp.async.bulk.wait_group``
    without ``.read``; ``fence.proxy.async.global``). The release increment after the CTA barrier
    then covers them as it covers plain stores."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
        "=r",
        [],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


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
    piece, OFF: tl.constexpr, W: tl.constexpr, out, out_desc, out2, dst_row0, slot, local_row0,
    col0, rows_per_shard, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LAYOUT: tl.constexpr,
    TMA_STORE: tl.constexpr, ACCUMULATE: tl.constexpr, COPY: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Store columns [OFF, OFF + W) of one tile (``piece``, float32) at the layout's position:
    tile-major slot ``slot``, or rows from ``dst_row0`` of a row-major (rows, N) destination
    (rows whose shard-local index ``local_row0 + i`` reaches ``rows_per_shard`` are skipped)."""
    if TMA_STORE:
        c = _downcast(piece, OUT_DTYPE)
        if LAYOUT == 1:
            out_desc.store([slot * BLOCK_M, OFF], c)
        else:
            out_desc.store([dst_row0, col0 + OFF], c)
    else:
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
    acc, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUBTILE: tl.constexpr, LAYOUT: tl.constexpr,
    TMA_STORE: tl.constexpr, ACCUMULATE: tl.constexpr, COPY: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """The epilogue's stores, in SUBTILE column pieces of BLOCK_N // SUBTILE (1, 2 or 4): each
    piece needs a fraction of the registers and shared memory a whole tile's store conversion needs."""
    if SUBTILE == 1:
        _store_piece(
            acc, 0, BLOCK_N, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
            BLOCK_M, BLOCK_N, LAYOUT, TMA_STORE, ACCUMULATE, COPY, OUT_DTYPE,
        )  # fmt: skip
    else:
        H: tl.constexpr = BLOCK_N // 2
        h0, h1 = _halves(acc, BLOCK_M, H)
        if SUBTILE == 2:
            _store_piece(
                h0, 0, H, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
                BLOCK_M, BLOCK_N, LAYOUT, TMA_STORE, ACCUMULATE, COPY, OUT_DTYPE,
            )  # fmt: skip
            _store_piece(
                h1, H, H, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
                BLOCK_M, BLOCK_N, LAYOUT, TMA_STORE, ACCUMULATE, COPY, OUT_DTYPE,
            )  # fmt: skip
        else:
            Q: tl.constexpr = BLOCK_N // 4
            q0, q1 = _halves(h0, BLOCK_M, Q)
            q2, q3 = _halves(h1, BLOCK_M, Q)
            _store_piece(
                q0, 0, Q, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
                BLOCK_M, BLOCK_N, LAYOUT, TMA_STORE, ACCUMULATE, COPY, OUT_DTYPE,
            )  # fmt: skip
            _store_piece(
                q1, Q, Q, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
                BLOCK_M, BLOCK_N, LAYOUT, TMA_STORE, ACCUMULATE, COPY, OUT_DTYPE,
            )  # fmt: skip
            _store_piece(
                q2, 2 * Q, Q, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
                BLOCK_M, BLOCK_N, LAYOUT, TMA_STORE, ACCUMULATE, COPY, OUT_DTYPE,
            )  # fmt: skip
            _store_piece(
                q3, 3 * Q, Q, out, out_desc, out2, dst_row0, slot, local_row0, col0, rows_per_shard, N,
                BLOCK_M, BLOCK_N, LAYOUT, TMA_STORE, ACCUMULATE, COPY, OUT_DTYPE,
            )  # fmt: skip
