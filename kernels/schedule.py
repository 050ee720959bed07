"""The schedule contract: what the tuner writes and the runtime reads.

A ``Schedule`` fixes everything the overlapped op does for one problem (or an M range of it):

- ``collective``, ``dtype``, ``world_size`` and the ``problem`` (exact M, N, K, or [m_min, m_max]
  for fixed N, K);
- the GEMM ``tile`` (block sizes, grouped-swizzle width, warps, pipeline stages);
- ``sms_free``: SMs left to communication; the persistent grid is ``sm_count - sms_free`` programs;
- ``nccl_max_ctas``: the NCCL CTA cap of the communicator the collectives run on (0: NCCL default);
- ``signal_tiles``: the signal granularity, tiles per signal unit (group boundaries fall on units);
- ``groups``: the wave grouping, sizes of consecutive groups in signal units; they sum to the
  number of units of an exact-shape row; on an M-range row they are relative weights (see
  ``fo_kernels.plan.resolve_groups``);
- ``layout``: ``row_band`` (every group is a band of whole tile rows, communicated in place) or
  ``tile_major`` (each tile stored as a contiguous block at its group's position, restored after);
- ``wait_mode``: ``stream_wait`` (``cuStreamWaitValue32``) or ``spin`` (a one-program Triton kernel);
- ``overlap: false``: plain GEMM then the collective (the no-gain fallback);
- ``engine``: ``triton`` (the signalled persistent Triton GEMM and NCCL, everything above) or
  ``copy_engine`` (two NVLink peers only: the library GEMM in row chunks, the data moved by the
  GPUs' copy engines and summed in the GEMM's epilogue, no NCCL; see ``fo_kernels.copy_engine``).
  A ``copy_engine`` schedule has ``groups``: the relative row weights of the chunks each rank's
  shard is cut into (on every row, exact or M range), and optionally a ``tile``: then each phase
  is one persistent Triton GEMM with that tile, its tiles signalling per chunk (the tiled mode),
  instead of a library GEMM per chunk. ``exchange: true`` (all_reduce, no tile): the weights cut
  all M rows, and each rank pulls and adds the peer's whole partial, one NVLink hop per byte. The
  other Triton fields stay unset. Its streams wait with ``cuStreamWaitValue32`` (cuda-bindings).

Field-level rules are checked here on construction; rules that need the shape (group sums, band
alignment, divisibility) are checked by ``fo_kernels.plan.make_plan``. Every error names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .errors import ScheduleError

COLLECTIVES = ("all_reduce", "reduce_scatter")
# Operand dtypes by their table name: the one map from names to torch dtypes.
TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DTYPES = tuple(TORCH_DTYPES)
LAYOUTS = ("row_band", "tile_major")
WAIT_MODES = ("stream_wait", "spin")
ENGINES = ("triton", "copy_engine")
# The copy engine moves data between exactly two peers (each rank owns one half of the rows).
COPY_ENGINE_WORLD = 2
# Most chunks per shard a copy_engine schedule may cut (its flag slots are preallocated).
MAX_CHUNKS = 64

# tl.dot needs every block dimension >= 16; 256 is the largest block one Hopper CTA's shared memory
# holds in a 2-stage pipeline at 16-bit inputs.
MIN_BLOCK = 16
MAX_BLOCK = 256
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16)


def dtype_name(dtype: torch.dtype | str) -> str:
    """The table name of an operand dtype (``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``)."""
    if isinstance(dtype, torch.dtype):
        for name, value in TORCH_DTYPES.items():
            if value == dtype:
                return name
        raise ScheduleError(f"dtype: {dtype} is not supported; use one of {', '.join(DTYPES)}")
    if dtype not in TORCH_DTYPES:
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
    # Triton's producer/consumer warp specialization of the K loop (tl.range(warp_specialize=...)).
    warp_specialize: bool = False

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
        if not isinstance(self.warp_specialize, bool):
            raise ScheduleError(f"tile.warp_specialize: expected true or false, got {self.warp_specialize!r}")

    def to_dict(self) -> dict[str, int | bool]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.warp_specialize:
            del out["warp_specialize"]  # the default stays out of the tables
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Tile:
        return _from_mapping(cls, data, "tile")

    def label(self) -> str:
        """The config in a few words, e.g. ``128x256x64 gm8 w8 s3 ws``: logs, reports, search parameters."""
        ws = " ws" if self.warp_specialize else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} gm{self.group_m} w{self.num_warps} "
            f"s{self.num_stages}{ws}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """One overlapped GEMM + collective, fully specified (see the module docstring)."""

    collective: str
    dtype: str
    world_size: int
    problem: Problem
    overlap: bool = True
    engine: str = "triton"
    tile: Tile | None = None
    sms_free: int = 0
    nccl_max_ctas: int = 0
    signal_tiles: int = 1
    groups: tuple[int, ...] = ()
    layout: str = "tile_major"
    wait_mode: str = "stream_wait"
    # engine copy_engine, all_reduce: exchange whole partials (one NVLink hop per byte) instead of
    # reduce-scatter then all-gather (see ``fo_kernels.copy_engine``)
    exchange: bool = False
    # Where the row came from (search id, measured/predicted ms, ...); the runtime ignores it.
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("collective", self.collective, COLLECTIVES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_int("world_size", self.world_size, minimum=1)
        if not isinstance(self.problem, Problem):
            raise ScheduleError(f"problem: expected a Problem, got {type(self.problem).__name__}")
        if not isinstance(self.overlap, bool):
            raise ScheduleError(f"overlap: expected true or false, got {self.overlap!r}")
        if (
            self.problem.m is not None
            and self.collective == "reduce_scatter"
            and self.problem.m % self.world_size
        ):
            raise ScheduleError(
                f"problem.m: reduce_scatter needs M divisible by world_size {self.world_size}, "
                f"got {self.problem.m}"
            )
        _check_choice("engine", self.engine, ENGINES)
        if not isinstance(self.exchange, bool):
            raise ScheduleError(f"exchange: expected true or false, got {self.exchange!r}")
        if self.exchange and (not self.overlap or self.engine != "copy_engine"):
            raise ScheduleError("exchange: only an overlapped engine: copy_engine row exchanges partials")
        if not self.overlap:
            if self.engine != "triton":
                raise ScheduleError(
                    "engine: an overlap: false row runs GEMM then the collective; leave engine out"
                )
            return
        if self.engine == "copy_engine":
            self._check_copy_engine()
            return
        if not isinstance(self.tile, Tile):
            raise ScheduleError("tile: an overlapped schedule needs a tile config")
        _check_int("sms_free", self.sms_free, minimum=0)
        _check_int("nccl_max_ctas", self.nccl_max_ctas, minimum=0)
        _check_int("signal_tiles", self.signal_tiles, minimum=1)
        if self.collective == "reduce_scatter" and self.signal_tiles % self.world_size:
            raise ScheduleError(
                f"signal_tiles: reduce_scatter needs a multiple of world_size {self.world_size} "
                f"(each unit holds the same tile of every rank's shard), got {self.signal_tiles}"
            )
        groups = tuple(self.groups)
        if not groups:
            raise ScheduleError("groups: an overlapped schedule needs at least one group")
        for i, g in enumerate(groups):
            _check_int(f"groups[{i}]", g, minimum=1)
        object.__setattr__(self, "groups", groups)
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("wait_mode", self.wait_mode, WAIT_MODES)

    def _check_copy_engine(self) -> None:
        if self.world_size != COPY_ENGINE_WORLD:
            raise ScheduleError(
                f"engine: copy_engine runs between exactly {COPY_ENGINE_WORLD} GPUs, "
                f"this schedule has world_size {self.world_size}"
            )
        defaults = {f.name: f.default for f in fields(Schedule)}
        if self.tile is not None and not isinstance(self.tile, Tile):
            raise ScheduleError(f"tile: expected a Tile config, got {type(self.tile).__name__}")
        for name in ("sms_free", "nccl_max_ctas", "signal_tiles", "layout", "wait_mode"):
            if getattr(self, name) != defaults[name]:
                raise ScheduleError(f"{name}: not used by engine copy_engine; leave it out")
        if self.exchange and (self.collective != "all_reduce" or self.tile is not None):
            raise ScheduleError("exchange: only all_reduce without a tile (cuBLAS chunks) exchanges partials")
        groups = tuple(self.groups)
        if not groups:
            raise ScheduleError("groups: a copy_engine schedule needs the row weights of its chunks")
        if len(groups) > MAX_CHUNKS:
            raise ScheduleError(f"groups: at most {MAX_CHUNKS} chunks per shard, got {len(groups)}")
        for i, g in enumerate(groups):
            _check_int(f"groups[{i}]", g, minimum=1)
        object.__setattr__(self, "groups", groups)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "collective": self.collective,
            "dtype": self.dtype,
            "world_size": self.world_size,
            "problem": self.problem.to_dict(),
            "overlap": self.overlap,
        }
        if self.overlap and self.engine == "copy_engine":
            out.update(engine=self.engine, groups=list(self.groups))
            if self.tile is not None:
                out["tile"] = self.tile.to_dict()
            if self.exchange:
                out["exchange"] = True
        elif self.overlap:
            assert self.tile is not None
            out.update(
                tile=self.tile.to_dict(),
                sms_free=self.sms_free,
                nccl_max_ctas=self.nccl_max_ctas,
                signal_tiles=self.signal_tiles,
                groups=list(self.groups),
                layout=self.layout,
                wait_mode=self.wait_mode,
            )
        if self.provenance:
            out["provenance"] = dict(self.provenance)
        return out

    @classmethod
    def from_dict(cls, data: Any, *, defaults: Mapping[str, Any] | None = None) -> Schedule:
        """Build from a mapping (a table row); ``defaults`` fill keys the row leaves out."""
        if not isinstance(data, Mapping):
            raise ScheduleError(f"schedule: expected a mapping, got {type(data).__name__}")
        merged = {**(defaults or {}), **data}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise ScheduleError(f"schedule: unknown key(s) {', '.join(unknown)}; valid: {sorted(known)}")
        if "problem" not in merged:
            raise ScheduleError("problem: missing")
        merged["problem"] = Problem.from_dict(merged["problem"])
        if merged.get("tile") is not None:
            merged["tile"] = Tile.from_dict(merged["tile"])
        if "groups" in merged:
            if not isinstance(merged["groups"], (list, tuple)):
                raise ScheduleError(f"groups: expected a list of integers, got {merged['groups']!r}")
            merged["groups"] = tuple(merged["groups"])
        if merged.get("provenance") is None:
            merged["provenance"] = {}
        for key in ("collective", "dtype", "world_size"):
            if key not in merged:
                raise ScheduleError(f"{key}: missing")
        return cls(**merged)

    def describe(self) -> str:
        """A one-line human summary, used in logs and reports."""
        head = f"{self.collective} {self.dtype} w{self.world_size} {self.problem.describe()}"
        if not self.overlap:
            return f"{head}: no overlap (GEMM then collective)"
        t = self.tile
        if self.engine == "copy_engine":
            how = "" if t is None else f", tiled {t.label()}"
            if self.exchange:
                chunks = f"exchange, {len(self.groups)} chunk(s) of M, weights {list(self.groups)}"
            else:
                chunks = f"{len(self.groups)} chunk(s) per shard, weights {list(self.groups)}"
            return f"{head}: copy engine, {chunks}{how}"
        assert t is not None
        return (
            f"{head}: tile {t.label()}, sms_free {self.sms_free}, "
            f"cta cap {self.nccl_max_ctas or 'default'}, "
            f"signal {self.signal_tiles} tiles, groups {list(self.groups)}, {self.layout}, {self.wait_mode}"
        )
