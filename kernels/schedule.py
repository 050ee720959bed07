"""The schedule contract: what the tuner writes and the runtime reads.

A ``Schedule`` fixes everything one overlapped op does for one problem (or an M range of it). It
is common fields plus the settings of exactly one engine (a tagged union):

- ``collective``, ``dtype``, ``world_size`` and the ``problem`` (exact M, N, K, or [m_min, m_max]
  for fixed N, K);
- ``settings``: ``None`` for ``overlap: false`` (plain GEMM then the collective, the baseline every
  engine is judged against), else one engine's settings, registered by the engine's exact name
  (``fo_kernels.engines.ENGINES``; ``settings_type`` names the valid ones):

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
    ``fo_kernels.engines.copy_engine``): ``mode`` (``ring``: a cuBLAS GEMM per row chunk; ``tiled``: each
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

import functools
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fo_kernels.errors import ScheduleError
from fo_kernels.fields import check_choice, check_int, check_record, from_mapping
from fo_kernels.tile import Tile

# all_gather is the column-parallel direction, AllGather + GEMM: rank r's (M/w, K) shard of A is
# gathered at rows [r*M/w, (r+1)*M/w) and the gathered (M, K) A multiplied by B. Its problem's M is
# the gathered M (world_size x the shard's rows), as reduce_scatter's M is the unscattered one.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# The collectives whose rows are split over the ranks: M must be divisible by world_size.
SHARDED_COLLECTIVES = ("reduce_scatter", "all_gather")
# Operand dtypes by their table name: the one map from names to torch dtypes. A schedule's dtype
# is its operands' (a and b): fp8 calls (``fo_kernels.scaling``) look up ``float8_e4m3fn`` rows,
# whatever their ``out_dtype``.
TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPES = tuple(TORCH_DTYPES)


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """The GEMM problem a schedule is for: exact ``m`` or the range ``[m_min, m_max]``, and N, K."""

    n: int
    k: int
    m: int | None = None
    m_min: int | None = None
    m_max: int | None = None

    def __post_init__(self) -> None:
        check_int("problem.n", self.n, minimum=1)
        check_int("problem.k", self.k, minimum=1)
        if self.m is not None:
            check_int("problem.m", self.m, minimum=1)
            if self.m_min is not None or self.m_max is not None:
                raise ScheduleError("problem: give either m or m_min/m_max, not both")
        else:
            if self.m_min is None or self.m_max is None:
                raise ScheduleError("problem: needs m, or both m_min and m_max")
            check_int("problem.m_min", self.m_min, minimum=1)
            check_int("problem.m_max", self.m_max, minimum=1)
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
        return from_mapping(cls, data, "problem")

    def describe(self) -> str:
        """``MxNxK``, the M a range ``[lo,hi]`` for an M-range row."""
        m = str(self.m) if self.m is not None else f"[{self.m_min},{self.m_max}]"
        return f"{m}x{self.n}x{self.k}"


class EngineSettings(ABC):
    """One engine's part of a schedule. Subclasses are frozen dataclasses registered under their
    engine's exact name (``fo_kernels.engines.ENGINES``); ``ENGINE`` is that name."""

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


def settings_type(engine: Any) -> type[EngineSettings]:
    """The settings type of the engine named ``engine`` (``fo_kernels.engines.ENGINES``); an unknown
    name lists the valid ones."""
    from fo_kernels.engines import engine_settings

    return engine_settings(engine)


def settings_from_mapping(cls: type, data: Any) -> Any:
    """An engine's settings dataclass ``cls`` from a row's ``settings`` mapping (its ``tile`` parsed)."""
    if data is None:  # (left out, or left empty, in a hand-edited row)
        raise ScheduleError(f"settings: missing; an overlapped row gives its {cls.ENGINE} engine's settings")
    if not isinstance(data, Mapping):
        raise ScheduleError(f"settings: expected a mapping, got {type(data).__name__}")
    merged = dict(data)
    if merged.get("tile") is not None:
        merged["tile"] = Tile.from_dict(merged["tile"])
    return from_mapping(cls, merged, f"settings ({cls.ENGINE})")


# The encoder of a schedule's ``op_text`` (json.dumps(..., sort_keys=True, separators=(",", ":"))
# makes an encoder per call, a tenth of building a table's row; a 100,000-row table builds each).
OP_TEXT_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
# The key of a row's ``settings`` mapping among those already built: JSON tells ``true`` from
# ``1`` and ``1.0`` (equal, and hashed alike, as Python values), so a row whose fields differ in
# type from a built one's is built and checked on its own.
_SETTINGS_KEY_ENCODER = json.JSONEncoder(separators=(",", ":"))
# Distinct settings remembered while rows are built. A table's rows share few of them (a tile,
# groups and weights chosen from a small space: the 100,000-row test table has under 1,000), and
# building one is most of building a row; the settings are frozen, so rows share them safely.
SETTINGS_CACHE_SIZE = 8192


@functools.lru_cache(maxsize=SETTINGS_CACHE_SIZE)
def _settings_from_key(engine: str, key: str) -> EngineSettings:
    """The settings of ``engine`` from their mapping's JSON ``key`` (``_SETTINGS_KEY_ENCODER``)."""
    return settings_type(engine).from_dict(json.loads(key))


def settings_for_row(engine: Any, data: Any) -> EngineSettings:
    """``engine``'s settings from a row's ``settings`` mapping, shared with the rows before it that
    have the same mapping; errors as ``settings_type(engine).from_dict``'s."""
    if isinstance(engine, str) and isinstance(data, Mapping):
        try:
            key = _SETTINGS_KEY_ENCODER.encode(data)
        except (TypeError, ValueError):  # a value JSON cannot hold (from YAML): built on its own
            pass
        else:
            return _settings_from_key(engine, key)
    return settings_type(engine).from_dict(data)


@functools.lru_cache(maxsize=SETTINGS_CACHE_SIZE)
def _settings_text(settings: EngineSettings) -> str:
    """``settings.to_dict()`` as ``OP_TEXT_ENCODER`` writes it (settings equal as dataclasses write
    the same text: their fields' types are checked)."""
    return OP_TEXT_ENCODER.encode(settings.to_dict())


@functools.cache
def _json_str(name: str) -> str:
    """A checked name (collective, dtype, engine) as JSON writes it."""
    return OP_TEXT_ENCODER.encode(name)


def _op_text(schedule: Schedule) -> str:
    """``OP_TEXT_ENCODER.encode`` of the schedule's dict without provenance and basis, assembled
    from its parts in the encoder's key order (the settings' text shared by equal settings)."""
    head = f'{{"collective":{_json_str(schedule.collective)},"dtype":{_json_str(schedule.dtype)},'
    p = schedule.problem
    if p.m is not None:
        problem = f'{{"k":{int(p.k)},"m":{int(p.m)},"n":{int(p.n)}}}'
    else:
        problem = f'{{"k":{int(p.k)},"m_max":{int(p.m_max)},"m_min":{int(p.m_min)},"n":{int(p.n)}}}'  # type: ignore[arg-type]
    tail = f'"problem":{problem},'
    if schedule.settings is None:
        return f'{head}"overlap":false,{tail}"world_size":{int(schedule.world_size)}}}'
    engine = _json_str(schedule.settings.ENGINE)
    try:
        settings = _settings_text(schedule.settings)
    except TypeError:  # settings of a plug-in that are not hashable: written each time
        settings = OP_TEXT_ENCODER.encode(schedule.settings.to_dict())
    return f'{head}"engine":{engine},{tail}"settings":{settings},"world_size":{int(schedule.world_size)}}}'


# The keys of a schedule's mapping.
_SCHEDULE_KEYS = frozenset(
    ("collective", "dtype", "world_size", "problem", "overlap", "engine", "settings", "provenance", "basis")
)
# The keys of a table row (the header gives collective, dtype and world_size).
_ROW_KEYS = ("problem", "overlap", "engine", "settings", "provenance", "basis")


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
    # What a row's numbers rest on where they are not its own machine's measurements (a calibration
    # extrapolated to another world size: ``fo_tune.calibrate.extrapolate``); "" otherwise. Written
    # only when set, so tables without it load; the runtime ignores it, as the provenance.
    basis: str = ""
    # The schedule as the custom ops' ``schedule`` argument: its JSON without the provenance, made
    # once here, so that torch.compile reads it as a constant attribute (``fo_kernels.ops``).
    op_text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_choice("collective", self.collective, COLLECTIVES)
        check_choice("dtype", self.dtype, DTYPES)
        check_int("world_size", self.world_size, minimum=1)
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
        check_record("provenance", self.provenance)
        if not isinstance(self.basis, str):
            raise ScheduleError(f"basis: expected a string, got {type(self.basis).__name__}")
        object.__setattr__(self, "op_text", _op_text(self))

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
        if self.basis:
            out["basis"] = self.basis
        return out

    @classmethod
    def from_dict(cls, data: Any, *, defaults: Mapping[str, Any] | None = None) -> Schedule:
        """Build from a mapping (a table row); ``defaults`` fill keys the row leaves out."""
        if not isinstance(data, Mapping):
            raise ScheduleError(f"schedule: expected a mapping, got {type(data).__name__}")
        merged = {**(defaults or {}), **data}
        extra = merged.keys() - _SCHEDULE_KEYS
        if extra:
            unknown = ", ".join(sorted(map(str, extra)))
            raise ScheduleError(f"schedule: unknown key(s) {unknown}; valid: {sorted(_SCHEDULE_KEYS)}")
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
            settings = settings_for_row(merged["engine"], merged.get("settings"))
        elif "engine" in merged or "settings" in merged:
            raise ScheduleError("engine: an overlap: false row runs GEMM then the collective; leave it out")
        return cls(
            collective=merged["collective"],
            dtype=merged["dtype"],
            world_size=merged["world_size"],
            problem=Problem.from_dict(merged["problem"]),
            settings=settings,
            provenance=merged.get("provenance") or {},
            basis=merged.get("basis") or "",
        )

    def describe(self) -> str:
        """A one-line human summary, used in logs and reports."""
        head = f"{self.collective} {self.dtype} w{self.world_size} {self.problem.describe()}"
        if self.settings is None:
            return f"{head}: no overlap (GEMM then collective)"
        return f"{head}: engine {self.settings.ENGINE}, {self.settings.describe()}"
