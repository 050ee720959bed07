"""A search space's types and its validating reader (``SearchSpace.from_dict``); the file format
is described in ``fo_tune.space``."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from fo_kernels.errors import FoTuneError, ScheduleError
from fo_kernels.schedule import DTYPES
from fo_kernels.tile import TILE_FLAGS, Tile

# The types, and the readers an engine's space section is built with (fo_tune.engines).
__all__ = [
    "ANY_DEVICE",
    "SPACE_KIND",
    "SPACE_SCHEMA_VERSION",
    "ByteRange",
    "CalibrationPlan",
    "CpuOverrides",
    "SearchSpace",
    "Section",
    "SpaceError",
    "SpaceNotFoundError",
    "SpaceReader",
    "choices",
    "integers",
    "listed",
    "plain",
    "sectioned",
]

SPACE_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
SPACE_KIND = "fo-tune-search-space"
# fo_tune.moe.space's kind (that module imports this package), so an MoE space given to a dense
# search is named as one, not refused key by key.
_MOE_SPACE_KIND = "fo-tune-moe-search-space"
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
def plain(value: Any) -> Any:
    """Sections and tiles to mappings, tuples to lists: what YAML writes."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def _pick(
    cpu: bool, quick: bool, on_cpu: Sequence[Any], quick_gpu: Sequence[Any], full: Sequence[Any]
) -> list:
    """The CPU's values (quick or not: they are already tiny), else the quick or the full GPU ones."""
    return list(on_cpu if cpu else quick_gpu if quick else full)


class Section:
    """``to_dict`` for section dataclasses: one key per field, as in the file."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class ByteRange(Section):
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
class CalibrationPlan(Section):
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
class CpuOverrides(Section):
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
    """One search space file; build it with ``load_space`` or ``from_dict``, which validate.

    ``engines`` maps an engine's exact name to its section (the engine plug-in's dataclass), in
    file order."""

    name: str
    compute_capability: tuple[str, ...]
    tiles: tuple[Tile, ...]
    engines: Mapping[str, Any]
    calibration: CalibrationPlan
    cpu: CpuOverrides
    # Operand dtype -> its own tile candidates, replacing ``tiles`` for that dtype (the key a file
    # may leave out: then every dtype tries ``tiles``).
    dtype_tiles: Mapping[str, tuple[Tile, ...]] = field(default_factory=dict)
    schema_version: int = SPACE_SCHEMA_VERSION
    source: str = field(default="", compare=False)  # the file it was loaded from

    def engine(self, name: str) -> Any | None:
        """The section of engine ``name``, or None when the space leaves the engine out."""
        return self.engines.get(name)

    # ------------------------------------------- the Triton engine's candidates (calibration too)
    @property
    def sms_free(self) -> tuple[int, ...]:
        """SMs left to communication the Triton engine tries (() without its section)."""
        section = self.engine("triton")
        return section.sms_free if section is not None else ()

    @property
    def nccl_max_ctas(self) -> tuple[int, ...]:
        """NCCL CTA caps the Triton engine tries (0: NCCL's default; (0,) without its section)."""
        section = self.engine("triton")
        return section.nccl_max_ctas if section is not None else (0,)

    # ------------------------------------------------------------- effective candidates and sizes
    def tiles_for(self, dtype: str | None = None) -> tuple[Tile, ...]:
        """The GPU tile candidates of operand ``dtype``: its ``dtype_tiles`` list, else ``tiles``."""
        return self.dtype_tiles.get(dtype, self.tiles) if dtype is not None else self.tiles

    def tile_candidates(
        self, *, dtype: str | None = None, quick: bool = False, cpu: bool = False
    ) -> list[Tile]:
        """GEMM tiles to try for operand ``dtype`` (None: ``tiles``): the CPU's, the first
        ``calibration.quick_tiles`` of the dtype's list, or all of it."""
        tiles = self.tiles_for(dtype)
        return _pick(cpu, quick, self.cpu.tiles, tiles[: self.calibration.quick_tiles], tiles)

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
        """The schema-2 document (a schema-1 file comes back in today's format)."""
        return {
            "schema_version": SPACE_SCHEMA_VERSION,
            "kind": SPACE_KIND,
            "name": self.name,
            "compute_capability": list(self.compute_capability),
            "tiles": plain(self.tiles),
            **(
                {"dtype_tiles": {d: plain(t) for d, t in self.dtype_tiles.items()}}
                if self.dtype_tiles
                else {}
            ),
            "engines": {name: plain(section) for name, section in self.engines.items()},
            "calibration": self.calibration.to_dict(),
            "cpu": self.cpu.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<search space>") -> SearchSpace:
        """Validate a parsed document; every error is a ``SpaceError`` naming ``source`` and the key."""
        return _read_space(SpaceReader(source), data)


# ---------------------------------------------------------------------------------- validation
def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _what(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class SpaceReader:
    """Typed reads from a parsed document; every failure names the source and the key path.
    Engine plug-ins read their sections with it."""

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

    def section(self, node: Any, path: str, spec: Mapping[str, Read]) -> dict[str, Any]:
        """Every key of ``spec``, no other, each read by its reader."""
        data = self.mapping(node, path, tuple(spec))
        return {key: read(self, data[key], _join(path, key)) for key, read in spec.items()}

    def each(self, node: Any, path: str, read: Read) -> tuple[Any, ...]:
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
            if key not in TILE_FLAGS:
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
        span = ByteRange(**self.section(node, path, {"min": integers(1), "max": integers(1)}))
        if span.min > span.max:
            self.fail(path, f"min {span.min} > max {span.max}; expected min <= max")
        if not span.sizes():
            self.fail(path, f"no power of two in [{span.min}, {span.max}]; widen the range")
        return span


Read = Callable[[SpaceReader, Any, str], Any]


def integers(minimum: int) -> Read:
    """A reader of one integer >= ``minimum``."""
    return lambda r, node, path: r.integer(node, path, minimum=minimum)


def listed(item: Read) -> Read:
    """A reader of a non-empty list of distinct items."""
    return lambda r, node, path: r.each(node, path, item)


def choices(valid: Sequence[str]) -> Read:
    """A reader of a non-empty list of distinct names out of ``valid``."""
    return listed(lambda r, node, path: r.choice(node, path, valid))


def sectioned(cls: type, spec: Mapping[str, Read]) -> Read:
    """A reader of a mapping with exactly ``spec``'s keys, built into ``cls``."""
    return lambda r, node, path: cls(**r.section(node, path, spec))


# What each section holds, in file order: key -> reader (validates, returns the typed value).
_CALIBRATION = {
    "message_bytes": SpaceReader.byte_range,
    "quick_message_bytes": listed(integers(1)),
    "interference_bytes": listed(integers(1)),
    "quick_interference_bytes": listed(integers(1)),
    "interference_gemm": SpaceReader.shape,
    "quick_interference_sms_free": listed(integers(0)),
    "gemm_shapes": listed(SpaceReader.shape),
    "quick_gemm_shapes": listed(SpaceReader.shape),
    "quick_tiles": integers(1),
}
_CPU = {
    "tiles": listed(SpaceReader.tile),
    "sms_free": listed(integers(0)),
    "nccl_max_ctas": listed(integers(0)),
    "message_bytes": listed(integers(1)),
    "interference_bytes": listed(integers(1)),
    "interference_gemm": SpaceReader.shape,
    "gemm_shapes": listed(SpaceReader.shape),
}
_COMMON = {
    "name": SpaceReader.name,
    "compute_capability": listed(SpaceReader.capability),
    "tiles": listed(SpaceReader.tile),
}
_TAIL = {"calibration": sectioned(CalibrationPlan, _CALIBRATION), "cpu": sectioned(CpuOverrides, _CPU)}


def _read_dtype_tiles(r: SpaceReader, node: Any, path: str) -> dict[str, tuple[Tile, ...]]:
    """``dtype_tiles``: operand dtype names (as ``--dtype`` spells them) -> a tile list each."""
    if not isinstance(node, Mapping) or not node:
        r.fail(
            path,
            f"expected a mapping of operand dtypes ({', '.join(DTYPES)}) to tile lists, got {_what(node)}",
        )
    out = {}
    for dtype, tiles in node.items():
        if dtype not in DTYPES:
            r.fail(_join(path, str(dtype)), f"unknown operand dtype; valid: {', '.join(DTYPES)}")
        out[dtype] = listed(SpaceReader.tile)(r, tiles, _join(path, dtype))
    return out


def _read_engines(r: SpaceReader, node: Any, path: str) -> dict[str, Any]:
    from fo_tune.engines import engine_names, get_tuner

    valid = engine_names()
    if not isinstance(node, Mapping) or not node:
        r.fail(path, f"expected a mapping with at least one of {', '.join(valid)}, got {_what(node)}")
    out = {}
    for name, section in node.items():
        if name not in valid:
            r.fail(_join(path, str(name)), f"unknown engine; valid: {', '.join(valid)}")
        out[name] = get_tuner(name).read_space(r, section, _join(path, name))
    return out


def _read_v1_engines(r: SpaceReader, data: Mapping[str, Any]) -> dict[str, Any]:
    """A schema-1 file's engine keys (at the top level, with their own names) read into sections."""
    from fo_tune.engines import get_tuner

    out = {"triton": get_tuner("triton").read_space_v1(r, data)}
    copy_engine = get_tuner("copy_engine").read_space_v1(r, data)
    if copy_engine is not None:
        out["copy_engine"] = copy_engine
    return out


def _v1_keys() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from fo_tune.engines import get_tuner

    required, optional = get_tuner("triton").v1_keys()
    ce_required, ce_optional = get_tuner("copy_engine").v1_keys()
    return (*required, *ce_required), (*optional, *ce_optional)


def _read_space(r: SpaceReader, data: Any) -> SearchSpace:
    if not isinstance(data, Mapping):
        r.fail("(top level)", f"expected a mapping, got {_what(data)}")
    if data.get("kind") == _MOE_SPACE_KIND:
        r.fail(
            "kind", "an MoE search space, which -c moe reads; give a dense one (search_spaces/hopper.yaml)"
        )
    if "kind" in data and data["kind"] != SPACE_KIND:  # (a table, a calibration, a suite: named first)
        r.fail("kind", f"{data['kind']!r}, not a search space; give one (search_spaces/hopper.yaml)")
    if "schema_version" not in data:
        r.fail("schema_version", f"missing; expected {SPACE_SCHEMA_VERSION}")
    version = data["schema_version"]
    if isinstance(version, bool) or version not in SUPPORTED_SCHEMA_VERSIONS:
        supported = ", ".join(map(str, SUPPORTED_SCHEMA_VERSIONS))
        r.fail("schema_version", f"{version!r} is not supported (supported: {supported})")
    if version == 1:
        required, optional = _v1_keys()
        r.mapping(data, "", ("schema_version", "kind", *_COMMON, *required, *_TAIL), optional=optional)
    else:
        r.mapping(
            data, "", ("schema_version", "kind", *_COMMON, "engines", *_TAIL), optional=("dtype_tiles",)
        )
    common = {key: read(r, data[key], key) for key, read in _COMMON.items()}
    engines = _read_v1_engines(r, data) if version == 1 else _read_engines(r, data["engines"], "engines")
    tail = {key: read(r, data[key], key) for key, read in _TAIL.items()}
    dtype_tiles = _read_dtype_tiles(r, data["dtype_tiles"], "dtype_tiles") if "dtype_tiles" in data else {}
    space = SearchSpace(
        schema_version=version, source=r.source, engines=engines, dtype_tiles=dtype_tiles, **common, **tail
    )
    cal = space.calibration
    for i, value in enumerate(cal.quick_interference_sms_free):
        if space.sms_free and value not in space.sms_free:
            r.fail(f"calibration.quick_interference_sms_free[{i}]", f"{value} is not one of sms_free")
    if cal.quick_tiles > len(space.tiles):
        r.fail("calibration.quick_tiles", f"{cal.quick_tiles} > the {len(space.tiles)} tiles listed")
    return space
