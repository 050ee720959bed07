"""Writing a calibration to disk: CSVs, the calibration YAML and PNG plots, all or nothing.

    write_calibration_dir(cal, out_dir)      # results/calibration/<device-key>/tp<N>/ by default
      tmp = out_dir.parent/.<name>.tmp-XXXX   # everything is built here first
      bandwidth.csv interference.csv gemm_profile.csv fits.csv calibration.yaml
      bandwidth.png interference.png
      swap: out_dir -> .<name>.old-XXXX, tmp -> out_dir, delete the old one
      any error: tmp removed, an existing out_dir untouched

The CSVs are plain (one header line, one row per point); each ends with a ``device_key`` column so a
CSV alone says where it was measured (the YAML carries the whole fingerprint). ``bandwidth.csv``
uses nccl-tests' columns. ``check_writable`` is the check a command runs before it measures anything,
so a bad ``--out`` costs nothing; it also refuses to replace a folder holding files fo-tune did not
write. ``write_profile_csv`` writes one shape's tile profile (``fo-tune profile``) the same way.
The ``*_summary`` helpers give the rows of the tables the CLI prints. matplotlib (Agg, no pyplot) is
imported only when a plot is drawn.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NamedTuple

from fo_kernels.errors import FoTuneError
from fo_kernels.files import atomic_write
from fo_tune.calibration import (
    BandwidthPoint,
    Calibration,
    CurveFit,
    GemmPoint,
    GridBest,
    InterferencePoint,
    save_calibration,
)

__all__ = [
    "BANDWIDTH_COLUMNS",
    "CALIBRATION_FILES",
    "DEFAULT_ROOT",
    "FITS_COLUMNS",
    "GEMM_COLUMNS",
    "INTERFERENCE_COLUMNS",
    "PROFILE_ROOT",
    "BandwidthSummary",
    "GemmSummary",
    "InterferenceSummary",
    "OutputError",
    "bandwidth_summary",
    "check_writable",
    "check_writable_file",
    "default_out_dir",
    "default_profile_path",
    "gemm_summary",
    "interference_summary",
    "size_label",
    "write_calibration_dir",
    "write_profile_csv",
]

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
GEMM_COLUMNS = (*(f.name for f in fields(GemmPoint)), "device_key")
FITS_COLUMNS = (*(f.name for f in fields(CurveFit)), "device_key")
# Every file write_calibration_dir writes, in the order it returns them.
CALIBRATION_FILES = (
    "bandwidth.csv",
    "interference.csv",
    "gemm_profile.csv",
    "fits.csv",
    "calibration.yaml",
    "bandwidth.png",
    "interference.png",
)


class OutputError(FoTuneError, ValueError):
    """An output path that cannot be written (or must not be replaced); the message says what to do."""


# ----------------------------------------------------------------------------------- where to write
def default_out_dir(cal: Calibration) -> Path:
    """``results/calibration/<device-key>/tp<N>`` (relative to the working directory)."""
    return DEFAULT_ROOT / cal.fingerprint.device_key / f"tp{cal.world_size}"


def default_profile_path(device_key: str, shape: tuple[int, int, int], dtype: str) -> Path:
    """``results/profiles/<device-key>/<M>x<N>x<K>-<dtype>.csv`` (relative to the working directory)."""
    m, n, k = shape
    return PROFILE_ROOT / device_key / f"{m}x{n}x{k}-{dtype}.csv"


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_ancestor(path: Path, shown: Path) -> None:
    """The nearest existing folder above ``path`` must be a folder that takes new entries: its
    permissions allow it, and a probe folder made there (and removed at once) proves it, since
    root passes every permission check on file systems that refuse new entries (``/proc``, a
    read-only mount)."""
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise OutputError(f"cannot write {shown}: {base} is a file, not a folder; choose another path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {shown}: {base} is not writable; choose another path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fo-tune-probe-", dir=base))
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise OutputError(
            f"cannot write {shown}: {base} takes no new files ({why}); choose another path"
        ) from None


def check_writable(
    out_dir: str | Path,
    *,
    allowed: Sequence[str] = CALIBRATION_FILES,
    what: str = "calibration",
    writer: str = "fo-tune",
) -> None:
    """Raise ``OutputError`` unless an output folder (default: ``write_calibration_dir``'s) can be
    created or replaced at ``out_dir``.

    ``out_dir`` may not exist yet (its nearest existing ancestor must be a writable folder); if it
    exists it must be a writable folder in a writable parent, holding only the ``allowed`` files
    ``writer`` writes there (so a mistyped ``--out`` never replaces someone's folder); ``what``
    names such a folder in the message.
    """
    shown = Path(out_dir)
    path = Path(os.path.abspath(out_dir))
    if Path.cwd() == path or path in Path.cwd().parents:
        raise OutputError(f"--out {shown} is the current folder or above it; give a folder below it")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise OutputError(f"--out {shown} is a file; give a folder (it is created if missing)")
        foreign = sorted(p.name for p in path.iterdir() if p.name not in allowed)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise OutputError(
                f"--out {shown} holds files {writer} did not write ({foreign[0]}{more}); "
                f"give a new or empty folder, or a previous {what} folder to replace"
            )
        for folder in (path.parent, path):
            if not os.access(folder, os.W_OK | os.X_OK):
                raise OutputError(f"cannot replace {shown}: {folder} is not writable; choose another --out")
    check_ancestor(path, shown)


def check_writable_file(path: str | Path) -> None:
    """Raise ``OutputError`` unless a file can be written (atomically) at ``path``."""
    shown = Path(path)
    target = Path(os.path.abspath(path))
    if target.is_dir():
        raise OutputError(f"--out {shown} is a folder; give a file name")
    check_ancestor(target, shown)


@contextlib.contextmanager
def made_parents(folder: Path):
    """Create ``folder`` and its missing ancestors; remove the ones created (if still empty) on error."""
    missing = []
    probe = Path(os.path.abspath(folder))
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for made in missing:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


@contextlib.contextmanager
def replacing_folder(out_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``out_dir`` (mode 755) to build its new contents in. Leaving the block
    normally swaps it in for ``out_dir`` as a whole (``swap_in``); on any error it is removed, and an
    existing ``out_dir`` and the parent folders are left as they were (``made_parents``)."""
    target = Path(os.path.abspath(out_dir))
    with made_parents(target.parent):
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)
            yield tmp
            swap_in(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# -------------------------------------------------------------------------------------------- CSV
def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else format(value, ".6g")
    return value


def write_rows(f: Any, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    writer = csv.writer(f, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([_cell(v) for v in row] for row in rows)


def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        write_rows(f, header, rows)


def _time_key(p: GemmPoint) -> tuple[bool, float]:
    """Measured configs by time, skipped ones (and NaN times) last."""
    ok = p.status == "ok" and not math.isnan(p.time_ms)
    return (not ok, p.time_ms if ok else math.inf)


def _rows(points: Iterable[Any], names: Sequence[str], device_key: str) -> list[list[Any]]:
    return [[*(getattr(p, n) for n in names), device_key] for p in points]


def _write_tables(cal: Calibration, folder: Path) -> None:
    key = cal.fingerprint.device_key
    _write_csv(folder / "bandwidth.csv", BANDWIDTH_COLUMNS, _rows(cal.bandwidth, _BANDWIDTH_FIELDS, key))
    _write_csv(
        folder / "interference.csv",
        INTERFERENCE_COLUMNS,
        _rows(cal.interference, INTERFERENCE_COLUMNS[:-1], key),
    )
    gemm = sorted(cal.gemm, key=lambda p: ((p.m, p.n, p.k), *_time_key(p)))
    _write_csv(folder / "gemm_profile.csv", GEMM_COLUMNS, _rows(gemm, GEMM_COLUMNS[:-1], key))
    _write_csv(folder / "fits.csv", FITS_COLUMNS, _rows(cal.fits, FITS_COLUMNS[:-1], key))


def write_profile_csv(points: list[GemmPoint], path: str | Path, device_key: str, timing: str) -> Path:
    """One shape's tile profile, sorted by time (skipped configs last), written atomically: the
    columns of ``gemm_profile.csv`` and ``timing`` (how the samples ran:
    ``fo_tune.calibration.timing_name``)."""
    path = Path(path)
    check_writable_file(path)
    target = Path(os.path.abspath(path))
    rows = [[*row, timing] for row in _rows(sorted(points, key=_time_key), GEMM_COLUMNS[:-1], device_key)]
    with made_parents(target.parent):
        atomic_write(target, lambda f: write_rows(f, [*GEMM_COLUMNS, "timing"], rows))
    return path


def grids_path(profile_path: str | Path) -> Path:
    """Where ``fo-tune profile`` writes the grids' side-by-side timing next to a profile CSV:
    ``<M>x<N>x<K>-<dtype>.csv`` -> ``<M>x<N>x<K>-<dtype>-grids.csv``."""
    path = Path(profile_path)
    return path.with_name(f"{path.stem}-grids{path.suffix or '.csv'}")


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


# ------------------------------------------------------------------------------------------ plots
def size_label(size: float, _pos: Any = None) -> str:
    """Bytes as ``4 KiB`` / ``256 MiB`` (also a matplotlib tick formatter)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            value = size / (1 << shift)
            return f"{value:g} {unit}"
    return f"{size:g} B"


def _cap_label(cap: int) -> str:
    return "default" if cap == 0 else f"{cap} CTAs"


def figure(nrows: int, ncols: int, width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _plot_bandwidth(cal: Calibration, path: Path) -> None:
    from matplotlib.ticker import FuncFormatter

    collectives = list(dict.fromkeys(p.collective for p in cal.bandwidth))
    ncols = min(2, max(1, len(collectives)))
    nrows = max(1, math.ceil(len(collectives) / ncols))
    fig, axes = figure(nrows, ncols, 5.5, 3.8)
    fig.suptitle(f"bus bandwidth, {cal.world_size} ranks, {cal.fingerprint.device_key}")
    flat = [ax for row in axes for ax in row]
    for ax, collective in zip(flat, collectives, strict=False):
        points = [p for p in cal.bandwidth if p.collective == collective]
        for cap in sorted({p.nccl_max_ctas for p in points}):
            line = sorted((p for p in points if p.nccl_max_ctas == cap), key=lambda p: p.size_bytes)
            ax.plot(
                [p.size_bytes for p in line], [p.busbw_gbs for p in line], marker="o", label=_cap_label(cap)
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(size_label))
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_title(collective)
        ax.set_xlabel("message size")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(title="NCCL CTA cap", fontsize="small")
    for ax in flat[len(collectives) :]:
        ax.set_axis_off()
    if not collectives:
        flat[0].text(0.5, 0.5, "no bandwidth points", ha="center", va="center")
    fig.savefig(path, dpi=110)


def _heat(
    ax: Any, values: list[list[float]], notes: list[list[str]], rows: list[int], cols: list[int]
) -> Any:
    """One annotated heat map (rows = r, columns = cap); NaN cells stay blank. Returns the image."""
    import numpy as np

    data = np.ma.masked_invalid(np.array(values, dtype=float))
    finite = data.compressed()
    lo = float(min(1.0, finite.min())) if finite.size else 1.0
    hi = float(max(lo + 0.05, finite.max())) if finite.size else 2.0
    image = ax.imshow(data, cmap="OrRd", vmin=lo, vmax=hi, aspect="auto")
    ax.set_xticks(range(len(cols)), [_cap_label(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel("NCCL CTA cap")
    ax.set_ylabel("SMs left free (r)")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            if not math.isnan(value):
                dark = (value - lo) / (hi - lo) > 0.6
                text = f"{value:.2f}x{notes[i][j]}"
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    return image


def _plot_interference(cal: Calibration, path: Path) -> None:
    groups = list(dict.fromkeys((p.collective, p.size_bytes) for p in cal.interference))
    fig, axes = figure(max(1, len(groups)), 2, 4.8, 3.4)
    concurrent = all(p.concurrent for p in cal.interference)
    how = "concurrent" if concurrent else "CPU: run one after the other, not concurrently"
    fig.suptitle(f"interference ({how}), {cal.world_size} ranks, {cal.fingerprint.device_key}")
    if not groups:
        for ax in axes[0]:
            ax.set_axis_off()
        axes[0][0].text(0.5, 0.5, "no interference measured", ha="center", va="center")
    for (collective, size), (comm_ax, gemm_ax) in zip(groups, axes, strict=False):
        points = [p for p in cal.interference if (p.collective, p.size_bytes) == (collective, size)]
        rows = sorted({p.sms_free for p in points})
        cols = sorted({p.nccl_max_ctas for p in points})
        comm = [[math.nan] * len(cols) for _ in rows]
        gemm = [[math.nan] * len(cols) for _ in rows]
        notes = [[""] * len(cols) for _ in rows]
        for p in points:
            i, j = rows.index(p.sms_free), cols.index(p.nccl_max_ctas)
            comm[i][j], gemm[i][j] = p.comm_slowdown, p.gemm_slowdown
            notes[i][j] = "\n(after GEMM)" if p.concurrent and not p.comm_during_gemm else ""
        image = _heat(comm_ax, comm, notes, rows, cols)
        fig.colorbar(image, ax=comm_ax, shrink=0.8)
        comm_ax.set_title(f"{collective} {size_label(size)}: collective slowdown", fontsize="medium")
        blank = [[""] * len(cols) for _ in rows]
        image = _heat(gemm_ax, gemm, blank, rows, cols)
        fig.colorbar(image, ax=gemm_ax, shrink=0.8)
        gemm_ax.set_title(f"{collective} {size_label(size)}: GEMM slowdown", fontsize="medium")
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------- the whole folder
def write_calibration_dir(cal: Calibration, out_dir: str | Path) -> list[Path]:
    """Write every file of ``CALIBRATION_FILES`` into ``out_dir``, replacing it as a whole.

    Built in a temporary sibling folder, then swapped in; on any error the temporary folder is
    removed and an existing ``out_dir`` is left as it was. Returns the paths written.
    """
    check_writable(out_dir)
    with replacing_folder(out_dir) as tmp:
        _write_tables(cal, tmp)
        save_calibration(cal, tmp / "calibration.yaml")
        _plot_bandwidth(cal, tmp / "bandwidth.png")
        _plot_interference(cal, tmp / "interference.png")
    return [Path(out_dir) / name for name in CALIBRATION_FILES]


def swap_in(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    aside = out_dir.parent / f".{out_dir.name}.old-{secrets.token_hex(4)}"
    os.rename(out_dir, aside)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(aside, out_dir)
        raise
    shutil.rmtree(aside, ignore_errors=True)


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
