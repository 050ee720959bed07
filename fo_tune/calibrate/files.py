"""Writing a calibration to disk: CSVs, the calibration YAML and PNG plots, all or nothing.

    write_calibration_dir(cal, out_dir)      # results/calibration/<device-key>/tp<N>/ by default
      tmp = out_dir.parent/.<name>.tmp-XXXX   # everything is built here first
      bandwidth.csv interference.csv gemm_profile.csv fits.csv calibration.yaml
      bandwidth.png interference.png
      swap: out_dir -> .<name>.old-XXXX, tmp -> out_dir, delete the old one
      any error: tmp removed, an existing out_dir untouched

A run of some parts writes the YAML and those parts' files (``PART_FILES``); an earlier
calibration's files of the other parts are carried over unchanged, and where it holds more than the
run measures the CLI merges the run into its YAML first (``earlier_calibration``), so no measured
part is replaced by an unmeasured one.

The CSVs are plain (one header line, one row per point); each ends with a ``device_key`` column so a
CSV alone says where it was measured (the YAML carries the whole fingerprint). ``bandwidth.csv``
uses nccl-tests' columns. ``check_calibration_out`` is the check a command runs before it measures
anything, so a bad ``--out`` costs nothing; it also refuses to replace a folder holding files
fo-tune did not write. ``write_profile_csv`` writes one shape's tile profile (``fo-tune profile``)
the same way, and ``read_profile_csv`` reads one back. The ``*_summary`` helpers give the rows of
the tables the CLI prints.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from fo_kernels.files import SAFE_LOADER, atomic_write
from fo_tune.calibrate.calibration import (
    CALIBRATION_FILE,
    BandwidthPoint,
    Calibration,
    CalibrationError,
    CurveFit,
    GemmPoint,
    GridBest,
    InterferencePoint,
    save_calibration,
)
from fo_tune.calibrate.plots import plot_bandwidth, plot_interference
from fo_tune.output import (
    OutputError,
    check_writable,
    check_writable_file,
    made_parents,
    refuse_foreign,
    replacing_folder,
    write_csv,
    write_rows,
)
from fo_tune.ranks.scaled import TUNE_SCALING

DEFAULT_ROOT = Path("results/calibration")
PROFILE_ROOT = Path("results/profiles")
# nccl-tests' columns (size, time, algbw, busbw), then where it was measured.
BANDWIDTH_COLUMNS = (
    "collective",
    "nccl_max_ctas",
    "size_bytes",
    "time_ms",
    "spread_ms",
    "algbw_GBs",
    "busbw_GBs",
    "device_key",
)
_BANDWIDTH_FIELDS = (
    "collective",
    "nccl_max_ctas",
    "size_bytes",
    "time_ms",
    "spread_ms",
    "algbw_gbs",
    "busbw_gbs",
)
INTERFERENCE_COLUMNS = (*(f.name for f in fields(InterferencePoint)), "device_key")
# (a point's ``measured_on`` is left out: a CSV's device_key column says where its rows were measured)
GEMM_COLUMNS = (*(f.name for f in fields(GemmPoint) if f.name != "measured_on"), "device_key")
FITS_COLUMNS = (*(f.name for f in fields(CurveFit)), "device_key")
# Every file write_calibration_dir writes, in the order it returns them.
CALIBRATION_FILES = (
    "bandwidth.csv",
    "interference.csv",
    "gemm_profile.csv",
    "fits.csv",
    CALIBRATION_FILE,
    "bandwidth.png",
    "interference.png",
)

# The files of each part a run may measure (the copy engine's sections and the MoE host times live
# in the YAML only).
PART_FILES = {
    "bandwidth": ("bandwidth.csv", "fits.csv", "bandwidth.png"),
    "interference": ("interference.csv", "interference.png"),
    "gemm": ("gemm_profile.csv",),
}


# ----------------------------------------------------------------------------------- where to write
def default_out_dir(cal: Calibration) -> Path:
    """``results/calibration/<device-key>/tp<N>`` (relative to the working directory)."""
    return DEFAULT_ROOT / cal.fingerprint.device_key / f"tp{cal.world_size}"


def default_profile_path(
    device_key: str, shape: tuple[int, int, int], dtype: str, *, scaling: str = TUNE_SCALING
) -> Path:
    """``results/profiles/<device-key>/<M>x<N>x<K>-<dtype>.csv`` (relative to the working directory);
    ``...-<dtype>-<scaling>.csv`` for a ``scaling`` other than the tuner's (``TUNE_SCALING``, the
    one calibrate and the tables are tuned for), so the two fp8 scalings' profiles sit side by side."""
    m, n, k = shape
    tag = "" if scaling == TUNE_SCALING else f"-{scaling}"
    return PROFILE_ROOT / device_key / f"{m}x{n}x{k}-{dtype}{tag}.csv"


def _time_key(p: GemmPoint) -> tuple[bool, float]:
    """Measured configs by time, skipped ones (and NaN times) last."""
    ok = p.status == "ok" and not math.isnan(p.time_ms)
    return (not ok, p.time_ms if ok else math.inf)


def _rows(points: Iterable[Any], names: Sequence[str], device_key: str) -> list[list[Any]]:
    return [[*(getattr(p, n) for n in names), device_key] for p in points]


def _write_tables(cal: Calibration, folder: Path, names: Sequence[str]) -> None:
    """The CSVs of ``names`` (``CALIBRATION_FILES``' names) from ``cal``."""
    key = cal.fingerprint.device_key
    gemm = sorted(cal.gemm, key=lambda p: ((p.m, p.n, p.k), *_time_key(p)))
    tables = {
        "bandwidth.csv": (BANDWIDTH_COLUMNS, lambda: _rows(cal.bandwidth, _BANDWIDTH_FIELDS, key)),
        "interference.csv": (
            INTERFERENCE_COLUMNS,
            lambda: _rows(cal.interference, INTERFERENCE_COLUMNS[:-1], key),
        ),
        "gemm_profile.csv": (GEMM_COLUMNS, lambda: _rows(gemm, GEMM_COLUMNS[:-1], key)),
        "fits.csv": (FITS_COLUMNS, lambda: _rows(cal.fits, FITS_COLUMNS[:-1], key)),
    }
    for name, (columns, rows) in tables.items():
        if name in names:
            write_csv(folder / name, columns, rows())


def write_profile_csv(points: list[GemmPoint], path: str | Path, device_key: str, timing: str) -> Path:
    """One shape's tile profile, sorted by time (skipped configs last), written atomically: the
    columns of ``gemm_profile.csv`` and ``timing`` (how the samples ran:
    ``fo_tune.calibrate.calibration.timing_name``)."""
    path = Path(path)
    check_writable_file(path)
    target = Path(os.path.abspath(path))
    rows = [[*row, timing] for row in _rows(sorted(points, key=_time_key), GEMM_COLUMNS[:-1], device_key)]
    with made_parents(target.parent):
        atomic_write(target, lambda f: write_rows(f, [*GEMM_COLUMNS, "timing"], rows))
    return path


def read_profile_csv(path: str | Path) -> tuple[list[GemmPoint], list[str]]:
    """The rows of a tile profile CSV (``write_profile_csv``; or a ``gemm_profile.csv``) as points,
    and the device keys its rows name, in order of first appearance; ``CalibrationError`` naming
    the file and line where a column is missing or a value is not of its field's type."""
    path = Path(path)
    kinds = {f.name: str(f.type) for f in fields(GemmPoint) if f.name in GEMM_COLUMNS}
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in GEMM_COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise CalibrationError(
                    f"{path}: not a tile profile of `fo-tune profile` (no column {missing[0]!r})"
                )
            points, keys = [], []
            for line, row in enumerate(reader, start=2):
                try:
                    points.append(GemmPoint(**{n: _cell(row[n], kind) for n, kind in kinds.items()}))
                except (TypeError, ValueError) as exc:
                    raise CalibrationError(f"{path}:{line}: {exc}") from None
                if row["device_key"] not in keys:
                    keys.append(row["device_key"])
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CalibrationError(f"{path}: cannot read it as a tile profile: {exc}") from None
    return points, keys


def _cell(text: str | None, kind: str) -> Any:
    """One CSV cell as a ``GemmPoint`` field of type ``kind`` (``int``, ``float``, ``bool``, ``str``)."""
    if text is None:
        raise ValueError("a row shorter than the header")
    if kind == "bool":
        if text not in ("True", "False"):
            raise ValueError(f"expected True or False, got {text!r}")
        return text == "True"
    return {"int": int, "float": float, "str": str}[kind](text)


def grids_path(profile_path: str | Path) -> Path:
    """Where ``fo-tune profile`` writes the grids' side-by-side timing next to a profile CSV:
    ``<M>x<N>x<K>-<dtype>.csv`` -> ``<M>x<N>x<K>-<dtype>-grids.csv``."""
    path = Path(profile_path)
    return path.with_name(f"{path.stem}-grids{path.suffix or '.csv'}")


def check_profile_out(path: str | Path) -> None:
    """Refuse (``OutputError``), before anything is measured, a ``fo-tune profile --out`` that is not
    a ``.csv`` name, or whose file or grids file beside it (``grids_path``) exists and is not one
    ``fo-tune profile`` wrote: replacing it would destroy another file (a calibration, a bench CSV)."""
    path = Path(path)
    check_writable_file(path)
    check_writable_file(grids_path(path))
    if path.suffix != ".csv":
        raise OutputError(f"--out {path}: a profile is a CSV; give a file name ending in .csv")
    headers = {
        path: ",".join([*GEMM_COLUMNS, "timing"]),
        grids_path(path): ",".join([*(f.name for f in fields(GridBest)), "device_key"]),
    }
    for file, header in headers.items():
        named = f"--out {path}" if file == path else f"--out {path}: the grids file beside it, {file},"
        ours = "a profile `fo-tune profile` wrote"
        refuse_foreign(file, lambda f, h=header: _starts_with(f, h), ours=ours, named=named)


def _starts_with(path: Path, header: str) -> bool:
    """Whether the first line of ``path`` is ``header`` (an unreadable file is not)."""
    try:
        with path.open(encoding="utf-8", newline="") as f:
            return f.readline().rstrip("\r\n") == header
    except (OSError, UnicodeDecodeError):
        return False


def write_grids_csv(rows: Sequence[GridBest], path: str | Path, device_key: str) -> Path:
    """The best config of each grid re-timed side by side (``GridBest`` rows, by sms_free), written
    atomically."""
    names = [f.name for f in fields(GridBest)]
    path = Path(path)
    check_writable_file(path)
    target = Path(os.path.abspath(path))
    with made_parents(target.parent):
        atomic_write(target, lambda f: write_rows(f, [*names, "device_key"], _rows(rows, names, device_key)))
    return path


# ------------------------------------------------------------------------------- the whole folder
def part_files(parts: Sequence[str] | None) -> tuple[str, ...]:
    """The files of ``CALIBRATION_FILES`` a run measuring ``parts`` (None: every part) writes:
    calibration.yaml and the files of those parts (``PART_FILES``), in ``CALIBRATION_FILES``' order."""
    chosen = {CALIBRATION_FILE}
    for part, names in PART_FILES.items():
        if parts is None or part in parts:
            chosen.update(names)
    return tuple(name for name in CALIBRATION_FILES if name in chosen)


def write_calibration_dir(
    cal: Calibration, out_dir: str | Path, parts: Sequence[str] | None = None
) -> list[Path]:
    """Write calibration.yaml and the files of the ``parts`` measured (``part_files``; None: every
    file of ``CALIBRATION_FILES``) into ``out_dir``, replacing it as a whole. The files of the other
    parts are not written: those an earlier calibration there has are kept as they were (merge
    ``cal`` into it first, ``earlier_calibration``, so its YAML keeps their numbers too).

    Built in a temporary sibling folder, then swapped in; on any error the temporary folder is
    removed and an existing ``out_dir`` is left as it was. Returns the paths written.
    """
    check_calibration_out(out_dir, cal.fingerprint.device_key)
    names = part_files(parts)
    earlier = Path(os.path.abspath(out_dir))
    with replacing_folder(out_dir) as tmp:
        _write_tables(cal, tmp, names)
        save_calibration(cal, tmp / CALIBRATION_FILE)
        if "bandwidth.png" in names:
            plot_bandwidth(cal, tmp / "bandwidth.png")
        if "interference.png" in names:
            plot_interference(cal, tmp / "interference.png")
        for name in CALIBRATION_FILES:
            if name not in names and (earlier / name).is_file():
                shutil.copy2(earlier / name, tmp / name)
    return [Path(out_dir) / name for name in names]


def earlier_calibration(
    out_dir: str | Path, device_key: str, dtype: str, parts: Sequence[str]
) -> Calibration | None:
    """The calibration in ``out_dir`` a run of this machine measuring ``parts`` in ``dtype`` merges
    into (``fo_tune.calibrate.run.merge_into``), so what it holds beyond ``parts`` (``held``)
    keeps its numbers. None where there is none of ``device_key`` (or none readable), or where
    it holds nothing beyond ``parts``: the run replaces it whole, as a fresh calibration. One in
    another dtype that holds more is refused (``OutputError``): its YAML holds one dtype."""
    from fo_tune.calibrate.calibration import load_calibration

    path = Path(out_dir) / CALIBRATION_FILE
    if _device_key_in(path) != device_key:
        return None
    try:
        earlier = load_calibration(path)
    except CalibrationError:
        return None
    kept = [name for name in held(earlier) if name not in parts]
    if not kept:
        return None
    if earlier.dtype != dtype:
        raise OutputError(
            f"--out {out_dir} holds a calibration in {earlier.dtype} whose {', '.join(kept)} this "
            f"{dtype} run does not measure and would drop; pass --dtype {earlier.dtype}, or give "
            "another --out"
        )
    return earlier


def held(cal: Calibration) -> list[str]:
    """What ``cal`` holds, by the --only part that measures it; ``gemm_dtypes`` (other dtypes' GEMM
    profiles) and ``triton`` (`fo-tune model fit`'s host times), which no run in its dtype
    measures, by their keys in calibration.yaml."""
    engine = cal.copy_engine
    has = {
        "bandwidth": bool(cal.bandwidth),
        "interference": bool(cal.interference),
        "gemm": bool(cal.gemm),
        "copy_engine": engine is not None,
        "copy_engine_n": engine is not None and bool(engine.host),  # (the host times at N peers)
        "moe_host": cal.moe_host is not None,
        "gemm_dtypes": bool(cal.gemm_dtypes),
        "triton": cal.triton is not None,
    }
    return [name for name, there in has.items() if there]


# ----------------------------------------------------------------------------- summary tables
class BandwidthSummary(NamedTuple):
    collective: str
    nccl_max_ctas: int
    size_bytes: int  # the largest size measured
    busbw_gbs: float  # at that size
    latency_ms: float  # fitted (NaN without a fit)
    bandwidth_gbs: float  # fitted asymptotic algbw


class InterferenceSummary(NamedTuple):
    collective: str
    size_bytes: int
    sms_free: int
    nccl_max_ctas: int
    comm_slowdown: float
    gemm_slowdown: float
    comm_during_gemm: bool
    concurrent: bool


class GemmSummary(NamedTuple):
    shape: tuple[int, int, int]
    best: GemmPoint | None  # the fastest measured config, None when every config was skipped
    measured: int  # configs (tile x grid) that ran
    total: int
    cublas_ms: float


def bandwidth_summary(cal: Calibration) -> list[BandwidthSummary]:
    """Per (collective, cap): busbw at the largest size and the fitted latency and bandwidth."""
    largest: dict[tuple[str, int], BandwidthPoint] = {}
    for p in cal.bandwidth:
        key = (p.collective, p.nccl_max_ctas)
        if key not in largest or p.size_bytes > largest[key].size_bytes:
            largest[key] = p
    out = []
    for (collective, cap), p in largest.items():
        fit = cal.fit_for(collective, cap)
        latency, bandwidth = (fit.latency_ms, fit.bandwidth_gbs) if fit else (math.nan, math.nan)
        out.append(BandwidthSummary(collective, cap, p.size_bytes, p.busbw_gbs, latency, bandwidth))
    return out


def interference_summary(cal: Calibration) -> list[InterferenceSummary]:
    """The interference table, by collective, size, r and cap."""
    rows = [
        InterferenceSummary(
            p.collective,
            p.size_bytes,
            p.sms_free,
            p.nccl_max_ctas,
            p.comm_slowdown,
            p.gemm_slowdown,
            p.comm_during_gemm,
            p.concurrent,
        )
        for p in cal.interference
    ]
    return sorted(rows, key=lambda r: (r.collective, r.size_bytes, r.sms_free, r.nccl_max_ctas))


def gemm_summary(points: Iterable[GemmPoint]) -> list[GemmSummary]:
    """Per shape: the fastest measured tile config and grid, next to cuBLAS."""
    by_shape: dict[tuple[int, int, int], list[GemmPoint]] = {}
    for p in points:
        by_shape.setdefault((p.m, p.n, p.k), []).append(p)
    out = []
    for shape, pts in by_shape.items():
        ranked = sorted(pts, key=_time_key)
        measured = [p for p in ranked if not _time_key(p)[0]]
        out.append(
            GemmSummary(shape, measured[0] if measured else None, len(measured), len(pts), pts[0].cublas_ms)
        )
    return out


def _device_key_in(path: Path) -> str | None:
    """The device key of the calibration YAML at ``path``; None when it is missing or unreadable
    (such a folder's files are replaced as any earlier calibration's)."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=SAFE_LOADER)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    fingerprint = data.get("fingerprint") if isinstance(data, dict) else None
    key = fingerprint.get("device_key") if isinstance(fingerprint, dict) else None
    return key if isinstance(key, str) else None


def check_calibration_out(out_dir: str | Path, device_key: str | None = None) -> None:
    """Raise ``OutputError`` unless ``write_calibration_dir`` can create or replace ``out_dir``
    (``fo_tune.output.check_writable``: only a previous calibration's files may be replaced) and,
    given the ``device_key`` of the calibration to write, unless a calibration there is of the
    same machine: one of another GPU model, world size or interconnect is never replaced by a
    mistyped --out (it took that machine to measure)."""
    check_writable(out_dir, allowed=CALIBRATION_FILES, what="calibration")
    there = _device_key_in(Path(out_dir) / "calibration.yaml")
    if device_key is not None and there is not None and there != device_key:
        raise OutputError(
            f"--out {out_dir} holds the calibration of {there}, and this one is of {device_key}; "
            "give another folder (the default one is per device key), or remove that one first"
        )
