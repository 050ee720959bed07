"""``fo-tune model``: the cost model against measurements (check), and fitting its free
parameters to them (fit). Library: ``fo_tune.model.check``, ``fo_tune.engines.copy_engine.fit``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from fo_tune.cli.calibrate import fmt, summary_table
from fo_tune.cli.common import console, nonempty_path
from fo_tune.cli.errors import handle_errors
from fo_tune.cli.search_moe import MOE_REPORT_KIND

if TYPE_CHECKING:
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.model.check import Checked, Unmeasured

HELP = "\n\n".join(
    [
        "The cost model against measurements: how far its predictions are from measured table rows "
        "and measured search trials (check), and fitting its free parameters to them (fit).",
        "Commands: check (predict every measured row or trial of the given files; print predicted "
        "vs measured per row and the mean absolute percentage error) and fit (fit the copy engine's "
        "free parameters to measured table rows and the Triton engine's host times to measured "
        "trials, keeping rows out of the fit to report their error apart, and write them into the "
        "calibration with their sources).",
    ]
)

CHECK_HELP = "\n\n".join(
    [
        "Predict every measured row of the given tables and every measured trial of the given search "
        "reports with a calibration's cost model; print predicted vs measured per row and, last, "
        "one line: MAPE X% (worst Y%) over N measured rows. N counts the rows the model priced; a row "
        "it cannot price (a tile the calibration never profiled, a schedule that cannot run its "
        "shape) is left out of the MAPE and counted apart, with a line per reason above.",
        "A table row is measured unless its provenance says mode: predict; its latency is its "
        "measured_ms (overlap) or the overlap: false fallback it runs (fallback_ms). An M-range "
        "row is predicted at the M it was tuned at. A trial counts when it completed with a "
        "measurement of its own (trials.csv of `fo-tune search`, or its report folder).",
        "Without files: the packaged tables of the calibration's device. Without --calibration: the "
        "packaged calibration (world size 2).",
        "Predicted rows that rest on an extrapolation or on another GPU's measurements (a row's "
        "basis, e.g. a TP=8 plan from the TP=2 calibration, or an fp8 plan from a sibling GPU's fp8 "
        "GEMM profile) are counted per file with their basis, as are the trials of a predict "
        "search's report that rests on one: they have no measured error yet.",
        "Exit code 0 when printed; 2 for a missing or malformed file, files with neither a measured "
        "row nor such a predicted one, a file measured on another machine than the calibration's "
        "(its table's or report's device key; pass that machine's --calibration), or a calibration "
        "without what an engine's term needs (its section and the command that measures it are named).",
    ]
)

FIT_HELP = "\n\n".join(
    [
        "Fit the cost model's free parameters to measurements and write them into the calibration, "
        "each with its source: the copy engine's (clock context, per-chunk and per-call overheads, "
        "the exposed part of AllReduce's last gather, the tiled mode's GEMM factor, the library's "
        "small-tile efficiency and beta = 1 factor) to the measured copy-engine and overlap: false "
        "rows and trials of the files, the Triton engine's host times to their measured Triton "
        "trials. The other parameters are measured (`fo-tune calibrate`) and left alone.",
        "--hold-out NxK keeps every row and trial of that (N, K) out of the fit, --hold-out-file "
        "every one of that file; their error is printed apart.",
        "Writes --out (default: the calibration file itself) once the fit is done, as a whole: "
        "Ctrl-C before that leaves it as it was. Prints each term's fitted values and its MAPE over "
        "the rows and trials fitted (and held out).",
        "Exit code 0 when written; 2 for a missing or malformed file, an --out that is not a .yaml "
        "file it may write, a --hold-out no file has, or files with nothing to fit; 130 when "
        "interrupted.",
    ]
)

CalibrationOpt = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        parser=nonempty_path,
        metavar="FILE",
        help="calibration.yaml whose model to check. Default: the packaged calibration (world size 2).",
    ),
]
FilesArg = Annotated[
    list[Path] | None,
    typer.Argument(
        metavar="TABLE_OR_REPORT",
        help="Tables (.yaml) and search reports (trials.csv or its folder). Default: the packaged "
        "tables of the calibration's device.",
        show_default=False,
    ),
]
FitCalibrationOpt = Annotated[
    Path, typer.Option("--calibration", parser=nonempty_path, metavar="FILE", help="calibration.yaml to fit.")
]
HoldOutOpt = Annotated[
    list[str] | None,
    typer.Option("--hold-out", metavar="NxK", help="Keep every row and trial of this (N, K) out of the fit."),
]
HoldOutFileOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--hold-out-file", metavar="PATH", help="Keep every row and trial of this file out of the fit."
    ),
]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        parser=nonempty_path,
        metavar="FILE",
        help="Where to write the fit: a new .yaml file, or a calibration to replace.",
    ),
]

_NK = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$", re.ASCII)  # (0-9 only, as a shape's)
# How much of a YAML file is read to tell a calibration given as a table (its kind is on its second
# line as fo_tune.calibrate.calibration.save_calibration writes it) from a table.
KIND_PEEK_CHARS = 4096


def _is_kind(path: Path, name: str) -> bool:
    """Whether ``path`` is a YAML file of top-level ``kind: <name>`` (a calibration's or a search
    report's summary, which are no tables)."""
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        return False
    with path.open(encoding="utf-8", errors="replace") as f:
        head = f.read(KIND_PEEK_CHARS)
    kind = re.compile(rf"^kind:\s*['\"]?{re.escape(name)}['\"]?\s*$", re.MULTILINE)
    return kind.search(head) is not None


def _calibration(path: Path | None) -> tuple[Calibration, Path]:
    from fo_tune.calibrate.calibration import load_calibration
    from fo_tune.calibrate.find import packaged_calibration
    from fo_tune.search import SearchError

    if path is None:
        path = packaged_calibration(None, 2)
        if path is None:
            raise SearchError("no packaged calibration found; pass --calibration FILE")
    return load_calibration(path), path


def _default_tables(cal: Calibration) -> list[Path]:
    """The packaged tables of the calibration's device."""
    from importlib import resources

    try:
        folder = Path(str(resources.files("fo_results") / "tables")) / cal.fingerprint.device_key
    except (ModuleNotFoundError, TypeError):
        return []
    return sorted(folder.glob("*.yaml")) if folder.is_dir() else []


def _files(files: list[Path] | None, cal: Calibration) -> list[Path]:
    """The tables and reports to read: ``files``, else the packaged tables of the calibration's
    device; ``CheckError`` when there are none or one does not exist."""
    from fo_kernels.files import read_yaml
    from fo_tune.calibrate.calibration import CALIBRATION_KIND
    from fo_tune.model.check import CheckError
    from fo_tune.search.report import REPORT_KIND
    from fo_tune.tables.merge import is_lock_file

    # (a glob of a table folder, TABLES/*/*, names each table's lock file too: the table is read)
    given = [p for p in files or [] if not is_lock_file(p)]
    if files and not given:
        raise CheckError(f"{files[0]}: a table's lock file, not a table or report; give the table beside it")
    paths = given or _default_tables(cal)
    if not paths:
        raise CheckError(f"no packaged table for {cal.fingerprint.device_key}; give tables or reports")
    for p in paths:
        if not p.exists():
            raise CheckError(f"{p}: no such table or report")
        moe_summary = p / "summary.yaml" if p.is_dir() else p
        if _is_kind(moe_summary, MOE_REPORT_KIND):  # an MoE search reports no trial: its table has the rows
            data = read_yaml(moe_summary, error=CheckError, missing=CheckError, missing_hint="no summary")
            table = data.get("table") if isinstance(data, dict) else None
            raise CheckError(f"{p} is an MoE search's report, which lists no trials; pass its table {table}")
        if p.is_dir() and not (p / "trials.csv").is_file():
            runs = sorted(p.glob("*/trials.csv"))
            hint = (
                f"it holds report folders: give one of them, e.g. {runs[-1].parent}"
                if runs
                else "give a search report's folder (`fo-tune search` writes trials.csv there) or a table"
            )
            raise CheckError(f"{p}: a folder without a trials.csv, so no search report; {hint}")
        if _is_kind(p, CALIBRATION_KIND):
            raise CheckError(f"{p} is a calibration, not a table or report; pass it as --calibration {p}")
        if _is_kind(p, REPORT_KIND):
            raise CheckError(f"{p} is a search report's summary, not a table; pass its folder {p.parent}")
    return paths


def _label(u: Unmeasured) -> str:
    """A table by its file name, a report's trials by their folder."""
    source = Path(u.source)
    return source.name if source.suffix != ".csv" else f"report {source.parent}"


def _check_terms(cal: Calibration, rows: list, engines: set[str]) -> None:
    """A calibration without what a measured row's engine needs: the section and its command."""
    from fo_tune.calibrate.calibration import CalibrationError
    from fo_tune.engines import get_tuner

    for engine in sorted(engines - {""}):
        collectives = {m.schedule.collective for m in rows if m.schedule.engine == engine}
        for collective in sorted(collectives):
            gap = get_tuner(engine).calibration_gap(cal, collective)
            if gap:
                raise CalibrationError(f"{cal.fingerprint.device_key} calibration: engine {engine} {gap}")


def print_checked(rows: list[Checked], title: str) -> None:
    """Predicted vs measured per row, then the error line."""

    out = summary_table(
        title, ["file", "what", "engine", "schedule", "measured ms", "predicted ms", "error"], 4
    )
    for c in rows:
        cells = [
            Path(c.source).name,
            c.item,
            c.engine or "-",
            c.schedule,
            fmt(c.measured_ms, ".4g"),
            fmt(c.predicted_ms, ".4g"),
            "-" if math.isnan(c.predicted_ms) else f"{c.error:+.1%}",
        ]
        out.add_row(*(escape(cell) for cell in cells))
    console.print(out)


def error_line(rows: list[Checked], what: str = "measured rows") -> str:
    """``MAPE X% (worst Y%) over N <what>``, N the rows priced (those the MAPE is over), and how
    many more the model could not price (their reasons are ``unpriced_lines``)."""
    from fo_tune.model.check import mape, priced

    n = len(priced(rows))
    left = len(rows) - n
    if n == 0:
        return f"no MAPE: the model priced none of {len(rows)} {what} (why: above)"
    mean, worst = mape(rows)
    more = f"; {left} more the model could not price (why: above)" if left else ""
    return f"MAPE {mean:.1%} (worst {worst:.1%}) over {n} {what}{more}"


def unpriced_lines(rows: list[Checked]) -> list[str]:
    """One line per reason the model could not price some rows: how many, an example, and why."""
    reasons: dict[str, list[Checked]] = {}
    for row in rows:
        if row.unpriced:
            reasons.setdefault(row.unpriced, []).append(row)
    return [
        f"not priced: {len(same)} row(s) (e.g. {Path(same[0].source).name} {same[0].item}): {reason}"
        for reason, same in reasons.items()
    ]


@handle_errors
def check(files: FilesArg = None, calibration: CalibrationOpt = None) -> None:
    """``fo-tune model check`` (its help: ``CHECK_HELP``)."""
    from fo_tune.calibrate.missing import measured_rows
    from fo_tune.engines import cost_models_by_dtype
    from fo_tune.model.check import CheckError, check_machines, measured_in, unmeasured_in

    cal, path = _calibration(calibration)
    paths = _files(files, cal)
    items = measured_in(paths)
    unmeasured = unmeasured_in(paths)
    for u in unmeasured:
        w = u.world_size
        where = (
            "a measured MoE search is not built; `python bench/moe_ep.py --out DIR` times the "
            f"engines on {w} GPUs"
            if u.moe
            else f"measured rows come from {measured_rows(w, u.dtype)} on {w} GPUs"
        )
        console.print(
            f"{_label(u)}: {u.rows} predicted {u.what} rest on: {u.basis}; no measured error yet ({where})",
            markup=False,
            highlight=False,
        )
    if not items and unmeasured:
        return
    if not items:
        raise CheckError(
            f"no measured row or trial in {', '.join(map(str, paths))} (a predict search's rows and "
            "trials are the model's own numbers); give tables or reports of a measured search "
            "(--mode measure or hybrid, on the GPUs), or leave the files out to check the packaged "
            "measured tables"
        )
    check_machines(items, cal.fingerprint.device_key, path)
    _check_terms(cal, items, {m.schedule.engine or "" for m in items})
    models = cost_models_by_dtype(cal, (m.schedule.dtype for m in items))
    rows = [m.checked(models[m.schedule.dtype]) for m in items]
    print_checked(rows, f"model of {path} against {len(paths)} file(s)")
    for line in unpriced_lines(rows):
        console.print(line, highlight=False, markup=False)
    console.print(error_line(rows), highlight=False, markup=False)


def _sources(path: Path) -> set[Path]:
    """The sources the rows of ``path`` carry (a report folder's rows come from its trials.csv),
    resolved, so that ``./t.yaml``, ``t.yaml`` and its absolute path name the same file."""
    return {path.resolve(), (path / "trials.csv").resolve()}


def _held_out(
    nks: list[tuple[int, int]], hold_files: list[Path], paths: list[Path]
) -> Callable[[Checked], bool]:
    """Whether a row is held out of the fit; each ``--hold-out`` must match a measured row or trial
    of ``paths``, each ``--hold-out-file`` be one of ``paths`` (else ``typer.BadParameter``: a typo
    would silently hold out nothing)."""
    from fo_tune.model.check import measured_in

    fitted = set().union(*(_sources(p) for p in paths))
    for p in hold_files:
        if not _sources(p) & fitted:
            raise typer.BadParameter(
                f"--hold-out-file {p} is not one of the files fitted; pass it as a file too, or drop it"
            )
    present = {(m.schedule.problem.n, m.schedule.problem.k) for m in measured_in(paths)}
    for n, k in nks:
        if (n, k) not in present:
            raise typer.BadParameter(
                f"--hold-out {n}x{k}: no measured row or trial has N, K = {n}, {k}; "
                "choose an N x K of the files (`fo-tune model check` lists them)"
            )
    names = set().union(*(_sources(p) for p in hold_files))

    def held(c: Checked) -> bool:
        _, n, k = (int(x) for x in c.item.split()[-1].split("x"))
        return (n, k) in nks or Path(c.source).resolve() in names

    return held


def _check_fit_out(out: Path) -> None:
    """Refuse a ``fit --out`` that would replace a file other than a calibration (a table, a CSV)."""
    from fo_tune.calibrate.calibration import CALIBRATION_KIND
    from fo_tune.output import refuse_foreign

    if out.suffix not in (".yaml", ".yml"):
        raise typer.BadParameter(f"--out {out}: a calibration is YAML; give a file name ending in .yaml")
    refuse_foreign(out, lambda p: _is_kind(p, CALIBRATION_KIND), ours="a calibration", named=f"--out {out}")


@handle_errors
def fit(
    calibration: FitCalibrationOpt,
    files: FilesArg = None,
    hold_out: HoldOutOpt = None,
    hold_out_file: HoldOutFileOpt = None,
    out: OutOpt = None,
) -> None:
    """``fo-tune model fit`` (its help: ``FIT_HELP``)."""
    from fo_tune.calibrate.calibration import load_calibration, save_calibration
    from fo_tune.engines.copy_engine.fit import fit_calibration
    from fo_tune.model.check import CheckError, check_machines, measured_in
    from fo_tune.output import check_writable_file

    nks = []
    for text in hold_out or []:
        match = _NK.match(text)
        if match is None:
            raise typer.BadParameter(f"--hold-out {text!r}: expected NxK, e.g. 8192x8192")
        nks.append((int(match.group(1)), int(match.group(2))))
    cal = load_calibration(calibration)
    target = out or calibration
    check_writable_file(target)  # a bad --out costs no fit
    if out is not None:
        _check_fit_out(out)
    paths = _files(files, cal)
    # as check refuses them: another machine's rows would fit this machine's parameters to it
    check_machines(measured_in(paths), cal.fingerprint.device_key, calibration)
    is_held = _held_out(nks, list(hold_out_file or []), paths)
    held = [f"N, K = {n}, {k}" for n, k in nks] + [f"every one of {p}" for p in hold_out_file or []]
    fits = fit_calibration(cal, files=paths, held_out=is_held, held_out_text="; ".join(held))
    if not fits:
        raise CheckError(
            f"nothing to fit in {', '.join(map(str, paths))}: no measured copy-engine, overlap: false "
            "or Triton row or trial the calibration has a section for (overlap: false rows fit the "
            "copy engine's, which a calibration without its peer copies, as on the CPU, cannot "
            "price); give tables or search reports that have them, e.g. a measured search's report"
        )
    save_calibration(cal, target)
    for f in fits:
        values = ", ".join(f"{name} {value:.4g}" for name, value in f.values.items())
        console.print(f"{f.term}: {values}", markup=False, highlight=False)
        for label, rows in (("fit", f.fit), ("held out", f.held_out)):
            if rows or label == "fit":
                for line in unpriced_lines(rows):
                    console.print(f"  {line}", markup=False, highlight=False)
                console.print(f"  {label}: {error_line(rows)}", markup=False, highlight=False)
    console.print(f"[green]wrote[/] {escape(str(target))}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add the ``model`` command group (check, fit) to the root app."""
    sub = typer.Typer(name="model", help=HELP, no_args_is_help=True, add_completion=False)
    sub.command("check", help=CHECK_HELP, short_help="Predicted vs measured rows and trials.")(check)
    sub.command("fit", help=FIT_HELP, short_help="Fit the model's free parameters to measurements.")(fit)
    app.add_typer(sub, name="model")
