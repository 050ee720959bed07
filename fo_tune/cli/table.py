"""``fo-tune table``: the command group (list, show, lookup, validate, diff, pull) and the commands
that read one table file at a time: show, validate (library: ``fo_tune.tables``). ``lookup`` is
``fo_tune.cli.table_lookup``'s, ``list`` is ``fo_tune.cli.table_find``'s, ``diff`` is
``fo_tune.cli.table_diff``'s, ``pull`` is ``fo_tune.cli.table_pull``'s.

Each command takes dense tables (``fo_kernels.table``) and MoE tables (``fo_kernels.moe.table``):
a file is read as the kind its name or its ``kind`` says (``fo_tune.tables.kinds``) and handled
by that kind's checks, comparison and rows (``fo_tune.cli.table_moe`` shows the MoE ones). The
runtime and the tuner are imported only inside the commands, so ``fo-tune --help`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from fo_tune.cli.common import DTYPE_NAMES, console, err_console, json_text
from fo_tune.cli.errors import EXIT_BAD_INPUT, handle_errors, one_line
from fo_tune.cli.search_moe import MOE_COLLECTIVE
from fo_tune.cli.table_diff import DIFF_HELP, diff
from fo_tune.cli.table_find import LIST_HELP, list_tables
from fo_tune.cli.table_json import FileCheck, document_text, show_document, validate_document
from fo_tune.cli.table_lookup import LOOKUP_HELP, lookup
from fo_tune.cli.table_moe import moe_csv_rows, moe_table_yaml, show_moe_rich
from fo_tune.cli.table_options import (
    DEFAULT_COLLECTIVE,
    DEFAULT_DTYPE,
    TABLE_COLLECTIVES,
    AllRowsOpt,
    CollectiveOpt,
    DeviceKeyOpt,
    TableDtypeOpt,
    TableWorldSizeOpt,
    check_choice,
    find_paths,
    gc_paused,
    limit_option,
    row_cap,
    world_of,
)
from fo_tune.cli.table_pull import PULL_HELP, pull
from fo_tune.cli.table_rows import (
    SHOW_ROWS,
    csv_rows,
    print_plain,
    show_rich,
    table_yaml,
)

if TYPE_CHECKING:
    from fo_kernels.moe.table import MoeTable
    from fo_kernels.table import ScheduleTable

FORMATS = ("table", "yaml", "csv")

HELP = "\n\n".join(
    [
        "List, show, look up, validate, compare and pull schedule tables: the YAML files `fo-tune "
        "search` writes and the runtime (fo_kernels.lookup_schedule) reads.",
        "A table holds the schedules of one (device key, collective, world size, dtype); it lives at "
        "<folder>/<device-key>/<collective>-w<world>-<dtype>.yaml, and the runtime searches the "
        "folders $FO_TUNE_TABLE_DIR, $XDG_DATA_HOME/fo-tune/tables (default "
        "~/.local/share/fo-tune/tables) and the packaged results/tables, in this order. The MoE "
        "table (`fo-tune search -c moe`: the expert-parallel FFN's rows per experts' shape and "
        "bucket of tokens per rank) lives beside them at <folder>/<device-key>/moe-w<world>-<dtype>.yaml; "
        "every command below takes it too.",
        "Commands: list (the table files the runtime finds, per device key), show (print a table), "
        "lookup (the row the runtime would use for one call, and its file; -k picks the device key "
        "on a machine without that GPU; --experts and --tokens for an MoE call), validate (check "
        "files beyond their format: rows unique "
        "per problem, every row must give a plan for its shapes), diff (compare two tables row by "
        "row) and pull (write the tables of every study in a storage a fleet of workers shares).",
        "The runtime prefers a measured row over a predicted one (provenance mode: predict, written by "
        "an offline search) in any folder; between rows of the same kind the folder order decides.",
    ]
)

SHOW_HELP = "\n\n".join(
    [
        "Print a schedule table: one line per row with its problem, whether it was measured or "
        "predicted (a predicted row, from an offline search, is used only where no measured row "
        "matches), overlap, engine and its settings (Triton: tile, SMs left free, NCCL CTA cap, "
        "signal granularity, groups, layout, wait mode; copy engine: mode, tile, chunk weights), "
        "and the provenance the tuner recorded (measured_ms, predicted_ms, speedup, mode, source, "
        "...), under a header with the fingerprint the table was measured on (device key, GPU, "
        "library versions); then what predicted rows rest on (their basis, e.g. extrapolated from "
        "world size 2), once per basis.",
        "Give a PATH to a table file, or leave it out to show the table(s) the runtime would read "
        "for --device-key (default: this machine's key for --world-size), --collective, --world-size "
        "and --dtype: every file found in the search path, in the order lookup reads them (an "
        "exact-shape row in any of them beats an M-range row).",
        "Tile form: BMxBNxBK gmGROUP_M wWARPS sSTAGES (ws: warp specialized). cap: NCCL CTA cap "
        "(default: NCCL's). signal: tiles per signal unit. groups: sizes in signal units (relative "
        "weights on an M-range row). A copy-engine row (engine: copy_engine) shows 'copy engine' "
        "and its mode as its tile (with the tiled mode's tile) and the relative row weights of its "
        "chunks as groups.",
        "An MoE table (moe-w<world>-<dtype>.yaml; -c moe finds it by the header options) is shown "
        "per row with its experts' shape (H, I, E_local, k), bucket of tokens per rank, measured or "
        "predicted, engine and its settings (triton: tile, SMs left free, NCCL CTA cap, wait mode; "
        "copy_engine: chunks) and provenance (predicted_ms, fallback_ms: the no-overlap path's, ...); "
        "the calibration and basis of its predictions follow the table, once each.",
        f"The terminal view prints the first {SHOW_ROWS} rows of each table (a fleet-scale table "
        "would hold the terminal for minutes) and a line saying how many it leaves out: --limit N "
        "prints N, --all every row.",
        "--format yaml prints the table(s) as YAML, --format csv one CSV line per row (with a file "
        "column), --json one JSON document (per table its file, header, bases and rows), for "
        "scripts: each with every row.",
        "Exit code 0 when shown, 2 when no table is found or a file is malformed.",
    ]
)

VALIDATE_HELP = "\n\n".join(
    [
        "Check schedule table files: their format, then that every row gives the runtime a plan "
        "for the shapes it covers.",
        "Format: schema version, header, fingerprint, every row's fields (what loading checks; a "
        "NaN or infinite number in a row's provenance is refused).",
        "Plans: every overlapped exact-shape row must give a plan for its shape (groups summing to "
        "the signal units of the shape, row_band groups starting on whole bands of group_m tile "
        "rows, sms_free leaving a grid of the fingerprint's SM count); every overlapped M-range row "
        "must give a plan at m_min, m_max and a middle M (multiples of the world size for "
        "reduce_scatter and all_gather); M ranges for the same N, K must not overlap. A row no "
        "call ever takes is refused: N, K or its smallest M above 2147483647 (the GEMMs take "
        "int32 sizes), an fp8 row's N or K not a multiple of 16.",
        "An MoE table (moe-w<world>-<dtype>.yaml, or a file whose kind says so): its format (what "
        "loading checks: every field, the tile, chunks, token buckets of one experts' shape not "
        "overlapping), every row's k at most its E = world size x E_local experts (a token picks k "
        "distinct experts) and every number of its provenance finite, then every overlapped row: a "
        "triton row's sms_free must leave its grouped GEMMs a grid of the fingerprint's SM count, "
        "and the row's engine must run on the fingerprint's machine (the copy engine needs peer "
        "access between the GPUs).",
        "Prints OK per good file on stdout and one line per problem on stderr. A note says when a "
        "file is not where lookup looks for it (<device-key>/<collective>-w<world>-<dtype>.yaml, "
        "<device-key>/moe-w<world>-<dtype>.yaml); a file lookup reads and refuses (under another "
        "call's name or the other kind of table's, or in the device key folder of another compute "
        "capability or world size) is a problem whose line says where to move it. A table's lock "
        "file (<table>.yaml.lock, empty, which a search's merge leaves beside the table: a glob "
        "TABLES/*/* names it) is skipped with a note. --json prints one JSON "
        "document instead (ok; per file ok, rows, problems and note).",
        "Exit code 0 when every file is fine, 2 when any has a problem (fix the row named, or "
        "re-tune it with `fo-tune search`; move or rename the file named).",
    ]
)

# ------------------------------------------------------------------------------ options
PathArg = Annotated[
    Path | None,
    typer.Argument(
        metavar="PATH",
        help="Table file to show. Leave out to find the table by --device-key, --collective, "
        "--world-size and --dtype in the search path.",
        show_default=False,
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        "-f",
        help=f"Output format: {', '.join(FORMATS)} (table: the terminal view, the first {SHOW_ROWS} "
        "rows of each table unless --limit or --all).",
    ),
]
LimitOpt = limit_option("each table")
PathsArg = Annotated[
    list[Path],
    typer.Argument(metavar="PATH", help="Table files to check.", show_default=False),
]
SmCountOpt = Annotated[
    int | None,
    typer.Option(
        "--sm-count",
        min=1,
        help="SM count the plans are made for. Default: each table fingerprint's sm_count.",
        show_default=False,
    ),
]
ShowJsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON document instead: per table its file, header, fingerprint, the bases of "
        "its predicted rows and its rows (each with its kind, measured or predicted).",
    ),
]
ValidateJsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON document instead: ok, and per file ok, its row count and its problems "
        "(exit code as without it; with problems, one line on stderr says so).",
    ),
]


# ------------------------------------------------------------------------------ show
@handle_errors
@gc_paused
def show(
    path: PathArg = None,
    device_key: DeviceKeyOpt = None,
    collective: CollectiveOpt = None,
    world_size: TableWorldSizeOpt = None,
    dtype: TableDtypeOpt = None,
    format_: FormatOpt = "table",
    json_out: ShowJsonOpt = False,
    limit: LimitOpt = None,
    all_rows: AllRowsOpt = False,
) -> None:
    """``fo-tune table show`` (its help: ``SHOW_HELP``)."""
    check_choice("--format", format_, FORMATS)
    if json_out and format_ != FORMATS[0]:
        raise typer.BadParameter(f"--json and --format {format_}: give one of them")
    rows = row_cap(limit, all_rows)
    if (limit is not None or all_rows) and (json_out or format_ != FORMATS[0]):
        script = "--json" if json_out else f"--format {format_}"
        cap = "--all" if all_rows else "--limit"
        raise typer.BadParameter(f"{cap} is for the terminal view; {script} prints every row")
    header = {"--device-key": device_key, "--collective": collective, "--world-size": world_size}
    header["--dtype"] = dtype
    given = [name for name, value in header.items() if value is not None]
    if path is not None and given:
        raise typer.BadParameter(
            f"{', '.join(given)}: give a PATH or the header options that find a table, not both"
        )
    from fo_kernels.moe.table import MoeTable
    from fo_tune.tables.kinds import load_any_table

    if path is not None:
        paths = [path]
    else:
        collective = check_choice(
            "--collective", DEFAULT_COLLECTIVE if collective is None else collective, TABLE_COLLECTIVES
        )
        dtype = check_choice("--dtype", DEFAULT_DTYPE if dtype is None else dtype, DTYPE_NAMES)
        if collective == MOE_COLLECTIVE:
            from fo_tune.moe.plan import check_moe_dtype

            check_moe_dtype(dtype)  # (an fp8 MoE table has no file name: the name's check said "dtype:")
        paths = find_paths(device_key, collective, world_of(world_size, device_key), dtype)
    found = [(p, load_any_table(p)) for p in paths]
    moe = [(p, t) for p, t in found if isinstance(t, MoeTable)]
    dense = [(p, t) for p, t in found if not isinstance(t, MoeTable)]
    if json_out:
        typer.echo(document_text(show_document(found)))
        return
    if format_ == "csv":  # (the files of one header are of one kind)
        typer.echo(moe_csv_rows(moe) if moe else csv_rows(dense), nl=False)
        return
    for i, (p, table) in enumerate(found):
        is_moe = isinstance(table, MoeTable)
        if format_ == "yaml":
            text = moe_table_yaml(table) if is_moe else table_yaml(table)
            typer.echo(("---\n" if i else "") + f"# {p}\n" + text, nl=False)
            continue
        if i:
            console.print()
        if is_moe:
            show_moe_rich(p, table, rows)
        else:
            show_rich(p, table, rows)


# ------------------------------------------------------------------------------ validate
def _location_note(path: Path, table: ScheduleTable | MoeTable) -> tuple[str | None, str | None]:
    """(note, problem) about where ``path`` sits (``fo_tune.tables.find.placement``): a problem
    where lookup reads the file and refuses it, a note where it never reads it or warns."""
    from fo_kernels.moe.table import MoeTable, moe_table_filename
    from fo_kernels.table import table_filename
    from fo_tune.tables.find import placement

    if isinstance(table, MoeTable):
        name = moe_table_filename(table.world_size, table.dtype)
    else:
        name = table_filename(table.collective, table.world_size, table.dtype)
    return placement(path, table.fingerprint, name)


@handle_errors
@gc_paused
def validate(paths: PathsArg, sm_count: SmCountOpt = None, json_out: ValidateJsonOpt = False) -> None:
    """``fo-tune table validate`` (its help: ``VALIDATE_HELP``)."""
    from fo_kernels.errors import TableError, TableNotFoundError
    from fo_kernels.moe.table import MoeTable
    from fo_tune.tables.kinds import load_any_table
    from fo_tune.tables.merge import is_lock_file
    from fo_tune.tables.moe_validate import validate_moe_table
    from fo_tune.tables.validate import validate_table

    checks: list[FileCheck] = []
    for path in paths:
        if is_lock_file(path):  # (not a table: skipped, with a note, whatever the others hold)
            note = f"{path}: a table's lock file (`fo-tune search` takes it while it merges rows); skipped"
            checks.append(FileCheck(path, None, [], note))
            if not json_out:
                print_plain(f"note: {note}")
            continue
        try:
            table = load_any_table(path)
        except (TableError, TableNotFoundError) as exc:
            checks.append(FileCheck(path, None, [one_line(exc)], missing=isinstance(exc, TableNotFoundError)))
            continue
        if isinstance(table, MoeTable):
            issues = validate_moe_table(table, sm_count=sm_count)
            what = MOE_COLLECTIVE
        else:
            issues = validate_table(table, sm_count=sm_count)
            what = table.collective
        note, misnamed = _location_note(path, table)
        issues = [*issues, misnamed] if misnamed is not None else issues
        problems = [f"{path}: {issue}" for issue in issues]
        checks.append(FileCheck(path, len(table.rows), problems, note, misplaced=misnamed is not None))
        if json_out:
            continue
        if not issues:
            print_plain(
                f"OK {path}: {len(table.rows)} row(s), {what} {table.dtype} world size "
                f"{table.world_size}, {table.fingerprint.device_key}"
            )
        if note is not None:
            print_plain(f"note: {note}")
    problems = [problem for check in checks for problem in check.problems]
    summary = _validate_summary(checks)
    if json_out:
        typer.echo(json_text(validate_document(checks)))
        if problems:  # the problems are in the document; stderr says only that there are some
            err_console.print(f"error: {summary} (listed in the JSON on stdout)", markup=False)
            raise typer.Exit(EXIT_BAD_INPUT)
        return
    for problem in problems:
        err_console.print(f"error: {problem}", markup=False)
    if problems:
        if len(checks) > 1 or checks[0].rows is not None:  # one unreadable file: its line says it all
            print_plain(summary)
        raise typer.Exit(EXIT_BAD_INPUT)


def _validate_summary(checks: list[FileCheck]) -> str:
    """``validate``'s last line: how many problems in how many files (the lock files it skipped
    not counted), and the remedy of each kind
    found (a missing file is named again; a file that does not load, malformed or with rows that
    overlap, is fixed or replaced; a file lookup refuses where it sits is
    moved or renamed; a bad row is fixed or re-tuned)."""
    bad = [check for check in checks if check.problems]
    count = sum(len(check.problems) for check in bad)
    tables = [check for check in checks if check.rows is not None or check.problems]  # (no lock file)
    remedies = []
    if any(check.missing for check in bad):
        remedies.append("name table files that exist")
    if any(check.rows is None and not check.missing for check in bad):
        remedies.append("fix or replace the files that do not load (each line says what to do)")
    if any(check.misplaced for check in bad):
        remedies.append("move or rename the files named (each line says where)")
    if any(len(check.problems) > check.misplaced for check in bad if check.rows is not None):
        remedies.append("fix the rows named, or re-tune them with `fo-tune search`")
    return f"{count} problem(s) in {len(bad)} of {len(tables)} file(s); {'; '.join(remedies)}"


def register(app: typer.Typer) -> None:
    """Add the ``table`` command group (list, show, lookup, validate, diff, pull) to the root app."""
    sub = typer.Typer(name="table", help=HELP, no_args_is_help=True, add_completion=False)
    sub.command("list", help=LIST_HELP, short_help="The table files the runtime finds.")(list_tables)
    sub.command("show", help=SHOW_HELP, short_help="Print a table, its rows and its fingerprint.")(show)
    sub.command("lookup", help=LOOKUP_HELP, short_help="The row the runtime would use for one call.")(lookup)
    sub.command("validate", help=VALIDATE_HELP, short_help="Check table files: format and plans.")(validate)
    sub.command("diff", help=DIFF_HELP, short_help="Compare two tables row by row.")(diff)
    sub.command("pull", help=PULL_HELP, short_help="Write the tables of a shared study storage.")(pull)
    app.add_typer(sub, name="table")
