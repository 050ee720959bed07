"""``fo-tune search -c moe``: plan the MoE table (the expert-parallel FFN's dispatch and combine
All-to-All around its grouped GEMMs) from a calibration, offline.

Library: ``fo_tune.engines.moe_cost_model`` (the model), ``fo_tune.moe.space`` (the space),
``fo_tune.moe.plan`` (the rows and the table). Only ``--mode predict`` plans: a measured MoE
search would time the engines on two or more GPUs (``bench/moe_ep.py`` times them by hand).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from fo_tune.cli.common import console, fmt, json_text, summary_table
from fo_tune.cli.errors import finishing

if TYPE_CHECKING:
    from fo_tune.moe.plan import MoePlan

# The collective name `fo-tune search -c` takes for the MoE FFN.
MOE_COLLECTIVE = "moe"
MOE_REPORT_KIND = "fo-tune-moe-search-summary"  # the kind of an MoE search's summary.yaml
# GPUs a measured MoE search needs: the dispatch and the combine move rows between ranks.
MIN_MEASURE_GPUS = 2


def run_moe_search(
    *,
    experts: list[str] | None,
    suite: Path | None,
    tokens: str | None,
    world_size: int,
    dtype: str,
    mode: str | None,
    calibration: Path | None,
    space: Path | None,
    engine: list[str] | None,
    table_dir: Path | None,
    out: Path | None,
    json_out: bool,
) -> None:
    """Check the options, plan the rows, merge them into the MoE table, print the summary."""
    import torch

    from fo_tune.cli.common import parse_names
    from fo_tune.engines import moe_engine_names
    from fo_tune.moe.plan import (
        ExpertsShape,
        MoeSearchError,
        check_moe_dtype,
        experts_from_suite,
        parse_tokens,
    )

    if not experts and suite is None:
        raise MoeSearchError(
            "-c moe needs the experts' shape: --experts H,I,E_local,k (repeatable) or --shapes "
            "suites/moe/experts.yaml"
        )
    if world_size == 1:  # (-w 0 and below are refused with the dense search's message)
        raise MoeSearchError(
            "-c moe --world-size 1 has no All-to-All to overlap: every call runs its grouped GEMMs "
            "alone (the no-overlap path), with no table row to plan; plan the expert-parallel size "
            "you deploy (--world-size 2-8 offline)"
        )
    shapes = [ExpertsShape.parse(text) for text in experts or []]
    if suite is not None:
        shapes += experts_from_suite(suite, world_size)
    shapes = list(dict.fromkeys(shapes))  # (an experts' shape given twice is planned once, as a --shape)
    for shape in shapes:
        shape.check_world(world_size)
    wanted = parse_tokens(tokens) if tokens is not None else None  # "" is refused, not the default
    check_moe_dtype(dtype)
    names = parse_names(engine, valid=moe_engine_names(), option="--engine") or moe_engine_names()
    mode = mode or "predict"
    if mode != "predict":
        # not built on any machine: the message says so everywhere, with the GPUs it would need
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise MoeSearchError(
            f"-c moe --mode {mode}: a measured MoE search is not built (it would need >= "
            f"{MIN_MEASURE_GPUS} GPUs; this machine has {gpus}); plan with --mode predict, and time the "
            f"engines on {MIN_MEASURE_GPUS}+ GPUs with `python bench/moe_ep.py --out DIR`"
        )
    from fo_tune.calibrate.find import choose_calibration

    # the packaged TP=2 calibration, or --calibration FILE; extrapolated to a larger world size
    # (fo_tune.calibrate.extrapolate: its basis joins every row's)
    cal, _ = choose_calibration(calibration, "predict", world_size, "gloo", torch.device("cpu"), dtype)
    if cal.world_size != world_size:
        raise MoeSearchError(
            f"{calibration} is for world size {cal.world_size}, not --world-size {world_size}"
        )
    from fo_kernels.errors import TableNotFoundError
    from fo_kernels.moe.table import load_moe_table, moe_table_path
    from fo_tune.output import check_writable_file
    from fo_tune.search.report import check_report_dir, new_run, report_name, report_root
    from fo_tune.search.setup import default_table_dir

    root = table_dir or (out / "tables" if out is not None else default_table_dir())
    reports = out / "report" if out is not None else report_root() / cal.fingerprint.device_key
    name = report_name(MOE_COLLECTIVE, world_size, dtype, mode)
    report = reports / name / new_run(reports, [name])
    # before the plan: an unwritable report or table, or a table that does not read, is one line
    check_report_dir(report)
    target = moe_table_path(root, cal.fingerprint.device_key, world_size, dtype)
    check_writable_file(target, what="table file")
    with contextlib.suppress(TableNotFoundError):
        load_moe_table(target)

    from fo_tune.moe.plan import plan_moe_search, write_moe_rows

    with contextlib.ExitStack() as bars:  # (on stderr, once the input is checked: a bad one is one line)
        plan, model = plan_moe_search(
            cal,
            shapes,
            wanted,
            dtype=dtype,
            engines=names,
            space_file=space,
            reporter=_BarsOnFirstStage(bars),
        )
    # a Ctrl-C is held until both are written: a table without its report, and no word of either
    with finishing(f"kept the plan: its rows in the table under {root}, its report in {report}"):
        path = write_moe_rows(
            root, cal.fingerprint, [p.row for p in plan.rows], world_size=world_size, dtype=dtype
        )
        rows = [
            {**p.row.to_dict(), "prediction": p.prediction.to_dict(), "fallback_ms": p.fallback.total_ms}
            for p in plan.rows
        ]
        summary = {
            "kind": MOE_REPORT_KIND,
            "table": str(path),
            "report": str(report),
            "basis": model.basis,
            "skipped": plan.skipped,
            "rows": rows,
        }
        _write_summary(summary, report)
    if json_out:
        typer.echo(json_text(summary))
        return
    _print(plan, model.basis, path, cal.fingerprint.device_key, world_size, dtype)
    console.print(f"[green]report[/] {escape(str(report))}", highlight=False)


class _BarsOnFirstStage:
    """A ``Reporter`` whose progress bars (stderr) start with its first stage, entered on
    ``stack``: the plan's checks come before it, so a bad input stays one line on stderr."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._bars: Any = None

    def stage(self, name: str, total: int) -> None:
        if self._bars is None:
            from fo_tune.cli.progress import ProgressReporter, progress_bars

            self._bars = ProgressReporter(self._stack.enter_context(progress_bars()), "search (predict)")
        self._bars.stage(name, total)

    def step(self, name: str, detail: str = "", *, log: bool = True) -> None:
        self._bars.step(name, detail, log=log)


def _write_summary(summary: dict, report: Path) -> None:
    """The run's ``summary.yaml`` (what --json prints) in its own report folder, written whole."""
    import yaml

    from fo_tune.output import replacing_folder

    with replacing_folder(report) as tmp, (tmp / "summary.yaml").open("w", encoding="utf-8") as f:
        yaml.safe_dump(summary, f, sort_keys=False, width=110)


def _print(plan: MoePlan, basis: str, path: Path, device_key: str, world_size: int, dtype: str) -> None:
    table = summary_table(
        f"moe {dtype} w{world_size}, predict, {device_key}",
        ["experts (H, I, E_local, k)", "tokens", "engine", "settings", "predicted ms", "no overlap ms", "x"],
        4,
    )
    for p in plan.rows:
        s = p.row.schedule
        pr = s.problem
        settings = ""
        if s.engine == "triton":
            settings = f"{s.tile.label()} r{s.sms_free} c{s.nccl_max_ctas}"
        elif s.engine == "copy_engine":
            settings = f"chunks {s.chunks}"
        table.add_row(
            f"{pr.hidden}, {pr.intermediate}, {pr.experts}, {pr.top_k}",
            f"{pr.tokens_min}..{pr.tokens_max}",
            s.engine or "none (overlap: false)",
            settings,
            fmt(p.prediction.total_ms),
            fmt(p.fallback.total_ms),
            f"{p.speedup:.2f}",
        )
    console.print(table)
    for name, why in plan.skipped.items():
        console.print(f"engine {name} not searched: {why}", highlight=False, markup=False)
    console.print(f"basis: {basis}", highlight=False, markup=False)
    console.print(f"[green]table[/] {escape(str(path))}", highlight=False)
