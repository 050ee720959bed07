"""The schedule contract: what the tuner writes and the runtime reads.

A ``Schedule`` fixes everything one overlapped op does for one problem (or an M range of it). It
is common fields plus the settings of exactly one engine (a tagged union):

- ``collective``, ``dtype``, ``world_size`` and the ``problem`` (exact M, N, K, or [m_min, m_max]
  for fixed N, K);
- ``settings``: ``None`` for ``overlap: false`` (plain GEMM then the collective, the baseline every
  engine is judged against), else one engine's settings, registered by the engine's exact name
  (``ENGINE_SETTINGS``; ``settings_type`` names the valid ones):

  - ``TritonSettings`` (engine ``triton``: the signalled persistent Triton GEMM and NCCL):
    ``tile``; ``sms_free`` (SMs left to communication: the grid is ``sm_count - sms_free``);
    ``nccl_max_ctas`` (the NCCL CTA cap, 0: NCCL's default); ``signal_tiles`` (tiles per signal
    unit); ``groups`` (sizes of consecutive groups in signal units, summing to the units of an
    exact-shape row; relative weights on an M-range row, ``fo_kernels.plan.resolve_groups``);
    ``layout`` (``row_band``: groups are bands of whole tile rows, communicated in place;
    ``tile_major``: tiles stored contiguously per group, restored after); ``wait_mode``
    (``stream_wait``: ``cuStreamWaitValue32``; ``spin``: a one-program Triton kernel).
    ``all_gather`` runs the other way (NCCL gathers a group's A rows, then its tiles' GEMM runs)
    and reads the same fields with the same meanings: ``tile`` and ``sms_free`` of the chunk GEMMs,
    ``nccl_max_ctas`` of the gathers, ``signal_tiles`` and ``groups`` for which output tiles form
    a group (its A rows are gathered by one collective), ``layout`` must be ``row_band`` (a
    group's A rows are whole bands of every shard); ``wait_mode`` is unused (nothing is
    signalled by a kernel: the GEMM's stream waits on the gather's event);
  - ``CopyEngineSettings`` (engine ``copy_engine``: library GEMM chunks, the data moved by the
    GPUs' copy engines between NVLink peers and summed in the GEMM's epilogue, no NCCL; see
    ``fo_kernels.copy_engine``): ``mode`` (``ring``: a cuBLAS GEMM per row chunk; ``tiled``: each
    phase one persistent Triton GEMM whose tiles signal per chunk), ``weights`` (the relative row
    weights of the chunks each shard is cut into, on every row, exact or M range) and ``tile``
    (the tiled mode's GEMM tile; only with ``mode: tiled``).

A table row in YAML::

    - problem: {m: 4096, n: 8192, k: 4096}
      engine: copy_engine
      settings: {mode: ring, weights: [1, 1, 1, 1]}
    - problem: {m_min: 512, m_max: 724, n: 4096, k: 4096}
      overlap: false

Field-level rules are checked here on construction; rules that need the shape (group sums, band
alignment, divisibility) are checked by ``fo_kernels.plan.make_plan``. Every error names the field.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from .errors import ScheduleError

# all_gather is the column-parallel direction, AllGather + GEMM: rank r's (M/w, K) shard of A is
# gathered at rows [r*M/w, (r+1)*M/w) and the gathered (M, K) A multiplied by B. Its problem's M is
# the gathered M (world_size x the shard's rows), as reduce_scatter's M is the unscattered one.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# The collectives whose rows are split over the ranks: M must be divisible by world_size.
SHARDED_COLLECTIVES = ("reduce_scatter", "all_gather")
# Operand dtypes by their table name: the one map from names to torch dtypes.
TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DTYPES = tuple(TORCH_DTYPES)
LAYOUTS = ("row_band", "tile_major")
WAIT_MODES = ("stream_wait", "spin")
# The copy engine's modes (``fo_kernels.copy_engine``): cuBLAS chunks around a ring of peers, or one
# persistent Triton GEMM per phase whose tiles signal per chunk.
COPY_ENGINE_MODES = ("ring", "tiled")
# The copy engine moves data between peers: at least two ranks; its tiled mode between exactly two
# (``fo_kernels.copy_engine.modes`` owns the modes; ``mode_blocker`` says the same, a test checks it).
COPY_ENGINE_MIN_WORLD = 2
TILED_WORLD = 2
# Most chunks per shard a copy_engine schedule may cut (its flag slots are preallocated).
MAX_CHUNKS = 64

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


def dtype_name(dtype: torch.dtype | str) -> str:
    """The table name of an operand dtype (``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``)."""
    if isinstance(dtype, torch.dtype):
        for name, value in TORCH_DTYPES.items():
            if value == dtype:
                return name
        raise ScheduleError(f"dtype: {dtype} is not supported; use one of {', '.join(DTYPES)}")
    if not isinstance(dtype, str) or dtype not in TORCH_DTYPES:
        raise ScheduleError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a table dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    return TORCH_DTYPES[dtype_name(name)]


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ScheduleError(f"{name}: must be >= {minimum}, got {value}")
    return value


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ScheduleError(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return value


def _from_mapping(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ScheduleError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ScheduleError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; valid: {sorted(known)}")
    try:
        return cls(**data)
    except TypeError as exc:  # a missing required key
        raise ScheduleError(f"{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """The GEMM problem a schedule is for: exact ``m`` or the range ``[m_min, m_max]``, and N, K."""

    n: int
    k: int
    m: int | None = None
    m_min: int | None = None
    m_max: int | None = None

    def __post_init__(self) -> None:
        _check_int("problem.n", self.n, minimum=1)
        _check_int("problem.k", self.k, minimum=1)
        if self.m is not None:
            _check_int("problem.m", self.m, minimum=1)
            if self.m_min is not None or self.m_max is not None:
                raise ScheduleError("problem: give either m or m_min/m_max, not both")
        else:
            if self.m_min is None or self.m_max is None:
                raise ScheduleError("problem: needs m, or both m_min and m_max")
            _check_int("problem.m_min", self.m_min, minimum=1)
            _check_int("problem.m_max", self.m_max, minimum=1)
            if self.m_min > self.m_max:
                raise ScheduleError(f"problem: m_min {self.m_min} > m_max {self.m_max}")

    @property
    def is_range(self) -> bool:
        return self.m is None

    def covers(self, m: int, n: int, k: int) -> bool:
        """True when (m, n, k) is this exact problem or falls in its M range."""
        if (n, k) != (self.n, self.k):
            return False
        if self.m is not None:
            return m == self.m
        assert self.m_min is not None and self.m_max is not None
        return self.m_min <= m <= self.m_max

    def to_dict(self) -> dict[str, int]:
        if self.m is not None:
            return {"m": self.m, "n": self.n, "k": self.k}
        return {"m_min": self.m_min, "m_max": self.m_max, "n": self.n, "k": self.k}  # type: ignore[dict-item]

    @classmethod
    def from_dict(cls, data: Any) -> Problem:
        return _from_mapping(cls, data, "problem")

    def describe(self) -> str:
        m = str(self.m) if self.m is not None else f"[{self.m_min},{self.m_max}]"
        return f"{m}x{self.n}x{self.k}"


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
    # The hand-written warp-specialized kernel (``fo_kernels.gemm_pingpong``): a TMA loader warp
    # and two consumer warpgroups that take tiles in turn, each hiding its epilogue behind the
    # other's main loop. Needs 4 warps (one warpgroup a consumer) and a tile whose float32
    # accumulator fits one warpgroup; where a call cannot run it (``pingpong_blocker``: not a Hopper
    # GPU, 32-bit inputs, unaligned strides) the tile runs in the plain kernel.
    pingpong: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = _check_int(f"tile.{name}", getattr(self, name), minimum=MIN_BLOCK)
            if not _is_pow2(value) or value > MAX_BLOCK:
                raise ScheduleError(
                    f"tile.{name}: must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {value}"
                )
        _check_int("tile.group_m", self.group_m, minimum=1)
        if self.num_warps not in NUM_WARPS_CHOICES:
            raise ScheduleError(f"tile.num_warps: must be one of {NUM_WARPS_CHOICES}, got {self.num_warps!r}")
        _check_int("tile.num_stages", self.num_stages, minimum=1)
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
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in TILE_FLAGS:
            if not out[name]:
                del out[name]  # the default stays out of the tables
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Tile:
        return _from_mapping(cls, data, "tile")

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


class EngineSettings(ABC):
    """One engine's part of a schedule. Subclasses are frozen dataclasses registered under their
    engine's exact name (``register_settings``); ``ENGINE`` is that name."""

    ENGINE: ClassVar[str]

    @abstractmethod
    def check(self, collective: str, world_size: int) -> None:
        """Raise ``ScheduleError`` (naming the field) when these settings cannot serve the call kind."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping of a table row's ``settings``."""

    @classmethod
    @abstractmethod
    def from_dict(cls, data: Any) -> EngineSettings:
        """Parse a row's ``settings`` mapping (every error names the field)."""

    @abstractmethod
    def describe(self) -> str:
        """A few words for logs and reports."""


ENGINE_SETTINGS: dict[str, type[EngineSettings]] = {}


def register_settings(cls: type[EngineSettings]) -> type[EngineSettings]:
    """Class decorator: make ``cls`` the settings type of engine ``cls.ENGINE``."""
    if cls.ENGINE in ENGINE_SETTINGS:
        raise ValueError(
            f"engine {cls.ENGINE!r} has settings already ({ENGINE_SETTINGS[cls.ENGINE].__name__})"
        )
    ENGINE_SETTINGS[cls.ENGINE] = cls
    return cls


def settings_type(engine: Any) -> type[EngineSettings]:
    """The settings type of the engine named ``engine``; an unknown name lists the valid ones."""
    found = ENGINE_SETTINGS.get(engine) if isinstance(engine, str) else None
    if found is None:
        raise ScheduleError(f"engine: {engine!r} is not one of {', '.join(sorted(ENGINE_SETTINGS))}")
    return found


def _weights(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ScheduleError(f"{name}: expected a list of integers, got {value!r}")
    out = tuple(value)
    if not out:
        raise ScheduleError(f"{name}: needs at least one entry")
    for i, g in enumerate(out):
        _check_int(f"{name}[{i}]", g, minimum=1)
    return out


def _settings_from_mapping(cls: type, data: Any) -> Any:
    if not isinstance(data, Mapping):
        raise ScheduleError(f"settings: expected a mapping, got {type(data).__name__}")
    merged = dict(data)
    if merged.get("tile") is not None:
        merged["tile"] = Tile.from_dict(merged["tile"])
    return _from_mapping(cls, merged, f"settings ({cls.ENGINE})")


@register_settings
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
        object.__setattr__(self, "groups", _weights("groups", self.groups))
        _check_int("sms_free", self.sms_free, minimum=0)
        _check_int("nccl_max_ctas", self.nccl_max_ctas, minimum=0)
        _check_int("signal_tiles", self.signal_tiles, minimum=1)
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("wait_mode", self.wait_mode, WAIT_MODES)

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
        return _settings_from_mapping(cls, data)

    def describe(self) -> str:
        return (
            f"tile {self.tile.label()}, sms_free {self.sms_free}, "
            f"cta cap {self.nccl_max_ctas or 'default'}, signal {self.signal_tiles} tiles, "
            f"groups {list(self.groups)}, {self.layout}, {self.wait_mode}"
        )


@register_settings
@dataclass(frozen=True, kw_only=True, slots=True)
class CopyEngineSettings(EngineSettings):
    """The copy engine: chunk GEMMs, copy-engine pulls between peers, sums in the epilogue."""

    ENGINE: ClassVar[str] = "copy_engine"
    weights: tuple[int, ...]
    mode: str = "ring"
    tile: Tile | None = None

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, COPY_ENGINE_MODES)
        weights = _weights("weights", self.weights)
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
        return _settings_from_mapping(cls, data)

    def describe(self) -> str:
        how = f", tile {self.tile.label()}" if self.tile is not None else ""
        return f"{self.mode}, {len(self.weights)} chunk(s) per shard, weights {list(self.weights)}{how}"


# The keys of a table row (the header gives collective, dtype and world_size).
_ROW_KEYS = ("problem", "overlap", "engine", "settings", "provenance")


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """One GEMM + collective, fully specified: common fields and one engine's settings (or none)."""

    collective: str
    dtype: str
    world_size: int
    problem: Problem
    # None: overlap: false (GEMM then the collective); else the settings of the engine that runs it.
    settings: EngineSettings | None = None
    # Where the row came from (search id, measured/predicted ms, ...); the runtime ignores it.
    provenance: Mapping[str, Any] = field(default_factory=dict)
    # The schedule as the custom ops' ``schedule`` argument: its JSON without the provenance, made
    # once here, so that torch.compile reads it as a constant attribute (``fo_kernels.ops``).
    op_text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_choice("collective", self.collective, COLLECTIVES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_int("world_size", self.world_size, minimum=1)
        if not isinstance(self.problem, Problem):
            raise ScheduleError(f"problem: expected a Problem, got {type(self.problem).__name__}")
        if (
            self.problem.m is not None
            and self.collective in SHARDED_COLLECTIVES
            and self.problem.m % self.world_size
        ):
            raise ScheduleError(
                f"problem.m: {self.collective} needs M divisible by world_size {self.world_size}, "
                f"got {self.problem.m}"
            )
        if self.settings is not None:
            if not isinstance(self.settings, EngineSettings):
                raise ScheduleError(
                    f"settings: expected an engine's settings, got {type(self.settings).__name__}"
                )
            self.settings.check(self.collective, self.world_size)
        if not isinstance(self.provenance, Mapping):
            raise ScheduleError(f"provenance: expected a mapping, got {type(self.provenance).__name__}")
        data = self.to_dict()
        data.pop("provenance", None)
        object.__setattr__(self, "op_text", json.dumps(data, sort_keys=True, separators=(",", ":")))

    @property
    def overlap(self) -> bool:
        """False for the ``overlap: false`` fallback (GEMM then the collective)."""
        return self.settings is not None

    @property
    def engine(self) -> str | None:
        """The name of the engine that runs this schedule (None for ``overlap: false``)."""
        return None if self.settings is None else self.settings.ENGINE

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "collective": self.collective,
            "dtype": self.dtype,
            "world_size": self.world_size,
            "problem": self.problem.to_dict(),
        }
        if self.settings is None:
            out["overlap"] = False
        else:
            out.update(engine=self.settings.ENGINE, settings=self.settings.to_dict())
        if self.provenance:
            out["provenance"] = dict(self.provenance)
        return out

    @classmethod
    def from_dict(cls, data: Any, *, defaults: Mapping[str, Any] | None = None) -> Schedule:
        """Build from a mapping (a table row); ``defaults`` fill keys the row leaves out."""
        if not isinstance(data, Mapping):
            raise ScheduleError(f"schedule: expected a mapping, got {type(data).__name__}")
        merged = {**(defaults or {}), **data}
        known = (
            "collective",
            "dtype",
            "world_size",
            "problem",
            "overlap",
            "engine",
            "settings",
            "provenance",
        )
        unknown = sorted(str(key) for key in set(merged) - set(known))
        if unknown:
            raise ScheduleError(f"schedule: unknown key(s) {', '.join(unknown)}; valid: {sorted(known)}")
        for key in ("collective", "dtype", "world_size", "problem"):
            if key not in merged:
                raise ScheduleError(f"{key}: missing")
        overlap = merged.get("overlap", True)
        if not isinstance(overlap, bool):
            raise ScheduleError(f"overlap: expected true or false, got {overlap!r}")
        settings = None
        if overlap:
            if "engine" not in merged:
                raise ScheduleError("engine: missing (an overlapped row names its engine; or overlap: false)")
            settings = settings_type(merged["engine"]).from_dict(merged.get("settings"))
        elif "engine" in merged or "settings" in merged:
            raise ScheduleError("engine: an overlap: false row runs GEMM then the collective; leave it out")
        return cls(
            collective=merged["collective"],
            dtype=merged["dtype"],
            world_size=merged["world_size"],
            problem=Problem.from_dict(merged["problem"]),
            settings=settings,
            provenance=merged.get("provenance") or {},
        )

    def describe(self) -> str:
        """A one-line human summary, used in logs and reports."""
        head = f"{self.collective} {self.dtype} w{self.world_size} {self.problem.describe()}"
        if self.settings is None:
            return f"{head}: no overlap (GEMM then collective)"
        return f"{head}: engine {self.settings.ENGINE}, {self.settings.describe()}"
