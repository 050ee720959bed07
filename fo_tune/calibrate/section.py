"""A calibration's checked rows: the error types, the engine sections and their points.

``read_point`` turns one mapping of a YAML file into a point dataclass, refusing missing or unknown
keys and values of the wrong type (naming where); fields with defaults are newer ones that older
files lack. ``EngineCalibration`` is an engine's section of a ``Calibration``
(``fo_tune.calibrate.calibration``): named scalars with their sources and the measured points behind
them; ``MoeHost`` the MoE path's host times (``read_moe_host`` checks one).
"""

from __future__ import annotations

import functools
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from fo_kernels.errors import FoTuneError


class CalibrationError(FoTuneError, ValueError):
    """A calibration file that is malformed or of an unknown schema."""


class CalibrationNotFoundError(CalibrationError, FileNotFoundError):
    """A calibration file that does not exist."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Quantity:
    """One calibrated scalar and where it comes from (a measurement, a probe, a fit to rows)."""

    value: float
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class LibraryGemmPoint:
    """A library (cuBLAS) GEMM of one chunk shape: with pauses of its own length between calls
    (paced) and back to back (sustained: the card at its power limit)."""

    m: int
    n: int
    k: int
    beta: int  # 0: C = A @ B; 1: C += A @ B (the copy engine's second step)
    paced_ms: float
    sustained_ms: float
    measured_on: str = ""  # another GPU's device key (a sibling of the same die); "": this GPU


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyPoint:
    """One copy-engine copy: ``peer`` (reading the peer GPU's memory) or ``local``."""

    kind: str
    size_bytes: int
    time_ms: float


@dataclass(frozen=True, kw_only=True, slots=True)
class HostPoint:
    """A copy-engine call's host time per rank at ``world`` peers, measured with that many virtual
    ranks in one process on one GPU (``fo_tune.engines.copy_engine.calibrate_n``): ``ops`` the
    operations one rank's eager call issues (mean over the ranks), ``eager_ms`` one rank's issue of
    them, ``graph_ms`` one rank's share of a replay of every rank's call captured in one graph;
    ``chunks`` equal chunks per shard; ``measured_on`` the device key of the GPU that measured it
    where that is not the calibration's own model (a sibling of the same die, ``--into-sibling``),
    "" where it is."""

    world: int
    collective: str
    chunks: int
    ops: float
    eager_ms: float
    graph_ms: float
    measured_on: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeHost:
    """The expert-parallel FFN's host times on one rank (ms; ``fo-tune calibrate --only moe_host``,
    ``fo_tune.moe.host``): ``phase1_ms`` and ``phase2_ms`` of one piece, ``call_ms`` of a whole
    call at world size 1 through the no-overlap path, each the median over ``shapes`` (their
    labels) of medians of ``reps`` calls; ``measured_on`` as a ``HostPoint``'s."""

    phase1_ms: float
    phase2_ms: float
    call_ms: float
    shapes: str
    reps: int
    measured_on: str = ""


def read_moe_host(row: Any, where: str) -> MoeHost:
    """``row`` as a ``MoeHost`` (``read_point``), its times positive and finite."""
    record = read_point(MoeHost, row, where)
    for name in ("phase1_ms", "phase2_ms", "call_ms"):
        value = getattr(record, name)
        if not 0 < value < math.inf:
            raise CalibrationError(f"{where}.{name}: expected a positive time in ms, got {value!r}")
    if record.reps < 1:
        raise CalibrationError(f"{where}.reps: expected a count >= 1, got {record.reps!r}")
    return record


@dataclass(kw_only=True, slots=True)
class EngineCalibration:
    """An engine's section: named scalars with their sources, and the measured points behind them
    (``host``: the copy engine's host time per rank at N peers; absent from files written before
    it was measured). A point's ``measured_on`` is written only where it is set."""

    params: dict[str, Quantity] = field(default_factory=dict)
    library_gemm: list[LibraryGemmPoint] = field(default_factory=list)
    copies: list[CopyPoint] = field(default_factory=list)
    host: list[HostPoint] = field(default_factory=list)

    def values(self) -> dict[str, float]:
        return {name: q.value for name, q in self.params.items()}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"params": {name: asdict(q) for name, q in self.params.items()}}
        if self.library_gemm:
            out["library_gemm"] = [point_dict(p) for p in self.library_gemm]
        if self.copies:
            out["copies"] = [asdict(p) for p in self.copies]
        if self.host:
            out["host"] = [point_dict(p) for p in self.host]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> EngineCalibration:
        if not isinstance(data, dict):
            raise CalibrationError(f"{where}: expected a mapping")
        unknown = sorted(set(data) - {"params", "library_gemm", "copies", "host"})
        if unknown:
            raise CalibrationError(
                f"{where}: unknown key(s) {unknown}; valid: params, library_gemm, copies, host"
            )
        params = data.get("params") or {}
        if not isinstance(params, dict):
            raise CalibrationError(f"{where}.params: expected a mapping of name: {{value, source}}")
        return cls(
            params={str(k): read_point(Quantity, v, f"{where}.params.{k}") for k, v in params.items()},
            library_gemm=[
                read_point(LibraryGemmPoint, row, f"{where}.library_gemm[{i}]")
                for i, row in enumerate(data.get("library_gemm") or [])
            ],
            copies=[
                read_point(CopyPoint, row, f"{where}.copies[{i}]")
                for i, row in enumerate(data.get("copies") or [])
            ],
            host=[
                read_point(HostPoint, row, f"{where}.host[{i}]")
                for i, row in enumerate(data.get("host") or [])
            ],
        )


def point_dict(point: Any) -> dict[str, Any]:
    """A point as a file's mapping, without ``measured_on`` where it has one that is "" (the
    calibration's own GPU: the files of calibrations measured on one GPU model stay as they were)."""
    out = asdict(point)
    if out.get("measured_on") == "":
        del out["measured_on"]
    return out


_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str}


@functools.cache
def _schema(kind: type) -> tuple[frozenset[str], frozenset[str], tuple[tuple[str, str, Any], ...]]:
    """(field names, those with defaults (newer fields a file may lack), (name, type name, accepted
    builtin types) per field) of a point dataclass."""
    names = frozenset(f.name for f in fields(kind))
    optional = frozenset(f.name for f in fields(kind) if f.default is not MISSING)
    return names, optional, tuple((f.name, str(f.type), _TYPES[str(f.type)]) for f in fields(kind))


def read_point(kind: type, row: Any, where: str) -> Any:
    """``row`` (a mapping read from a file) as a ``kind`` point, checked key by key."""
    if not isinstance(row, dict):
        raise CalibrationError(f"{where}: expected a mapping")
    names, optional, types = _schema(kind)
    missing, unknown = names - set(row) - optional, set(row) - names
    if missing or unknown:
        raise CalibrationError(f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    for name, type_name, want in types:
        if name not in row:
            continue
        value = row[name]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise CalibrationError(f"{where}.{name}: expected {type_name}, got {value!r}")
    return kind(**row)
