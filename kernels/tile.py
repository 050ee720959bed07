"""The GEMM tile config of the persistent Triton kernels (``Tile``) and the limits it is checked
against; the ``triton`` engine's settings and the copy engine's tiled mode carry one."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from fo_kernels.errors import DeviceLimitError, ScheduleError
from fo_kernels.fields import check_int, field_names, from_mapping, is_pow2

# tl.dot needs every block dimension >= 16; 256 is the largest block one Hopper CTA's shared memory
# holds in a 2-stage pipeline at 16-bit inputs.
MIN_BLOCK = 16
MAX_BLOCK = 256
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16)
# Ping-pong tiles (``Tile.pingpong``): 4 warps, one warpgroup a consumer; a float32 accumulator of
# at most 128 registers a thread over its 128 threads (232 a thread after setmaxnreg, the rest for
# addresses and the epilogue); wgmma's 64-row minimum; Hopper's 227 KiB of shared memory per CTA
# (CUDA programming guide, compute capability 9.0) for the ring and two epilogue buffers.
PINGPONG_WARPS = 4
PINGPONG_MAX_ACC = 128 * 128
WGMMA_M = 64
HOPPER_SMEM_BYTES = 227 * 1024
PINGPONG_ELEMENT_BYTES = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Tile:
    """GEMM tile config of the persistent kernel."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    # Kept so that schedules and tables that name it still load; the signalled kernels never ask
    # Triton for warp specialization: on sm_90 Triton 3.6 builds it only for a loop that is not
    # flattened with 4 warps, and there it dropped the signal's release atomic or failed to compile
    # (docs/perf-notes.md, "Warp specialization on sm_90"). A tile with it runs as its plain twin.
    warp_specialize: bool = False
    # The hand-written warp-specialized kernel (``fo_kernels.gemm.pingpong``): a TMA loader warp
    # and two consumer warpgroups that take tiles in turn, each hiding its epilogue behind the
    # other's main loop. Needs 4 warps (one warpgroup a consumer) and a tile whose float32
    # accumulator fits one warpgroup; where a call cannot run it (``pingpong_blocker``: not a Hopper
    # GPU, 32-bit inputs, unaligned strides) the tile runs in the plain kernel.
    pingpong: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = check_int(f"tile.{name}", getattr(self, name), minimum=MIN_BLOCK)
            if not is_pow2(value) or value > MAX_BLOCK:
                raise ScheduleError(
                    f"tile.{name}: must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {value}"
                )
        check_int("tile.group_m", self.group_m, minimum=1)
        if self.num_warps not in NUM_WARPS_CHOICES:
            raise ScheduleError(f"tile.num_warps: must be one of {NUM_WARPS_CHOICES}, got {self.num_warps!r}")
        check_int("tile.num_stages", self.num_stages, minimum=1)
        for name in TILE_FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ScheduleError(f"tile.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.pingpong:
            self._check_pingpong()

    def _check_pingpong(self) -> None:
        """A ping-pong tile's limits: one warpgroup per consumer, its accumulator in registers, the
        ring and both epilogue buffers in shared memory (16-bit inputs)."""
        if self.num_warps != PINGPONG_WARPS:
            raise ScheduleError(
                f"tile.num_warps: a pingpong tile has {PINGPONG_WARPS} (one warpgroup a consumer), "
                f"got {self.num_warps}"
            )
        if self.block_m * self.block_n > PINGPONG_MAX_ACC:
            raise ScheduleError(
                f"tile.block_m x block_n: a pingpong tile's accumulator is at most {PINGPONG_MAX_ACC} "
                f"elements (128x128 or 64x256), got {self.block_m}x{self.block_n}"
            )
        if self.block_m < WGMMA_M:
            raise ScheduleError(f"tile.block_m: a pingpong tile has at least {WGMMA_M} rows (wgmma's 64)")
        smem = PINGPONG_ELEMENT_BYTES * (
            self.num_stages * (self.block_m + self.block_n) * self.block_k + 2 * self.block_m * self.block_n
        )
        if smem > HOPPER_SMEM_BYTES:
            raise ScheduleError(
                f"tile.num_stages: a pingpong tile's stages and two epilogue buffers take {smem} bytes of "
                f"shared memory, over Hopper's {HOPPER_SMEM_BYTES}; use fewer stages"
            )

    def to_dict(self) -> dict[str, int | bool]:
        out = {name: getattr(self, name) for name in field_names(type(self))}
        for name in TILE_FLAGS:
            if not out[name]:
                del out[name]  # the default stays out of the tables
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Tile:
        return from_mapping(cls, data, "tile")

    def label(self) -> str:
        """The config in a few words, e.g. ``128x256x64 gm8 w8 s3 ws``: logs, reports, search parameters."""
        ws = " ws" if self.warp_specialize else ""
        pp = " pp" if self.pingpong else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} gm{self.group_m} w{self.num_warps} "
            f"s{self.num_stages}{ws}{pp}"
        )


# The tile's true-or-false fields (the others are positive integers); false stays out of tables.
TILE_FLAGS = tuple(f.name for f in fields(Tile) if f.type == "bool")

# fp8 operands' tile: a 128-deep K block (the bytes of bf16's 64), each grid's pick on all 80 grids
# of the H100 fp8 profiles (search_spaces/hopper.yaml dtype_tiles; docs/perf-notes.md, "fp8 tiles"):
# the tuner's fp8 default and the copy engine's fp8 sums.
FP8_TILE = Tile(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3)


@dataclass(frozen=True, slots=True)
class DeviceLimits:
    """A context manager: kernel launches of ``tile`` under it that need more of a resource (shared
    memory, registers) than this GPU has raise ``DeviceLimitError`` (a ``ScheduleError``) naming
    the tile and ``what`` it ran on, instead of Triton's ``OutOfResources``. Triton finds it when it
    loads the compiled kernel, before the kernel runs: a tile's shared memory grows with its
    operands' element size (a tile that fits in bfloat16 can need twice Hopper's 227 KiB in
    float32), which the tile's own checks cannot know. Entering and leaving cost a call's host
    time well under a microsecond; Triton's error class is imported only when something failed."""

    tile: Tile
    what: str

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        from triton.runtime.errors import OutOfResources

        if isinstance(exc, OutOfResources):
            raise DeviceLimitError(
                f"tile {self.tile.label()}: on {self.what} it needs {exc.required} bytes of {exc.name}, "
                f"over this GPU's {exc.limit}; give a smaller block_k or block_n, or fewer num_stages"
            ) from None
        return False
