"""The calibration of one machine: what the model and the offline search read.

A ``Calibration`` holds, for one hardware fingerprint and world size:

- ``bandwidth``: nccl-tests style points (collective, NCCL CTA cap, size, time, algbw, busbw);
- ``interference``: the collective and the signalled GEMM (grid ``SMs - sms_free``) run together:
  each one's time alone and under contention, their slowdowns, and whether the collective ran during
  the GEMM at all;
- ``gemm``: time per tile config per grid for a set of shapes, next to cuBLAS;
- ``fits``: t = latency + bytes / bandwidth per (collective, cap), least squares over the points;
- ``copy_engine`` (optional): what the copy engine's cost-model term reads
  (``fo_tune.engines.copy_engine.model``, ``fo_tune.model.library``): ``params``, every scalar by name with
  its value and its source (a measurement of ``fo-tune calibrate``, a probe, or a fit to measured
  rows), and the measured points behind them: ``library_gemm`` (cuBLAS per chunk shape, beta 0 and
  1, with pauses and back to back: one GPU) and ``copies`` (copy-engine copies of peer and local
  memory: two GPUs) and ``host`` (a call's host time per rank at N = 2..8 peers, eager and replayed:
  virtual ranks on one GPU);
- ``moe_host`` (optional): the expert-parallel FFN's host times on one rank (``MoeHost``: a
  piece's two phases and a whole call, ``fo-tune calibrate --only moe_host``), which the MoE
  model reads instead of its constants of one H100 host (``fo_tune.moe.model``);
- ``triton`` (optional): the Triton term's host times (``params``, as above); without it the
  term's measured defaults apply;
- ``gemm_dtypes`` (optional): GEMM profiles in other operand dtypes than ``dtype`` (fp8: the
  signalled GEMM beside ``torch._scaled_mm``), measured on one GPU of the same model (or of a
  sibling of the same die, its points' ``measured_on`` naming it) and merged with ``fo-tune
  calibrate --world-size 1 --only gemm --dtype D --into`` (``--from-profiles DIR``: from ``fo-tune
  profile`` CSVs, without a GPU). ``for_dtype(D)`` is the calibration a search in D reads: the same
  communication measurements, D's profile as ``gemm``, and ``library_ratio``, D's library GEMM time
  over this dtype's (cuBLAS), for the library model.

Sizes follow nccl-tests: ``size`` is the full buffer of the collective (the input of all_reduce,
reduce_scatter and all_to_all, the output of all_gather); algbw = size / time; busbw = algbw times
2(n-1)/n for all_reduce and (n-1)/n for the others. all_to_all is measured with uneven splits
(``fo_tune.ranks.collectives.uneven_splits``: each rank sends its peers 1 : 2 : ... : w shares),
as an MoE layer's dispatch and combine are.

Files: one YAML (schema version, fingerprint, everything) written atomically; ``load_calibration``
refuses an unknown schema version or a malformed file with a ``CalibrationError`` naming the key.
Schema 1 (no ``copy_engine`` / ``triton`` sections) still loads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from fo_kernels.files import atomic_write, read_yaml
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import COLLECTIVES
from fo_kernels.tile import Tile
from fo_tune.calibrate.missing import missing_profile
from fo_tune.calibrate.section import (
    CalibrationError,
    CalibrationNotFoundError,
    CopyPoint,
    EngineCalibration,
    HostPoint,
    LibraryGemmPoint,
    MoeHost,
    Quantity,
    point_dict,
    read_moe_host,
    read_point,
)

__all__ = [
    "CALIBRATED_COLLECTIVES",
    "BandwidthPoint",
    "Calibration",
    "CalibrationError",
    "CalibrationNotFoundError",
    "CopyPoint",
    "CurveFit",
    "EngineCalibration",
    "GemmPoint",
    "GridBest",
    "HostPoint",
    "InterferencePoint",
    "LibraryGemmPoint",
    "MoeHost",
    "Quantity",
    "bus_factor",
    "fit_all",
    "fit_curve",
    "load_calibration",
    "save_calibration",
    "timing_name",
]

CALIBRATION_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
CALIBRATION_KIND = "fo-tune-calibration"
# What to do with a file that does not read as a calibration.
GIVE_CALIBRATION = "give a calibration.yaml `fo-tune calibrate` wrote"
# What a calibration measures: the runtime's collectives and all_to_all, which an expert-parallel
# layer ends in.
CALIBRATED_COLLECTIVES = (*COLLECTIVES, "all_to_all")


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw for ``collective`` on ``world_size`` ranks."""
    if world_size <= 1:
        return 1.0
    frac = (world_size - 1) / world_size
    return 2 * frac if collective == "all_reduce" else frac


@dataclass(frozen=True, kw_only=True, slots=True)
class BandwidthPoint:
    collective: str
    nccl_max_ctas: int
    size_bytes: int
    time_ms: float
    spread_ms: float
    algbw_gbs: float
    busbw_gbs: float

    @classmethod
    def measured(
        cls, collective: str, cap: int, size: int, time_ms: float, spread_ms: float, world_size: int
    ) -> BandwidthPoint:
        algbw = size / (time_ms * 1e-3) / 1e9 if time_ms > 0 else 0.0
        return cls(
            collective=collective,
            nccl_max_ctas=cap,
            size_bytes=size,
            time_ms=time_ms,
            spread_ms=spread_ms,
            algbw_gbs=algbw,
            busbw_gbs=algbw * bus_factor(collective, world_size),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class InterferencePoint:
    collective: str
    sms_free: int
    nccl_max_ctas: int
    size_bytes: int
    gemm_m: int
    gemm_n: int
    gemm_k: int
    gemm_alone_ms: float
    gemm_contended_ms: float
    comm_alone_ms: float
    comm_contended_ms: float
    gemm_slowdown: float
    comm_slowdown: float
    comm_during_gemm: bool  # the first collective finished before the GEMM did
    concurrent: bool  # False on the CPU, where the two run one after the other


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmPoint:
    m: int
    n: int
    k: int
    tile: str  # "BMxBNxBK gmG wW sS[ ws][ pp]"
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    warp_specialize: bool
    sms_free: int
    grid: int
    time_ms: float
    spread_ms: float
    cublas_ms: float
    rel_err: float
    status: str  # "ok", or why the config was skipped
    # The ping-pong kernel (``Tile.pingpong``); absent from calibrations written before it existed.
    pingpong: bool = False
    # Another GPU's device key (a sibling of the same die, ``--into-sibling``); "": this GPU. Written
    # to a calibration only where set; profile CSVs say it in their ``device_key`` column instead.
    measured_on: str = ""

    def tile_config(self) -> Tile:
        """The tile config this point measured (its fields of ``Tile``, by name)."""
        return Tile(**{f.name: getattr(self, f.name) for f in fields(Tile)})


@dataclass(frozen=True, kw_only=True, slots=True)
class GridBest:
    """The fastest config of one grid among its ``candidates`` fastest profiled ones, all re-timed
    beside the other grids' and cuBLAS in one run (``fo_tune.calibrate.profile.confirm_grids``): ``time_ms``
    and ``cublas_ms`` are that run's medians (max over ranks), ``over_share`` its time over the full
    grid's best in that run, divided by the SM share ``grid_0 / grid`` (1.0 at full grid; above 1,
    the grid costs more than the SMs it gives up)."""

    m: int
    n: int
    k: int
    sms_free: int
    grid: int
    tile: str
    time_ms: float
    cublas_ms: float
    over_share: float
    rel_err: float
    timing: str  # how the samples ran: timing_name(graphs)
    candidates: int = 1  # how many of the grid's profiled configs the run timed


def timing_name(graphs: bool) -> str:
    """How a profile's samples ran, as its CSVs say: "graphs" (each sample one CUDA graph replay of
    its calls: the GPU's time) or "eager" (the host issues every call)."""
    return "graphs" if graphs else "eager"


@dataclass(frozen=True, kw_only=True, slots=True)
class CurveFit:
    collective: str
    nccl_max_ctas: int
    latency_ms: float
    bandwidth_gbs: float  # asymptotic algbw
    max_rel_residual: float


def fit_curve(points: Iterable[BandwidthPoint]) -> CurveFit:
    """Least-squares fit of time = latency + size / bandwidth (both kept non-negative)."""
    pts = list(points)
    if not pts:
        raise CalibrationError("fit: no bandwidth points")
    xs = [p.size_bytes for p in pts]
    ys = [p.time_ms for p in pts]
    n = len(pts)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # noise-dominated (CPU, or sizes all on the latency floor): best observed bandwidth
        slope = 1e-6 / max(max(p.algbw_gbs for p in pts), 1e-9)
    latency = max(0.0, my - slope * mx)
    resid = max(abs(latency + slope * x - y) / y for x, y in zip(xs, ys, strict=True) if y > 0)
    return CurveFit(
        collective=pts[0].collective,
        nccl_max_ctas=pts[0].nccl_max_ctas,
        latency_ms=latency,
        bandwidth_gbs=1e-6 / slope,  # bytes/ms -> GB/s
        max_rel_residual=resid,
    )


def fit_all(points: Iterable[BandwidthPoint]) -> list[CurveFit]:
    """One ``fit_curve`` per (collective, NCCL CTA cap) of ``points``, in that order."""
    by_key: dict[tuple[str, int], list[BandwidthPoint]] = {}
    for p in points:
        by_key.setdefault((p.collective, p.nccl_max_ctas), []).append(p)
    return [fit_curve(v) for _, v in sorted(by_key.items())]


# The optional engine sections of a calibration, by name.
ENGINE_SECTIONS = ("copy_engine", "triton")


_PARTS = {"bandwidth": BandwidthPoint, "interference": InterferencePoint, "gemm": GemmPoint, "fits": CurveFit}
# Every key a calibration.yaml may hold at its top level (``Calibration.to_dict``): another one is
# a misspelling, refused rather than read as absent.
_TOP_LEVEL_KEYS = (
    "schema_version", "kind", "fingerprint", "world_size", "dtype", "space", "quick", "created",
    *_PARTS, *ENGINE_SECTIONS, "moe_host", "gemm_dtypes", "basis",
)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class Calibration:
    """Everything measured on one machine for one world size (see the module docstring)."""

    fingerprint: Fingerprint
    world_size: int
    dtype: str
    space: str
    quick: bool
    created: str
    schema_version: int = CALIBRATION_SCHEMA_VERSION
    bandwidth: list[BandwidthPoint] = field(default_factory=list)
    interference: list[InterferencePoint] = field(default_factory=list)
    gemm: list[GemmPoint] = field(default_factory=list)
    fits: list[CurveFit] = field(default_factory=list)
    copy_engine: EngineCalibration | None = None
    triton: EngineCalibration | None = None
    moe_host: MoeHost | None = None
    gemm_dtypes: dict[str, list[GemmPoint]] = field(default_factory=dict)
    # The library GEMM's time in this calibration's dtype over its time in the dtype its copy-engine
    # section was measured in (``for_dtype``; not stored: derived from the two profiles).
    library_ratio: float = 1.0
    # The dtype its communication and copy-engine sections were measured in ("": ``dtype``).
    base_dtype: str = ""
    # What it rests on where not on its own machine's measurements ("": measured there; an
    # extrapolation to another world size says which calibration and facts: ``extrapolate.py``).
    basis: str = ""
    # The file it was read from ("": made in memory), for the commands a refusal names; not stored,
    # not compared (the same measurements read from two files are equal).
    file: str = field(default="", compare=False)
    # An extrapolation's measured calibration (``extrapolate.py``), whose file its refusals name:
    # what it lacks is measured at that world size and merged there; not stored, not compared.
    origin: Calibration | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "kind": CALIBRATION_KIND,
            "fingerprint": self.fingerprint.to_dict(),
            "world_size": self.world_size,
            "dtype": self.dtype,
            "space": self.space,
            "quick": self.quick,
            "created": self.created,
        }
        for name in _PARTS:
            out[name] = [point_dict(p) for p in getattr(self, name)]
        for name in ENGINE_SECTIONS:
            section = getattr(self, name)
            if section is not None:
                out[name] = section.to_dict()
        if self.moe_host is not None:
            out["moe_host"] = point_dict(self.moe_host)
        if self.gemm_dtypes:
            out["gemm_dtypes"] = {d: [point_dict(p) for p in pts] for d, pts in self.gemm_dtypes.items()}
        if self.basis:
            out["basis"] = self.basis
        return out

    def for_dtype(self, dtype: str) -> Calibration:
        """The calibration a model of ``dtype`` operands reads (see the module docstring): this one
        for its own dtype; ``CalibrationError`` naming the command that adds a missing profile. Where
        the profile was measured on a sibling GPU (its points' ``measured_on``), ``basis`` says so:
        every row a search predicts from it then names that GPU."""
        if dtype == self.dtype:
            return self
        points = self.gemm_dtypes.get(dtype)
        if not points:
            raise CalibrationError(missing_profile(self, dtype))
        siblings = sorted({p.measured_on for p in points if p.measured_on})
        clause = f"{dtype} GEMM profile measured on {', '.join(siblings)}, a sibling GPU" if siblings else ""
        return dataclasses.replace(
            self,
            dtype=dtype,
            gemm=list(points),
            gemm_dtypes={},
            library_ratio=_library_ratio(self.gemm, points),
            base_dtype=self.dtype,
            basis="; ".join(b for b in (self.basis, clause) if b),
        )

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<calibration>") -> Calibration:
        if not isinstance(data, dict):
            raise CalibrationError(f"{source}: expected a mapping at the top level; {GIVE_CALIBRATION}")
        kind = data.get("kind")
        if kind != CALIBRATION_KIND:  # (before its schema: another file's version says nothing here)
            what = f"kind {kind!r}" if kind is not None else "no kind"
            raise CalibrationError(
                f"{source}: not a calibration ({what}; a calibration's is {CALIBRATION_KIND!r}); "
                f"{GIVE_CALIBRATION}"
            )
        version = data.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS or isinstance(version, bool):
            raise CalibrationError(
                f"{source}: schema_version {version!r} is not supported (this fo-tune reads "
                f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}); re-run `fo-tune calibrate`"
            )
        unknown = sorted(str(key) for key in data if key not in _TOP_LEVEL_KEYS)
        if unknown:
            raise CalibrationError(
                f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; a calibration.yaml holds "
                f"{', '.join(_TOP_LEVEL_KEYS)}"
            )
        try:
            fp = Fingerprint.from_dict(data["fingerprint"])
            parts = {
                name: [
                    read_point(kind, row, f"{source}: {name}[{i}]")
                    for i, row in enumerate(data.get(name) or [])
                ]
                for name, kind in _PARTS.items()
            }
            sections = {
                name: EngineCalibration.from_dict(data[name], f"{source}: {name}")
                for name in ENGINE_SECTIONS
                if data.get(name) is not None
            }
            moe_host = data.get("moe_host")
            if moe_host is not None:
                moe_host = read_moe_host(moe_host, f"{source}: moe_host")
            others = data.get("gemm_dtypes") or {}
            if not isinstance(others, dict):
                raise CalibrationError(f"{source}: gemm_dtypes: expected a mapping of dtype to points")
            gemm_dtypes = {
                str(d): [
                    read_point(GemmPoint, row, f"{source}: gemm_dtypes.{d}[{i}]")
                    for i, row in enumerate(pts or [])
                ]
                for d, pts in others.items()
            }
            return cls(
                fingerprint=fp,
                world_size=int(data["world_size"]),
                dtype=str(data["dtype"]),
                space=str(data["space"]),
                quick=bool(data["quick"]),
                created=str(data["created"]),
                **parts,
                **sections,
                moe_host=moe_host,
                gemm_dtypes=gemm_dtypes,
                basis=str(data.get("basis") or ""),
            )
        except KeyError as exc:
            raise CalibrationError(f"{source}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, CalibrationError):
                raise
            raise CalibrationError(f"{source}: {exc}") from None

    def fit_for(self, collective: str, cap: int) -> CurveFit | None:
        return next((f for f in self.fits if (f.collective, f.nccl_max_ctas) == (collective, cap)), None)


def _library_ratio(base: list[GemmPoint], other: list[GemmPoint]) -> float:
    """The library GEMM's time in ``other``'s dtype over ``base``'s: the geometric mean of the two
    profiles' ``cublas_ms`` over the shapes both measured, else of their mean times a wave x K
    (``K_WORK``); 1.0 where either profile has no library time."""

    def library(points: list[GemmPoint]) -> dict[tuple[int, int, int], float]:
        return {(p.m, p.n, p.k): p.cublas_ms for p in points if p.cublas_ms > 0}

    mine, theirs = library(base), library(other)
    shared = sorted(set(mine) & set(theirs))
    if shared:
        return math.exp(sum(math.log(theirs[s] / mine[s]) for s in shared) / len(shared))

    def per_work(times: dict[tuple[int, int, int], float]) -> float:
        return sum(t / (m * n * k / K_WORK) for (m, n, k), t in times.items()) / len(times)

    return per_work(theirs) / per_work(mine) if mine and theirs else 1.0


# The unit of work ``_library_ratio`` compares profiles of different shapes in (multiply-adds).
K_WORK = 2**30


# The calibration's own file in a calibration folder (``fo-tune calibrate`` writes it there).
CALIBRATION_FILE = "calibration.yaml"


def save_calibration(cal: Calibration, path: Path) -> None:
    """Write ``cal`` as YAML atomically (temporary file in the same folder, then rename)."""
    atomic_write(path, lambda f: yaml.safe_dump(cal.to_dict(), f, sort_keys=False, width=120))


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration YAML; a folder stands for the ``calibration.yaml`` in it
    (the file ``fo-tune calibrate`` writes into its output folder)."""
    if Path(path).is_dir() and (Path(path) / CALIBRATION_FILE).is_file():
        path = Path(path) / CALIBRATION_FILE
    data = read_yaml(
        path,
        error=CalibrationError,
        missing=CalibrationNotFoundError,
        missing_hint="no such calibration file; run `fo-tune calibrate` or pass --calibration",
        bad_hint=GIVE_CALIBRATION,
    )
    return dataclasses.replace(Calibration.from_dict(data, source=str(path)), file=str(path))
