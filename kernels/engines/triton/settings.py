"""The ``triton`` engine's settings: the signalled persistent Triton GEMM and NCCL per group (the
fields are described in ``fo_kernels.schedule``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fo_kernels.errors import ScheduleError
from fo_kernels.fields import check_choice, check_int, check_weights
from fo_kernels.schedule import SHARDED_COLLECTIVES, EngineSettings, settings_from_mapping
from fo_kernels.tile import Tile

LAYOUTS = ("row_band", "tile_major")
WAIT_MODES = ("stream_wait", "spin")


@dataclass(frozen=True, kw_only=True, slots=True)
class TritonSettings(EngineSettings):
    """The signalled persistent Triton GEMM and NCCL per group (see the module docstring)."""

    ENGINE: ClassVar[str] = "triton"
    tile: Tile
    groups: tuple[int, ...]
    sms_free: int = 0
    nccl_max_ctas: int = 0
    signal_tiles: int = 1
    layout: str = "tile_major"
    wait_mode: str = "stream_wait"

    def __post_init__(self) -> None:
        if not isinstance(self.tile, Tile):
            raise ScheduleError(f"tile: expected a Tile config, got {type(self.tile).__name__}")
        object.__setattr__(self, "groups", check_weights("groups", self.groups))
        check_int("sms_free", self.sms_free, minimum=0)
        check_int("nccl_max_ctas", self.nccl_max_ctas, minimum=0)
        check_int("signal_tiles", self.signal_tiles, minimum=1)
        check_choice("layout", self.layout, LAYOUTS)
        check_choice("wait_mode", self.wait_mode, WAIT_MODES)

    def check(self, collective: str, world_size: int) -> None:
        if collective in SHARDED_COLLECTIVES and self.signal_tiles % world_size:
            raise ScheduleError(
                f"signal_tiles: {collective} needs a multiple of world_size {world_size} "
                f"(each unit holds the same tile of every rank's shard), got {self.signal_tiles}"
            )
        if collective == "all_gather" and self.layout != "row_band":
            raise ScheduleError(
                f"layout: all_gather gathers whole bands of tile rows per group; use row_band, "
                f"got {self.layout}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tile": self.tile.to_dict(),
            "sms_free": self.sms_free,
            "nccl_max_ctas": self.nccl_max_ctas,
            "signal_tiles": self.signal_tiles,
            "groups": list(self.groups),
            "layout": self.layout,
            "wait_mode": self.wait_mode,
        }

    @classmethod
    def from_dict(cls, data: Any) -> TritonSettings:
        return settings_from_mapping(cls, data)

    def describe(self) -> str:
        return (
            f"tile {self.tile.label()}, sms_free {self.sms_free}, "
            f"cta cap {self.nccl_max_ctas or 'default'}, signal {self.signal_tiles} tiles, "
            f"groups {list(self.groups)}, {self.layout}, {self.wait_mode}"
        )


SETTINGS = TritonSettings
