"""The model against measurements: predict every measured table row and every measured search
trial, and say how far off the predictions are (``fo-tune model check``).

- A table row is measured unless its provenance says ``mode: predict`` (``fo_kernels.table
  .row_kind``); its latency is ``measured_ms`` for an overlapped row and the ``overlap: false``
  fallback it runs otherwise (``fallback_ms``, else ``sequential_ms``). An M-range row is
  predicted at the M it was tuned at (``tuned_m``).
- A trial of a search report (``trials.csv``) counts when it completed with a measurement of its
  own (not a cache hit). Its schedule is rebuilt from the ``engine`` and ``settings`` columns;
  reports written before engines were plug-ins (Triton trials only) are read from their
  ``tile`` ... ``wait_mode`` columns and the group sizes in their ``schedule`` text.

Predicted rows and trials are never reported (a prediction checked against itself says nothing):
the all_gather terms, which no GPU measurement has checked yet, show up here only once measured
all_gather rows or trials exist. Predicted rows that rest on something other than their machine's
measurements (``Schedule.basis``: a calibration extrapolated to their world size) are counted by
``unmeasured_in``, so the command can say they have no measured error yet.

MoE tables (``moe-w<W>-<dtype>.yaml``, ``fo-tune search -c moe``) are read too, since a glob of a
device key's folder takes them with the dense ones: the dense model prices none of their rows (no
measured MoE row exists; a measured MoE search is not built), and their predicted rows count in
``unmeasured_in`` by the basis their provenance records.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fo_kernels.engines.triton.settings import TritonSettings
from fo_kernels.errors import FoTuneError, ScheduleError
from fo_kernels.schedule import Problem, Schedule, settings_type
from fo_kernels.table import ScheduleTable, row_kind
from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import CalibrationError
from fo_tune.model.core import CostModel


class CheckError(FoTuneError, ValueError):
    """A file ``fo-tune model check`` cannot read as a table or a search report."""


@dataclass(frozen=True, slots=True)
class Measured:
    """One measurement of a schedule at an exact shape."""

    source: str  # the file
    item: str  # "row 4096x8192x4096" or "trial 12 4096x8192x4096"
    schedule: Schedule  # exact-shape
    measured_ms: float

    def checked(self, model: CostModel) -> Checked:
        p = self.schedule.problem
        assert p.m is not None
        predicted_ms, unpriced = _predict(model, self.schedule, p.m, p.n, p.k)
        return Checked(
            self.source,
            self.item,
            self.schedule.engine or "",
            self.schedule.describe().split(": ", 1)[-1],
            self.measured_ms,
            predicted_ms,
            unpriced,
        )


@dataclass(frozen=True, slots=True)
class Checked:
    """One measurement and the model's prediction of it."""

    source: str  # the file
    item: str  # "row 4096x8192x4096" or "trial 12 4096x8192x4096"
    engine: str  # "" for overlap: false
    schedule: str
    measured_ms: float
    predicted_ms: float  # nan where the model cannot price it
    unpriced: str = ""  # why the model cannot price it (its error, one line); "" where it can

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def mape(rows: Sequence[Checked]) -> tuple[float, float]:
    """(mean, worst) absolute percentage error over ``rows`` (nan, nan when empty)."""
    errs = [abs(r.error) for r in priced(rows)]
    if not errs:
        return math.nan, math.nan
    return sum(errs) / len(errs), max(errs)


def priced(rows: Sequence[Checked]) -> list[Checked]:
    """The rows the model priced (a finite prediction): the ones a MAPE is over."""
    return [r for r in rows if math.isfinite(r.predicted_ms)]


def _predict(model: CostModel, schedule: Schedule, m: int, n: int, k: int) -> tuple[float, str]:
    """(predicted ms, "") or (nan, why not in one line) where the calibration cannot price the
    schedule (a tile it never profiled, a missing curve) or the schedule cannot run the shape."""
    try:
        return model.predict(schedule, m, n, k).total_ms, ""
    except (CalibrationError, ScheduleError) as exc:
        return math.nan, " ".join(str(exc).split())


def table_rows(table: ScheduleTable, source: str) -> list[Measured]:
    """Every measured row of ``table`` (see the module docstring)."""
    out = []
    for row in table.rows:
        if row_kind(row) != "measured":
            continue
        prov = row.provenance
        m = row.problem.m if row.problem.m is not None else prov.get("tuned_m")
        measured = (
            prov.get("measured_ms") if row.overlap else prov.get("fallback_ms", prov.get("sequential_ms"))
        )
        if not isinstance(m, int) or not isinstance(measured, (int, float)) or not measured > 0:
            continue
        n, k = row.problem.n, row.problem.k
        exact = Schedule(
            collective=row.collective,
            dtype=row.dtype,
            world_size=row.world_size,
            problem=Problem(m=m, n=n, k=k),
            settings=row.settings,
        )
        kind = "row" if row.problem.m is not None else "range row at"
        out.append(Measured(source, f"{kind} {m}x{n}x{k}", exact, float(measured)))
    return out


_GROUPS = re.compile(r"signal (\d+) tiles, groups \[([\d, ]+)\]")
_TILE = re.compile(r"^(\d+)x(\d+)x(\d+) gm(\d+) w(\d+) s(\d+)( ws)?( pp)?$")


def _old_trial_settings(row: dict[str, str]) -> TritonSettings | None:
    """The Triton settings of a trial in the report format before engines were plug-ins."""
    tile_match = _TILE.match(row.get("tile", "").strip())
    groups_match = _GROUPS.search(row.get("schedule", ""))
    if tile_match is None or groups_match is None:
        return None
    bm, bn, bk, gm, w, st = (int(x) for x in tile_match.groups()[:6])
    tile = Tile(
        block_m=bm,
        block_n=bn,
        block_k=bk,
        group_m=gm,
        num_warps=w,
        num_stages=st,
        warp_specialize=bool(tile_match.group(7)),
        pingpong=bool(tile_match.group(8)),
    )
    return TritonSettings(
        tile=tile,
        sms_free=int(row["sms_free"]),
        nccl_max_ctas=int(row["nccl_max_ctas"]),
        signal_tiles=int(groups_match.group(1)),
        groups=tuple(int(x) for x in groups_match.group(2).split(",")),
        layout=row["layout"],
        wait_mode=row["wait_mode"],
    )


def report_trials(path: Path) -> list[Measured]:
    """Every measured trial of a search report's ``trials.csv``."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CheckError(f"{path}: cannot read it as a search report's trials.csv: {exc}") from None
    if rows and not {"shape", "state", "measured_ms", "collective"} <= set(rows[0]):
        raise CheckError(f"{path}: not a search report's trials.csv (no shape/state/measured_ms columns)")
    out = []
    for row in rows:
        try:
            measured = float(row["measured_ms"]) if row["measured_ms"] else math.nan
        except ValueError:
            continue
        if row["state"] != "COMPLETE" or row.get("cached_from") or not measured > 0:
            continue
        m, n, k = (int(x) for x in row["shape"].split("x"))
        try:
            if row.get("settings"):
                settings = settings_type(row["engine"]).from_dict(json.loads(row["settings"]))
            else:
                settings = _old_trial_settings(row)
            if settings is None:
                continue
            schedule = Schedule(
                collective=row["collective"],
                dtype=row["dtype"],
                world_size=int(row["world_size"]),
                problem=Problem(m=m, n=n, k=k),
                settings=settings,
            )
        except (ScheduleError, ValueError, KeyError):
            continue
        out.append(Measured(str(path), f"trial {row['number']} {row['shape']}", schedule, measured))
    return out


def measured_in(paths: Iterable[Path]) -> list[Measured]:
    """Every measured row or trial of ``paths`` (tables: ``*.yaml``; reports: ``trials.csv`` or a
    report folder holding one)."""
    from fo_tune.tables.kinds import load_any_table

    out: list[Measured] = []
    for path in paths:
        if path.is_dir():
            path = path / "trials.csv"
        if path.suffix in (".yaml", ".yml"):
            table = load_any_table(path)
            if isinstance(table, ScheduleTable):  # an MoE table's rows are no dense GEMM's
                out += table_rows(table, str(path))
        elif path.suffix == ".csv":
            out += report_trials(path)
        else:
            raise CheckError(
                f"{path}: expected a table (.yaml) or a search report (trials.csv, or its folder)"
            )
    return out


@dataclass(frozen=True, slots=True)
class Unmeasured:
    """Predicted rows of one table, or predicted trials of one search report, that share a
    ``basis``: nothing measured them yet."""

    source: str  # the file
    basis: str
    world_size: int
    rows: int
    dtype: str = "bfloat16"  # the table's
    moe: bool = False  # rows of an MoE table (fo-tune search -c moe)
    what: str = "row(s)"  # "trial(s)" for a report's


def unmeasured_in(paths: Iterable[Path]) -> list[Unmeasured]:
    """The predicted rows with a basis in the tables of ``paths`` (``*.yaml``), by file and basis: a
    dense row's ``basis``, an MoE row's ``provenance["basis"]``; and the predicted trials of the
    search reports of ``paths`` whose request has a basis (``report_unmeasured``)."""
    from fo_tune.tables.kinds import load_any_table

    out: list[Unmeasured] = []
    for path in paths:
        if path.is_dir() or path.suffix == ".csv":
            out += report_unmeasured(path / "trials.csv" if path.is_dir() else path)
            continue
        if path.suffix not in (".yaml", ".yml"):
            continue
        table = load_any_table(path)
        moe = not isinstance(table, ScheduleTable)
        counts: dict[str, int] = {}
        for row in table.rows:
            if moe:
                basis, predicted = row.provenance.get("basis", ""), row.kind == "predicted"
            else:
                basis, predicted = row.basis, row_kind(row) == "predicted"
            if basis and predicted:
                counts[basis] = counts.get(basis, 0) + 1
        out += [
            Unmeasured(str(path), basis, table.world_size, n, table.dtype, moe=moe)
            for basis, n in counts.items()
        ]
    return out


def report_unmeasured(trials: Path) -> list[Unmeasured]:
    """The completed predicted trials of a search report (``trials.csv``) whose request, in the
    ``summary.yaml`` beside it, rests on a ``basis`` (a predict search from an extrapolated
    calibration); none without that summary or basis."""
    from fo_kernels.files import read_yaml

    summary = trials.parent / "summary.yaml"
    if not trials.is_file() or not summary.is_file():
        return []
    data = read_yaml(summary, error=CheckError, missing=CheckError, missing_hint="no search report summary")
    request = data.get("request") if isinstance(data, dict) else None
    if not isinstance(request, dict) or not request.get("basis"):
        return []
    with trials.open(newline="", encoding="utf-8") as f:
        n = sum(1 for r in csv.DictReader(f) if r.get("mode") == "predict" and r.get("state") == "COMPLETE")
    if not n:
        return []
    world, dtype = int(request.get("world_size", 0)), str(request.get("dtype", "bfloat16"))
    return [Unmeasured(str(trials), str(request["basis"]), world, n, dtype, what="trial(s)")]


def machine_of(source: str) -> str | None:
    """The device key the measured rows or trials of ``source`` were measured on: a table's
    fingerprint, a report's (the ``summary.yaml`` beside its ``trials.csv``); None where the file
    does not say (a CSV without a summary)."""
    from fo_kernels.files import read_yaml
    from fo_tune.tables.kinds import load_any_table

    path = Path(source)
    if path.suffix in (".yaml", ".yml"):
        return load_any_table(path).fingerprint.device_key
    summary = path.parent / "summary.yaml"
    if not summary.is_file():
        return None
    data = read_yaml(summary, error=CheckError, missing=CheckError, missing_hint="no search report summary")
    fingerprint = data.get("fingerprint") if isinstance(data, dict) else None
    key = fingerprint.get("device_key") if isinstance(fingerprint, dict) else None
    return key if isinstance(key, str) else None


def check_machines(items: Sequence[Measured], device_key: str, calibration: Path) -> None:
    """Raise ``CheckError`` where a file of ``items`` was measured on another machine than the
    calibration's (``device_key``): its model prices that machine only, so the errors would compare
    two machines, not the model with a measurement."""
    for source in dict.fromkeys(m.source for m in items):
        theirs = machine_of(source)
        if theirs is not None and theirs != device_key:
            raise CheckError(
                f"{source} was measured on {theirs}, and the calibration {calibration} is {device_key}'s: "
                f"its model does not price {theirs}; pass --calibration of {theirs} (`fo-tune "
                "calibrate` on that machine writes one), or check that machine's files apart"
            )


def check_files(paths: Iterable[Path], model: CostModel) -> list[Checked]:
    """``measured_in(paths)``, each predicted by ``model``."""
    return [m.checked(model) for m in measured_in(paths)]
