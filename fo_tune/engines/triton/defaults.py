"""The Triton engine's default schedule: the first point a search seeds its study with, and the
calibration's NCCL margin (without a table row the runtime itself runs ``overlap: false``).

Rules (each constant below says where it comes from):

1. Tile: on a GPU, 128x256x64, GROUP_M 8, 8 warps, 3 stages (ran at 0.96-1.09x cuBLAS on three
   H200 suite shapes, ``docs/design.md``), 128x256x128 for fp8 operands; 128x128x64 when the
   output has fewer tiles of that size than the GPU has SMs. On the CPU (Triton interpreter)
   32x32x32 with 4 warps and 1 stage, which keeps interpreter runs short.
2. SMs left free: at least ``DEFAULT_NCCL_MAX_CTAS + NCCL_SM_MARGIN`` (NCCL ran beside the GEMM
   every time with r = c + 4..8 free SMs, and mostly not at all with r = c; docs/design.md), then more
   until the grid divides the tiles into whole waves (``wave_aligned_sms_free``: a partial last
   wave cost +24% where whole waves cost +14-20%, docs/design.md#triton-engine).
3. No overlap when the data the collective moves is under ``MIN_OVERLAP_BYTES`` on a GPU (see the
   constant): the (M, N) output of an AllReduce or ReduceScatter, the gathered (M, K) A of an
   AllGather (the threshold was measured on AllReduce; it is applied to AllGather's bytes unmeasured).
4. Grouping: one signal unit per band of GROUP_M tile rows (times the shards), layout ``row_band``,
   and the bands split into at most ``DEFAULT_MAX_GROUPS`` near-equal groups, earlier groups the
   larger (the last group's collective never overlaps, so it should be small). A shape with a single
   band falls back to ``tile_major`` with one unit per wave; an AllGather (``row_band`` only) then
   runs as one group.
5. Wait: ``stream_wait`` (the runtime falls back to ``spin`` where cuda-bindings is missing).
"""

from __future__ import annotations

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.plan import cdiv
from fo_kernels.schedule import SHARDED_COLLECTIVES, Problem, Schedule
from fo_kernels.tile import FP8_TILE, Tile

# Rule 1's tiles: on a GPU (0.96-1.09x cuBLAS on three H200 suite shapes, docs/design.md#default-schedule)
# and its smaller tile for outputs with fewer tiles than SMs; on the CPU, the interpreter's short runs.
GPU_TILE = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
GPU_SMALL_TILE = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)
FP8 = "float8_e4m3fn"
CPU_TILE = Tile(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
# NCCL CTA cap of the default schedule; the design brief's prototype (docs/design.md) used 16 on H200 x2.
DEFAULT_NCCL_MAX_CTAS = 16
# Extra free SMs beyond the CTA cap so NCCL's CTAs are resident beside the GEMM (docs/design.md: c + 4..8).
NCCL_SM_MARGIN = 4
# H200 x2 (docs/design.md#triton-engine): with a 16 MiB output the overlapped op lost 2x to sequential
# (host-bound, and each chunk on NCCL's ~70 us floor); with 64 MiB it gained 1.06x.
MIN_OVERLAP_BYTES = 64 * 2**20
# Rule 4's most groups (docs/design.md#default-schedule): the last group's collective never
# overlaps, so a few groups keep it small; a search space sets its own ``grouping.max_groups``.
DEFAULT_MAX_GROUPS = 4


def wave_aligned_sms_free(tiles: int, min_free: int, sm_count: int) -> int:
    """SMs left free when the grid shrinks to the fewest programs that need no extra wave,
    leaving at least ``min_free`` (clamped so one program remains)."""
    min_free = min(max(0, min_free), sm_count - 1)
    waves = -(-tiles // (sm_count - min_free))
    return sm_count - min(sm_count - min_free, -(-tiles // waves))


def split_decreasing(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` near-equal positive sizes, larger first."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def default_schedule(
    collective: str,
    m: int,
    n: int,
    k: int,
    *,
    dtype: str,
    world_size: int,
    sm_count: int,
    on_gpu: bool,
) -> Schedule:
    """The heuristic schedule for one exact shape (rules in the module docstring); an all_gather's
    ``m`` is the gathered M."""
    problem = Problem(m=m, n=n, k=k)
    shards = world_size if collective in SHARDED_COLLECTIVES else 1
    # An AllGather moves the operand A (fp8: 1 byte); a sum moves the output (fp8's default: bfloat16).
    out_bytes = 4 if dtype == "float32" else 2
    moved = m * k * (1 if dtype == FP8 else out_bytes) if collective == "all_gather" else m * n * out_bytes
    if on_gpu and moved < MIN_OVERLAP_BYTES:
        return Schedule(
            collective=collective,
            dtype=dtype,
            world_size=world_size,
            problem=problem,
            provenance={"source": "heuristic"},
        )
    if on_gpu:
        tile = FP8_TILE if dtype == FP8 else GPU_TILE
        if cdiv(m // shards, tile.block_m) * cdiv(n, tile.block_n) * shards < sm_count:
            tile = GPU_SMALL_TILE
        cap = DEFAULT_NCCL_MAX_CTAS
        tiles = shards * cdiv(m // shards, tile.block_m) * cdiv(n, tile.block_n)
        sms_free = wave_aligned_sms_free(tiles, cap + NCCL_SM_MARGIN, sm_count)
    else:
        tile, sms_free, cap = CPU_TILE, 0, 0
    rows = m // shards
    tiles_m, tiles_n = cdiv(rows, tile.block_m), cdiv(n, tile.block_n)
    bands = cdiv(tiles_m, tile.group_m)
    num_tiles = shards * tiles_m * tiles_n
    if bands >= 2 or collective == "all_gather":
        layout, unit = "row_band", shards * tile.group_m * tiles_n
    else:
        grid = max(1, min(num_tiles, sm_count - sms_free))
        layout, unit = "tile_major", cdiv(grid, shards) * shards
    units = cdiv(num_tiles, unit)
    return Schedule(
        collective=collective,
        dtype=dtype,
        world_size=world_size,
        problem=problem,
        settings=TritonSettings(
            tile=tile,
            sms_free=sms_free,
            nccl_max_ctas=cap,
            signal_tiles=unit,
            groups=split_decreasing(units, DEFAULT_MAX_GROUPS),
            layout=layout,
            wait_mode="stream_wait",
        ),
        provenance={"source": "heuristic"},
    )
