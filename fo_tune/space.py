"""Search spaces: what the tuner and the calibration explore on one GPU family.

This module owns the format of ``search_spaces/*.yaml``, its validation and the choice of file for
a device. A file (``schema_version: 1``, ``kind: fo-tune-search-space``) lists the GEMM tile
candidates, the SMs left to communication, the NCCL CTA caps, the signal granularities, the grouping
limit, layouts, wait modes, the calibration plan (full and ``--quick``) and a ``cpu`` section with
tiny sizes for runs on the CPU (gloo and the Triton interpreter). The shipped files document every
key; ``SearchSpace`` methods return the effective candidates for CPU vs GPU and quick vs full.

``space_for(cc)`` loads every ``*.yaml`` of a folder and returns the one whose
``compute_capability`` list names ``cc`` (``"9.0"``), else the catch-all (``["*"]``, the shipped
``default.yaml``); ``"cpu"`` gets the catch-all too. Every error is a ``SpaceError`` whose message
starts with the file and the key path (``search_spaces/x.yaml: sms_free[3]: ...``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

from fo_kernels.errors import FoTuneError, ScheduleError
from fo_kernels.files import read_yaml
from fo_kernels.schedule import LAYOUTS, MAX_CHUNKS, WAIT_MODES, Tile

__all__ = [
    "ANY_DEVICE",
    "SIGNAL_KINDS",
    "SPACE_KIND",
    "SPACE_SCHEMA_VERSION",
    "ByteRange",
    "CalibrationPlan",
    "CpuOverrides",
    "GroupingSpace",
    "SearchSpace",
    "SignalSpace",
    "SpaceError",
    "SpaceNotFoundError",
    "load_space",
    "packaged_spaces_dir",
    "space_for",
]

SPACE_SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
SPACE_KIND = "fo-tune-search-space"
SIGNAL_KINDS = ("band", "wave")  # a unit = multiple x (a band of group_m tile rows | a wave of the grid)
ANY_DEVICE = "*"
_CAPABILITY = re.compile(r"^(\d+\.\d+|cpu|\*)$")
_TILE_REQUIRED = ("block_m", "block_n", "block_k")
_TILE_OPTIONAL = tuple(f.name for f in fields(Tile) if f.name not in _TILE_REQUIRED)

Shape = tuple[int, int, int]


class SpaceError(FoTuneError, ValueError):
    """A search space that is malformed; the message names the file and the key path."""


class SpaceNotFoundError(SpaceError, FileNotFoundError):
    """A search space file, or a folder's file for a device, that does not exist."""


# ------------------------------------------------------------------------------------ the types
def _plain(value: Any) -> Any:
    """Sections and tiles to mappings, tuples to lists: what YAML writes."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _pick(
    cpu: bool, quick: bool, on_cpu: Sequence[Any], quick_gpu: Sequence[Any], full: Sequence[Any]
) -> list:
    """The CPU's values (quick or not: they are already tiny), else the quick or the full GPU ones."""
    return list(on_cpu if cpu else quick_gpu if quick else full)


class _Section:
    """``to_dict`` for the dataclasses below: one key per field, as in the file."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class SignalSpace(_Section):
    """Signal granularities: a unit is ``multiple`` x (a band of group_m tile rows | a grid wave)."""

    kinds: tuple[str, ...]
    multiples: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupingSpace(_Section):
    """How the signal units may be grouped: at most ``max_groups`` groups per call."""

    max_groups: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ByteRange(_Section):
    """Message sizes: every power of two in [min, max]."""

    min: int
    max: int

    def sizes(self) -> list[int]:
        size, out = 1 << max(0, self.min - 1).bit_length(), []
        while size <= self.max:
            out.append(size)
            size <<= 1
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationPlan(_Section):
    """What the GPU calibration measures, full and ``--quick``."""

    message_bytes: ByteRange
    quick_message_bytes: tuple[int, ...]
    interference_bytes: tuple[int, ...]
    quick_interference_bytes: tuple[int, ...]
    interference_gemm: Shape
    quick_interference_sms_free: tuple[int, ...]
    gemm_shapes: tuple[Shape, ...]
    quick_gemm_shapes: tuple[Shape, ...]
    quick_tiles: int  # --quick profiles the first quick_tiles tiles


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuOverrides(_Section):
    """What replaces the GPU candidates and sizes on the CPU (quick and full alike)."""

    tiles: tuple[Tile, ...]
    sms_free: tuple[int, ...]
    nccl_max_ctas: tuple[int, ...]
    message_bytes: tuple[int, ...]
    interference_bytes: tuple[int, ...]
    interference_gemm: Shape
    gemm_shapes: tuple[Shape, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """One search space file; build it with ``load_space`` or ``from_dict``, which validate."""

    name: str
    compute_capability: tuple[str, ...]
    tiles: tuple[Tile, ...]
    sms_free: tuple[int, ...]
    nccl_max_ctas: tuple[int, ...]
    signal: SignalSpace
    grouping: GroupingSpace
    layouts: tuple[str, ...]
    wait_modes: tuple[str, ...]
    calibration: CalibrationPlan
    cpu: CpuOverrides
    # engine copy_engine (two NVLink GPUs): the chunk counts per shard a measured search times
    # beside its best Triton schedules; () leaves the engine out.
    copy_engine_chunks: tuple[int, ...] = ()
    # ... and chunk weights beyond the uniform ones (e.g. a light last chunk: a shorter tail)
    copy_engine_weights: tuple[tuple[int, ...], ...] = ()
    # ... its tiled mode (one persistent Triton GEMM per phase): these chunk counts with each of
    # these tiles (16-bit inputs: not tried for float32)
    copy_engine_tiled_chunks: tuple[int, ...] = ()
    copy_engine_tiles: tuple[Tile, ...] = ()
    schema_version: int = SPACE_SCHEMA_VERSION
    source: str = field(default="", compare=False)  # the file it was loaded from

    # ------------------------------------------------------------- effective candidates and sizes
    def tile_candidates(self, *, quick: bool = False, cpu: bool = False) -> list[Tile]:
        """GEMM tiles to try: the CPU's, the first ``calibration.quick_tiles``, or all."""
        return _pick(cpu, quick, self.cpu.tiles, self.tiles[: self.calibration.quick_tiles], self.tiles)

    def sms_free_candidates(self, *, cpu: bool = False) -> list[int]:
        """SMs left to communication to try (persistent grid = SMs - r)."""
        return list(self.cpu.sms_free if cpu else self.sms_free)

    def caps(self, *, cpu: bool = False) -> list[int]:
        """NCCL CTA caps to try (0: NCCL's default)."""
        return list(self.cpu.nccl_max_ctas if cpu else self.nccl_max_ctas)

    def message_sizes(self, *, quick: bool = False, cpu: bool = False) -> list[int]:
        """Bytes per collective for the bandwidth curve (full: every power of two in the range)."""
        c = self.calibration
        return _pick(cpu, quick, self.cpu.message_bytes, c.quick_message_bytes, c.message_bytes.sizes())

    def interference_sizes(self, *, quick: bool = False, cpu: bool = False) -> list[int]:
        """Bytes per collective timed beside a running GEMM."""
        c = self.calibration
        return _pick(
            cpu, quick, self.cpu.interference_bytes, c.quick_interference_bytes, c.interference_bytes
        )

    def interference_sms_free(self, *, quick: bool = False, cpu: bool = False) -> list[int]:
        """SMs left free while measuring interference."""
        c = self.calibration
        return _pick(cpu, quick, self.cpu.sms_free, c.quick_interference_sms_free, self.sms_free)

    def interference_gemm(self, *, cpu: bool = False) -> Shape:
        """(M, N, K) of the GEMM run beside the collective."""
        return self.cpu.interference_gemm if cpu else self.calibration.interference_gemm

    def gemm_shapes(self, *, quick: bool = False, cpu: bool = False) -> list[Shape]:
        """(M, N, K) shapes whose GEMM tiles are profiled."""
        c = self.calibration
        return _pick(cpu, quick, self.cpu.gemm_shapes, c.quick_gemm_shapes, c.gemm_shapes)

    # ------------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        head = {"schema_version": self.schema_version, "kind": SPACE_KIND}
        extra = {key: _plain(getattr(self, key)) for key in _OPTIONAL if getattr(self, key)}
        return {**head, **{key: _plain(getattr(self, key)) for key in _SPACE}, **extra}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<search space>") -> SearchSpace:
        """Validate a parsed document; every error is a ``SpaceError`` naming ``source`` and the key."""
        return _read_space(_Reader(source), data)


# ---------------------------------------------------------------------------------- validation
def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _what(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class _Reader:
    """Typed reads from a parsed document; every failure names the source and the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> NoReturn:
        raise SpaceError(f"{self.source}: {path}: {message}" if path else f"{self.source}: {message}")

    def mapping(self, node: Any, path: str, keys: Sequence[str], optional: Sequence[str] = ()) -> Mapping:
        if not isinstance(node, Mapping):
            self.fail(path or "(top level)", f"expected a mapping, got {_what(node)}")
        valid = [*keys, *optional]
        unknown = sorted(str(key) for key in node if key not in valid)
        if unknown:
            also = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
            self.fail(_join(path, unknown[0]), f"unknown key{also}; valid: {', '.join(valid)}")
        missing = [key for key in keys if key not in node]
        if missing:
            self.fail(_join(path, missing[0]), "missing")
        return node

    def section(self, node: Any, path: str, spec: Mapping[str, _Read]) -> dict[str, Any]:
        """Every key of ``spec``, no other, each read by its reader."""
        data = self.mapping(node, path, tuple(spec))
        return {key: read(self, data[key], _join(path, key)) for key, read in spec.items()}

    def each(self, node: Any, path: str, read: _Read) -> tuple[Any, ...]:
        """A non-empty list of distinct items, each read by ``read``."""
        if not isinstance(node, list) or not node:
            self.fail(
                path, f"expected a non-empty list, got {'an empty list' if node == [] else _what(node)}"
            )
        values = tuple(read(self, item, f"{path}[{i}]") for i, item in enumerate(node))
        for i, value in enumerate(values):
            if value in values[:i]:
                self.fail(f"{path}[{i}]", f"repeats {path}[{values.index(value)}]; list each value once")
        return values

    def integer(self, node: Any, path: str, *, minimum: int) -> int:
        if isinstance(node, bool) or not isinstance(node, int) or node < minimum:
            what = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
            self.fail(path, f"expected {'a positive integer' if minimum == 1 else what}, got {node!r}")
        return node

    def choice(self, node: Any, path: str, valid: Sequence[str]) -> str:
        if not isinstance(node, str) or node not in valid:
            self.fail(path, f"{node!r} is not one of {', '.join(valid)}")
        return node

    def shape(self, node: Any, path: str) -> Shape:
        if not isinstance(node, list) or len(node) != 3:
            self.fail(path, f"expected [M, N, K], a list of 3 positive integers, got {node!r}")
        m, n, k = (self.integer(v, f"{path}[{i}]", minimum=1) for i, v in enumerate(node))
        return (m, n, k)

    def tile(self, node: Any, path: str) -> Tile:
        data = self.mapping(node, path, _TILE_REQUIRED, _TILE_OPTIONAL)
        for key, value in data.items():  # Tile would take true for 1
            if key != "warp_specialize":
                self.integer(value, f"{path}.{key}", minimum=1)
        try:
            return Tile(**data)
        except ScheduleError as exc:  # "tile.block_m: must be ..." -> "tiles[2].block_m: must be ..."
            message = str(exc)
            where = f"{path}.{message[5:]}" if message.startswith("tile.") else f"{path}: {message}"
            raise SpaceError(f"{self.source}: {where}") from None

    def capability(self, node: Any, path: str) -> str:
        if not isinstance(node, str) or not _CAPABILITY.match(node):
            self.fail(path, f'expected a quoted string like "9.0", "cpu" or "*" (any device), got {node!r}')
        return node

    def name(self, node: Any, path: str) -> str:
        if not isinstance(node, str) or not node:
            self.fail(path, f"expected a non-empty string, got {node!r}")
        return node

    def byte_range(self, node: Any, path: str) -> ByteRange:
        span = ByteRange(**self.section(node, path, {"min": _int(1), "max": _int(1)}))
        if span.min > span.max:
            self.fail(path, f"min {span.min} > max {span.max}; expected min <= max")
        if not span.sizes():
            self.fail(path, f"no power of two in [{span.min}, {span.max}]; widen the range")
        return span


_Read = Callable[[_Reader, Any, str], Any]


def _int(minimum: int) -> _Read:
    return lambda r, node, path: r.integer(node, path, minimum=minimum)


def _list(item: _Read) -> _Read:
    return lambda r, node, path: r.each(node, path, item)


def _choices(valid: Sequence[str]) -> _Read:
    return _list(lambda r, node, path: r.choice(node, path, valid))


def _section(cls: type, spec: Mapping[str, _Read]) -> _Read:
    return lambda r, node, path: cls(**r.section(node, path, spec))


# What each section holds, in file order: key -> reader (validates, returns the typed value).
_CALIBRATION = {
    "message_bytes": _Reader.byte_range,
    "quick_message_bytes": _list(_int(1)),
    "interference_bytes": _list(_int(1)),
    "quick_interference_bytes": _list(_int(1)),
    "interference_gemm": _Reader.shape,
    "quick_interference_sms_free": _list(_int(0)),
    "gemm_shapes": _list(_Reader.shape),
    "quick_gemm_shapes": _list(_Reader.shape),
    "quick_tiles": _int(1),
}
_CPU = {
    "tiles": _list(_Reader.tile),
    "sms_free": _list(_int(0)),
    "nccl_max_ctas": _list(_int(0)),
    "message_bytes": _list(_int(1)),
    "interference_bytes": _list(_int(1)),
    "interference_gemm": _Reader.shape,
    "gemm_shapes": _list(_Reader.shape),
}
_SPACE = {
    "name": _Reader.name,
    "compute_capability": _list(_Reader.capability),
    "tiles": _list(_Reader.tile),
    "sms_free": _list(_int(0)),
    "nccl_max_ctas": _list(_int(0)),
    "signal": _section(SignalSpace, {"kinds": _choices(SIGNAL_KINDS), "multiples": _list(_int(1))}),
    "grouping": _section(GroupingSpace, {"max_groups": _int(1)}),
    "layouts": _choices(LAYOUTS),
    "wait_modes": _choices(WAIT_MODES),
    "calibration": _section(CalibrationPlan, _CALIBRATION),
    "cpu": _section(CpuOverrides, _CPU),
}


def _weights(r: _Reader, node: Any, path: str) -> tuple[int, ...]:
    """One schedule's chunk weights: 2 to MAX_CHUNKS positive integers (repeats allowed)."""
    if not isinstance(node, list) or not 2 <= len(node) <= MAX_CHUNKS:
        r.fail(path, f"expected a list of 2 to {MAX_CHUNKS} chunk weights, got {node!r}")
    return tuple(r.integer(w, f"{path}[{i}]", minimum=1) for i, w in enumerate(node))


# Keys a space may leave out.
_OPTIONAL = {
    "copy_engine_chunks": _list(_int(1)),
    "copy_engine_weights": _list(_weights),
    "copy_engine_tiled_chunks": _list(_int(1)),
    "copy_engine_tiles": _list(_Reader.tile),
}
# The optional chunk-count lists, each bounded by the engine's flag slots (MAX_CHUNKS).
_CHUNK_LISTS = ("copy_engine_chunks", "copy_engine_tiled_chunks")


def _read_space(r: _Reader, data: Any) -> SearchSpace:
    if not isinstance(data, Mapping):
        r.fail("(top level)", f"expected a mapping, got {_what(data)}")
    if "schema_version" not in data:
        r.fail("schema_version", f"missing; expected {SPACE_SCHEMA_VERSION}")
    version = data["schema_version"]
    if isinstance(version, bool) or version not in SUPPORTED_SCHEMA_VERSIONS:
        supported = ", ".join(map(str, SUPPORTED_SCHEMA_VERSIONS))
        r.fail("schema_version", f"{version!r} is not supported (supported: {supported})")
    r.mapping(data, "", ("schema_version", "kind", *_SPACE), optional=tuple(_OPTIONAL))
    if data["kind"] != SPACE_KIND:
        r.fail("kind", f"expected {SPACE_KIND!r}, got {data['kind']!r}")
    body = {key: value for key, value in data.items() if key not in ("schema_version", "kind", *_OPTIONAL)}
    extra = {key: read(r, data[key], key) for key, read in _OPTIONAL.items() if key in data}
    space = SearchSpace(schema_version=version, source=r.source, **r.section(body, "", _SPACE), **extra)
    for key in _CHUNK_LISTS:
        for i, chunks in enumerate(getattr(space, key)):
            if chunks > MAX_CHUNKS:
                r.fail(f"{key}[{i}]", f"{chunks} > {MAX_CHUNKS}, the most chunks a schedule may cut")
    if bool(space.copy_engine_tiled_chunks) != bool(space.copy_engine_tiles):
        r.fail(
            "copy_engine_tiled_chunks" if space.copy_engine_tiles else "copy_engine_tiles",
            "the tiled mode needs both copy_engine_tiled_chunks and copy_engine_tiles (or neither)",
        )
    cal = space.calibration
    for i, value in enumerate(cal.quick_interference_sms_free):
        if value not in space.sms_free:
            r.fail(f"calibration.quick_interference_sms_free[{i}]", f"{value} is not one of sms_free")
    if cal.quick_tiles > len(space.tiles):
        r.fail("calibration.quick_tiles", f"{cal.quick_tiles} > the {len(space.tiles)} tiles listed")
    return space


# ------------------------------------------------------------------------------- files and lookup
def packaged_spaces_dir() -> Path:
    """The repository's ``search_spaces/`` folder (beside the ``fo_tune`` package)."""
    return Path(__file__).resolve().parents[1] / "search_spaces"


def load_space(path: str | Path) -> SearchSpace:
    """Read and validate one search space file."""
    data = read_yaml(
        path,
        error=SpaceError,
        missing=SpaceNotFoundError,
        missing_hint=f"no search space file here; the shipped ones are in {packaged_spaces_dir()}",
    )
    return SearchSpace.from_dict(data, source=str(path))


def space_for(compute_capability: str, *, directory: Path | None = None) -> SearchSpace:
    """The space of ``directory`` (default: the packaged one) that names ``compute_capability``
    (``"9.0"``), else its catch-all (``compute_capability: ["*"]``); ``"cpu"`` gets the catch-all.

    Every ``*.yaml`` there is loaded and validated; two files naming the same device are an error.
    """
    folder = Path(directory) if directory is not None else packaged_spaces_dir()
    if not folder.is_dir():
        raise SpaceNotFoundError(f"{folder}: no such folder of search spaces")
    spaces = [load_space(p) for p in sorted(folder.glob("*.yaml"))]
    named = [s for s in spaces if compute_capability in s.compute_capability and compute_capability != "*"]
    catch_all = [s for s in spaces if ANY_DEVICE in s.compute_capability]
    for matches in (named, catch_all):
        if len(matches) > 1:
            files = " and ".join(s.source for s in matches)
            raise SpaceError(f"{folder}: compute_capability: {files} both apply to {compute_capability!r}")
        if matches:
            return matches[0]
    raise SpaceNotFoundError(
        f"{folder}: no search space for compute capability {compute_capability!r} and no catch-all "
        f'file (compute_capability: ["*"], as the shipped default.yaml)'
    )
