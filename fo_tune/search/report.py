"""The report of one ``fo-tune search``: every trial, the summary and the plots, in one folder per
run: ``<root>/<collective>-w<W>-<dtype>-<mode>[-mrange]/<run id>`` (``report_name``, ``new_run``), the
root ``<fo-tune data folder>/search/<device key>`` (or ``--out DIR/report``), the run id the UTC
time, host and process (``run_id``), so no run's report replaces another's, concurrent runs'
included.

Files (written to a temporary sibling folder, then renamed into place, so a report folder is
complete or absent):

- ``trials.csv``: one row per trial (or priced point) of every shape's search (resumed ones
  included): identity (shape, number, state), the engine, the parameters (JSON), the schedule (in
  words, and its settings as JSON: ``fo-tune model check`` rebuilds it from them), predicted and
  measured latency, spread, relative error, speedup vs the baseline, cache hits and notes;
- ``summary.yaml``: the request (with the calibration's ``basis`` where it is an extrapolation), the
  fingerprint, per shape the engines searched, the baseline,
  the best schedule, the row written (``overlap: false`` with the reason when nothing beats the
  fallback), the model's error (MAPE, worst case) over measured trials, trials and measurements
  spent and wall time; the measured rows a predicted one did not replace; for a search a Ctrl-C
  stopped, after which shape (``stopped``) and the shapes it did not search (``not_done``);
- ``history.png``: best-so-far latency per trial per shape, the baseline dashed, and
  ``predicted_vs_measured.png``: every measured trial's prediction against its measurement
  (measured searches only: a predict search has nothing to plot against, and skipping matplotlib
  keeps an offline plan within its seconds).
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import json
import math
import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fo_tune.calibrate.extrapolate import basis_for
from fo_tune.output import OutputError, check_ancestor, data_dir, replacing_folder
from fo_tune.search import SearchResult, ShapeResult, TrialRecord

REPORT_FILES = ("trials.csv", "summary.yaml", "history.png", "predicted_vs_measured.png")
# summary.yaml's top-level kind (``fo-tune model check`` tells it from a table by it).
REPORT_KIND = "fo-tune-search-report"
PLOTS = ("history.png", "predicted_vs_measured.png")
# Characters a host name keeps in a run id (the rest become "-").
_HOST_DROP = re.compile(r"[^A-Za-z0-9.]+")
TRIAL_COLUMNS = (
    "device_key",
    "collective",
    "world_size",
    "dtype",
    "shape",
    "mode",
    "number",
    "state",
    "engine",
    "params",
    "schedule",
    "settings",
    "predicted_ms",
    "measured_ms",
    "spread_ms",
    "rel_err",
    "value_ms",
    "sequential_ms",
    "speedup",
    "cached_from",
    "note",
)


def report_root() -> Path:
    """Where reports go without ``--out``: ``<fo-tune data folder>/search`` (``fo_tune.output.data_dir``)."""
    return data_dir() / "search"


def report_name(collective: str, world_size: int, dtype: str, mode: str, *, m_range: bool = False) -> str:
    """``<collective>-w<W>-<dtype>-<mode>``, with ``-mrange`` after it for an ``--m-range`` search."""
    return f"{collective}-w{world_size}-{dtype}-{mode}" + ("-mrange" if m_range else "")


def run_id(now: dt.datetime | None = None) -> str:
    """One run's folder name: ``<UTC time>-<host>-<pid>``, e.g. ``20261130T130039Z-node7-4121``."""
    when = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    host = _HOST_DROP.sub("-", socket.gethostname()).strip("-") or "host"
    return f"{when}-{host}-{os.getpid()}"


def new_run(root: Path, names: Sequence[str]) -> str:
    """A run folder name (``run_id``) that no report of ``names`` under ``root`` has yet: a
    second run of this process within the same second gets ``-2``, ``-3``, ... after it."""
    run = run_id()
    for suffix in itertools.count(2):
        if not any((root / name / run).exists() for name in names):
            return run
        run = f"{run_id()}-{suffix}"
    raise AssertionError("unreachable")  # itertools.count never ends


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else format(value, ".6g")
    return "" if value is None else value


def _trial_row(result: SearchResult, shape: ShapeResult, t: TrialRecord) -> list[Any]:
    r = result.request
    return [
        result.fingerprint.device_key,
        r.collective,
        r.world_size,
        r.dtype,
        t.shape,
        shape.mode,
        t.number,
        t.state,
        t.engine,
        json.dumps(t.params, sort_keys=True, default=str),
        t.schedule,
        t.settings,
        t.predicted_ms,
        t.measured_ms,
        t.spread_ms,
        t.rel_err,
        t.value_ms,
        shape.baseline.sequential_ms,
        t.speedup,
        t.cached_from,
        t.note,
    ]


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 6)


def summary(result: SearchResult) -> dict[str, Any]:
    """The YAML summary as plain data."""
    r = result.request
    shapes = []
    for s in result.shapes:
        states: dict[str, int] = {}
        for t in s.trials:
            states[t.state] = states.get(t.state, 0) + 1
        shapes.append(
            {
                "shape": "x".join(map(str, s.shape)),
                "study": s.study,
                "engines": list(s.engines),
                "baseline": {
                    "source": s.baseline.source,
                    "gemm_ms": _finite(s.baseline.gemm_ms),
                    "collective_ms": _finite(s.baseline.comm_ms),
                    "sequential_ms": _finite(s.baseline.sequential_ms),
                    "spread_ms": _finite(s.baseline.spread_ms),
                    "iqr_ms": _finite(s.baseline.iqr_ms),
                    "predicted_sequential_ms": _finite(s.baseline.predicted_ms),
                    "predicted_fallback_ms": _finite(s.baseline.fallback_ms),
                },
                "best_trial": s.best_trial,
                "best_ms": _finite(s.best_ms),
                "best_schedule": s.best_schedule.to_dict() if s.best_schedule is not None else None,
                "overlap": s.row.overlap,
                "speedup": _finite(s.speedup),
                "decision": s.decision,
                "confirmed": [
                    {k: _finite(v) if isinstance(v, float) else v for k, v in c.items()} for c in s.confirmed
                ],
                "row": s.row.to_dict(),
                "model_error": {"mape": _finite(s.mape), "worst": _finite(s.worst_ape)},
                "trials": len(s.trials),
                "trial_states": states,
                "measured_this_run": s.measured,
                "wall_s": round(s.wall_s, 2),
            }
        )
    # the calibration the model priced these shapes with (none where it priced nothing)
    cal = r.pricing_calibration(result.fingerprint.device_key)
    return {
        "kind": REPORT_KIND,
        "fingerprint": result.fingerprint.to_dict(),
        "request": {
            "collective": r.collective,
            "world_size": r.world_size,
            "dtype": r.dtype,
            "mode": r.mode,
            "trials": r.trials_asked(),
            "top_k": r.top_k if r.mode == "hybrid" else None,
            "exhaustive": r.exhaustive,
            "engines": list(r.engines) if r.engines is not None else None,
            "m_range": list(r.m_range) if r.m_range else None,
            "storage": result.storage,
            "calibration": cal.fingerprint.device_key if cal else None,
            "calibration_created": cal.created if cal else None,
            "basis": (basis_for(cal.basis, r.collective) or None) if cal else None,
        },
        "table": str(result.table) if result.table else None,
        "range_rows": [row.to_dict() for row in result.range_rows],
        "kept_measured_rows": [row.to_dict() for row in result.kept],
        "shapes": shapes,
        # a search a Ctrl-C stopped: after how many shapes, and the shapes it left unsearched
        "stopped": stopped(result),
        "not_done": ["x".join(map(str, shape)) for shape in result.not_done],
        "wall_s": round(result.wall_s, 2),
    }


def stopped(result: SearchResult) -> str | None:
    """``after 1 of 3 shapes: interrupted`` for a search a Ctrl-C stopped, else None."""
    if not result.not_done:
        return None
    done = len(result.shapes)
    return f"after {done} of {done + len(result.not_done)} shapes: interrupted"


def _plot_history(result: SearchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    for i, s in enumerate(result.shapes):
        color = f"C{i % 10}"
        xs, best, ys = [], math.inf, []
        for t in sorted(s.trials, key=lambda t: t.number):
            if t.state == "COMPLETE" and t.value_ms > 0:
                best = min(best, t.value_ms)
            if best < math.inf:
                xs.append(t.number)
                ys.append(best)
        label = "x".join(map(str, s.shape))
        if xs:
            ax.step(xs, ys, where="post", color=color, label=label)
        ax.axhline(s.baseline.sequential_ms, color=color, linestyle="--", linewidth=0.8)
    ax.set_xlabel("trial")
    ax.set_ylabel("best latency so far (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{result.request.collective} search ({result.request.mode}); dashed: GEMM then collective")
    if result.shapes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_pred_vs_meas(result: SearchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5.0), dpi=110)
    lo, hi = math.inf, 0.0
    for i, s in enumerate(result.shapes):
        pts = [
            (t.predicted_ms, t.measured_ms)
            for t in s.trials
            if t.cached_from is None and t.measured_ms > 0 and not math.isnan(t.predicted_ms)
        ]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        label = f"{'x'.join(map(str, s.shape))} (MAPE {s.mape:.0%})"
        ax.scatter(xs, ys, s=12, color=f"C{i % 10}", label=label)
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
        ax.legend(fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no trial both predicted and measured", ha="center", va="center")
    ax.set_xlabel("predicted (ms)")
    ax.set_ylabel("measured (ms)")
    ax.set_title("cost model vs measurement")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def check_report_dir(out_dir: str | Path) -> None:
    """``OutputError`` unless the report folder can be created or replaced (only our files in it)."""
    shown = Path(out_dir)
    path = Path(os.path.abspath(out_dir))
    if path.exists():
        if not path.is_dir():
            raise OutputError(f"report folder {shown} is a file; choose another --out")
        foreign = sorted(p.name for p in path.iterdir() if p.name not in REPORT_FILES)
        if foreign:
            raise OutputError(
                f"report folder {shown} holds files fo-tune did not write ({foreign[0]}); "
                "choose another --out"
            )
        for folder in (path.parent, path):  # an existing report is swapped out by renames
            if not os.access(folder, os.W_OK | os.X_OK):
                raise OutputError(f"cannot replace the report {shown}: {folder} is not writable")
    check_ancestor(path, shown)


def write_report(result: SearchResult, out_dir: str | Path) -> list[Path]:
    """Write ``REPORT_FILES`` into ``out_dir`` as a whole (see the module docstring)."""
    check_report_dir(out_dir)
    with replacing_folder(out_dir) as tmp:
        with (tmp / "trials.csv").open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(TRIAL_COLUMNS)
            for s in result.shapes:
                for t in s.trials:
                    writer.writerow([_cell(v) for v in _trial_row(result, s, t)])
        with (tmp / "summary.yaml").open("w", encoding="utf-8") as f:
            yaml.safe_dump(summary(result), f, sort_keys=False, width=110)
        plots = result.request.mode != "predict"
        if plots:
            _plot_history(result, tmp / "history.png")
            _plot_pred_vs_meas(result, tmp / "predicted_vs_measured.png")
    names = REPORT_FILES if plots else tuple(n for n in REPORT_FILES if n not in PLOTS)
    return [Path(out_dir) / name for name in names]
