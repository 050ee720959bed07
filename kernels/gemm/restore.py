"""The tile-major restore: one shard's tile-major slots back into its row-major rows.

    for each local tile position l (one program each):
        (tm, tn) = grouped_swizzle(l)                 # the order the GEMM gave the slots (.tiles)
        dst[tm*BM : +BM, tn*BN : +BN] = slot l        # rows past Ms and columns past N dropped

A tile_major plan (``fo_kernels.plan``) writes each group's tiles as contiguous slots, so any group
can be communicated as one chunk; this kernel restores one rank's part after the collective.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fo_kernels.gemm.tiles import _tile_coords
from fo_kernels.plan import Plan
from fo_kernels.tile import Tile

# Tiles of up to 128x128 elements are copied by 4 warps, larger ones by 8: the restore's choice
# since it was written, not a measurement (the restore was never timed apart from its calls).
RESTORE_SMALL_TILE = 128 * 128


@triton.jit
def _restore_kernel(
    src, dst,  # tile-major slots in local order, row-major (rows, N) output
    rows, N, tiles_m, tiles_n,  # sizes
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    l = tl.program_id(0)
    tm, tn = _tile_coords(l, tiles_m, tiles_n, GROUP_M)
    ii = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    blk = tl.load(src + l.to(tl.int64) * (BLOCK_M * BLOCK_N) + ii[:, None] * BLOCK_N + jj[None, :])
    r = tm * BLOCK_M + ii
    c = tn * BLOCK_N + jj
    mask = (r[:, None] < rows) & (c[None, :] < N)
    tl.store(dst + r.to(tl.int64)[:, None] * N + c[None, :], blk, mask=mask)


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
        num_warps=4 if tile.block_m * tile.block_n <= RESTORE_SMALL_TILE else 8,
    )
