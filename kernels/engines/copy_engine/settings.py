"""The ``copy_engine`` engine's settings: library GEMM chunks, the data moved by the GPUs' copy
engines between NVLink peers (the fields are described in ``fo_kernels.schedule``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fo_kernels.errors import ScheduleError
from fo_kernels.fields import check_choice, check_weights
from fo_kernels.schedule import EngineSettings, settings_from_mapping
from fo_kernels.tile import Tile

# The copy engine's modes (``fo_kernels.engines.copy_engine``): cuBLAS chunks around a ring of peers, or one
# persistent Triton GEMM per phase whose tiles signal per chunk.
COPY_ENGINE_MODES = ("ring", "tiled")
# The copy engine moves data between peers: at least two ranks; its tiled mode between exactly two
# (``fo_kernels.engines.copy_engine.modes`` owns the modes; ``mode_blocker`` says the same, a test checks it).
COPY_ENGINE_MIN_WORLD = 2
TILED_WORLD = 2
# Most chunks per shard a copy_engine schedule may cut (its flag slots are preallocated).
MAX_CHUNKS = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyEngineSettings(EngineSettings):
    """The copy engine: chunk GEMMs, copy-engine pulls between peers, sums in the epilogue."""

    ENGINE: ClassVar[str] = "copy_engine"
    weights: tuple[int, ...]
    mode: str = "ring"
    tile: Tile | None = None

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, COPY_ENGINE_MODES)
        weights = check_weights("weights", self.weights)
        if len(weights) > MAX_CHUNKS:
            raise ScheduleError(f"weights: at most {MAX_CHUNKS} chunks per shard, got {len(weights)}")
        object.__setattr__(self, "weights", weights)
        if self.mode == "tiled" and not isinstance(self.tile, Tile):
            raise ScheduleError("tile: mode tiled runs a persistent Triton GEMM and needs its tile config")
        if self.mode != "tiled" and self.tile is not None:
            raise ScheduleError(f"tile: mode {self.mode} runs library GEMMs; only mode tiled takes a tile")

    def check(self, collective: str, world_size: int) -> None:
        if world_size < COPY_ENGINE_MIN_WORLD:
            raise ScheduleError(
                f"engine: copy_engine moves data between at least {COPY_ENGINE_MIN_WORLD} GPUs, "
                f"this schedule has world_size {world_size}"
            )
        if self.mode == "tiled" and collective == "all_gather":
            raise ScheduleError("mode: tiled runs all_reduce and reduce_scatter; all_gather runs mode ring")
        if self.mode == "tiled" and world_size != TILED_WORLD:
            raise ScheduleError(
                f"mode: tiled runs between exactly {TILED_WORLD} GPUs, this schedule has world_size "
                f"{world_size}; use mode ring"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "weights": list(self.weights)}
        if self.tile is not None:
            out["tile"] = self.tile.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any) -> CopyEngineSettings:
        return settings_from_mapping(cls, data)

    def describe(self) -> str:
        how = f", tile {self.tile.label()}" if self.tile is not None else ""
        return f"{self.mode}, {len(self.weights)} chunk(s) per shard, weights {list(self.weights)}{how}"


SETTINGS = CopyEngineSettings
