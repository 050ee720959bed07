"""``fo-tune table diff``: compare two schedule tables row by row (library: ``fo_tune.tables.diff``
for dense tables, ``fo_tune.tables.moe_diff`` for MoE ones), its help, options and the terminal
view of the comparison, capped at ``SHOW_ROWS`` rows as ``show``'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from fo_tune.cli.common import console, fmt, summary_table
from fo_tune.cli.errors import handle_errors
from fo_tune.cli.table_moe import moe_changes_cell
from fo_tune.cli.table_options import AllRowsOpt, gc_paused, limit_option, row_cap
from fo_tune.cli.table_rows import (
    SHOW_ROWS,
    copy_engine_label,
    left_out_line,
    print_plain,
    tile_label,
    value_label,
)

if TYPE_CHECKING:
    from fo_tune.tables.diff import RowDiff
    from fo_tune.tables.moe_diff import MoeRowDiff

# Exit code of `diff --exit-code` when the tables differ (as `git diff --exit-code`).
EXIT_DIFFERENT = 1
STATUS_LABELS = {"only_a": "only in A", "only_b": "only in B", "changed": "changed", "same": "same"}

DIFF_HELP = "\n\n".join(
    [
        "Compare two schedule tables row by row. Rows are matched by problem (exact M, or the same "
        "M range); each is only in A, only in B, changed (the fields that differ, A -> B: tile, "
        "sms_free, nccl_max_ctas, signal_tiles, groups, layout, wait_mode, overlap) or the same. "
        "Latencies from the rows' provenance (measured_ms, else predicted_ms) are shown side by "
        "side with their ratio B/A.",
        "Two MoE tables are compared the same way, rows matched by experts' shape and bucket of "
        "tokens per rank, fields engine (alone when it differs), tile, sms_free, nccl_max_ctas, "
        "wait_mode, chunks. An MoE table is never compared with a dense one (exit code 2).",
        "Header and fingerprint differences (e.g. library versions) are listed above the rows. "
        "Provenance alone (a re-measured time) does not make a row changed: the runtime would do "
        "the same.",
        "The rows that differ are listed (--same lists the same ones too). The terminal view prints "
        f"the first {SHOW_ROWS} of them (two fleet-scale tables would hold the terminal for minutes) "
        "and a line saying how many it leaves out: --limit N prints N, --all every row. The counts "
        "line and the exit code cover every row.",
        "Exit code 0 whether or not they differ; with --exit-code 1 when any row differs (as "
        "`git diff --exit-code`); 2 when a file is missing or malformed, or the tables are of two "
        "kinds.",
    ]
)

TableAArg = Annotated[Path, typer.Argument(metavar="A", help="The first table file.", show_default=False)]
TableBArg = Annotated[Path, typer.Argument(metavar="B", help="The second table file.", show_default=False)]
ExitCodeOpt = Annotated[
    bool, typer.Option("--exit-code", help="Exit with 1 when any row differs (0 when none does).")
]
SameRowsOpt = Annotated[
    bool, typer.Option("--same", help="List the rows that are the same too (default: only differences).")
]
DiffLimitOpt = limit_option("the comparison")


def _latency_cell(values: dict[str, float]) -> tuple[str, str | None]:
    """(cell, key): the preferred latency, marked ``pred`` when it is a prediction."""
    for key, value in values.items():
        return fmt(value, ".4g") + (" pred" if key == "predicted_ms" else ""), key
    return "-", None


def _changes_cell(d: RowDiff) -> str:
    from fo_tune.tables.diff import field_value

    if d.status == "only_a":
        row = d.a
    elif d.status == "only_b":
        row = d.b
    else:
        row = None
    if row is not None:
        if not row.overlap:
            return "no overlap"
        return copy_engine_label(row) if row.engine == "copy_engine" else tile_label(field_value(row, "tile"))
    assert d.a is not None and d.b is not None
    parts = [
        f"{name} {value_label(field_value(d.a, name))} -> {value_label(field_value(d.b, name))}"
        for name in d.fields
    ]
    if d.provenance_changed:
        parts.append("provenance: " + ", ".join(d.provenance_changed))
    return "; ".join(parts) or "-"


def _print_diff(
    diffs: Sequence[RowDiff] | Sequence[MoeRowDiff],
    same: bool,
    limit: int | None,
    changes: Callable[..., str] = _changes_cell,
) -> None:
    """The rows of ``diffs`` (the differing ones unless ``same``), the first ``limit`` of them
    (every one when None) with a line on the rows left out; ``changes`` makes the changes cell of
    a row's diff (dense or MoE)."""
    listed = [d for d in diffs if same or d.differs]
    out = summary_table("", ["problem", "status", "changes (A -> B)", "A ms", "B ms", "B/A"], 3)
    for d in listed[:limit]:
        a_cell, a_key = _latency_cell(d.latency_a)
        b_cell, b_key = _latency_cell(d.latency_b)
        ratio = "-"
        if a_key is not None and a_key == b_key and d.latency_a[a_key] > 0:
            ratio = fmt(d.latency_b[b_key] / d.latency_a[a_key], ".3g")
        cells = [d.problem.describe(), STATUS_LABELS[d.status], changes(d), a_cell, b_cell, ratio]
        out.add_row(*(escape(cell) for cell in cells))
    if out.row_count:
        console.print(out)
    left_out = left_out_line(out.row_count, len(listed), scripts=False)
    if left_out is not None:
        print_plain(left_out)


@handle_errors
@gc_paused
def diff(
    a: TableAArg,
    b: TableBArg,
    exit_code: ExitCodeOpt = False,
    same: SameRowsOpt = False,
    limit: DiffLimitOpt = None,
    all_rows: AllRowsOpt = False,
) -> None:
    """``fo-tune table diff`` (its help: ``DIFF_HELP``)."""
    from fo_kernels.errors import TableError
    from fo_kernels.moe.table import MoeTable
    from fo_tune.tables.diff import DIFF_STATUSES, diff_tables, header_differences
    from fo_tune.tables.kinds import load_any_tables
    from fo_tune.tables.moe_diff import diff_moe_tables, moe_header_differences

    rows = row_cap(limit, all_rows)
    table_a, table_b = load_any_tables([a, b])
    moe_a, moe_b = isinstance(table_a, MoeTable), isinstance(table_b, MoeTable)
    if moe_a != moe_b:
        moe_path, dense_path = (a, b) if moe_a else (b, a)
        raise TableError(
            f"{moe_path} is an MoE table and {dense_path} a dense one; diff compares two tables of one kind"
        )
    print_plain(f"A: {a} ({table_a.fingerprint.device_key}, {len(table_a.rows)} row(s))")
    print_plain(f"B: {b} ({table_b.fingerprint.device_key}, {len(table_b.rows)} row(s))")
    if moe_a:
        headers = moe_header_differences(table_a, table_b)
        diffs: Sequence[RowDiff] | Sequence[MoeRowDiff] = diff_moe_tables(table_a, table_b)
    else:
        headers = header_differences(table_a, table_b)
        diffs = diff_tables(table_a, table_b)
    for name, value_a, value_b in headers:
        print_plain(f"header {name}: {value_label(value_a)} -> {value_label(value_b)}")
    _print_diff(diffs, same, rows, moe_changes_cell if moe_a else _changes_cell)
    counts = {status: sum(d.status == status for d in diffs) for status in DIFF_STATUSES}
    differing = len(diffs) - counts["same"]
    if differing:
        unlisted = " (--same lists them)" if counts["same"] and not same else ""
        print_plain(
            f"{counts['changed']} changed, {counts['only_a']} only in A, {counts['only_b']} only in B, "
            f"{counts['same']} same{unlisted}"
        )
    else:
        print_plain(f"no differences in {len(diffs)} row(s)")
    if exit_code and differing:
        raise typer.Exit(EXIT_DIFFERENT)
