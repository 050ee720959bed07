"""``fo-tune table``: show, validate and compare schedule tables (library: ``fo_tune.tables.merge``).

Table files are read with ``fo_kernels.table.load_table``; the runtime and the tuner are imported only
inside the commands, so ``fo-tune --help`` stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from fo_tune.cli.common import (
    COLLECTIVE_NAMES,
    DTYPE_NAMES,
    EXIT_BAD_INPUT,
    SHARDED_COLLECTIVE_NAMES,
    console,
    err_console,
    fmt,
    handle_errors,
    one_line,
    summary_table,
)
from fo_tune.cli.table_rows import (
    copy_engine_label,
    csv_rows,
    kind_label,
    print_plain,
    show_rich,
    table_yaml,
    tile_label,
    value_label,
)

if TYPE_CHECKING:
    from fo_kernels.table import ScheduleTable
    from fo_tune.tables.diff import RowDiff

FORMATS = ("table", "yaml", "csv")
# Defaults of `show` without a PATH: the setup docs/perf-notes.md measured (bf16, TP=2).
DEFAULT_COLLECTIVE = "all_reduce"
DEFAULT_WORLD_SIZE = 2
DEFAULT_DTYPE = "bfloat16"
# Exit code of `diff --exit-code` when the tables differ (as `git diff --exit-code`).
EXIT_DIFFERENT = 1
STATUS_LABELS = {"only_a": "only in A", "only_b": "only in B", "changed": "changed", "same": "same"}

HELP = "\n\n".join(
    [
        "Show, validate and compare schedule tables: the YAML files `fo-tune search` writes and the "
        "runtime (fo_kernels.lookup_schedule) reads.",
        "A table holds the schedules of one (device key, collective, world size, dtype); it lives at "
        "<folder>/<device-key>/<collective>-w<world>-<dtype>.yaml, and the runtime searches the "
        "folders $FO_TUNE_TABLE_DIR, $XDG_DATA_HOME/fo-tune/tables (default "
        "~/.local/share/fo-tune/tables) and the packaged results/tables, in this order.",
        "Commands: show (print a table), lookup (the row the runtime would use for one call, and its "
        "file), validate (check files beyond their format: every row must give a plan for its shapes) "
        "and diff (compare two tables row by row).",
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
        "library versions).",
        "Give a PATH to a table file, or leave it out to show the table(s) the runtime would read "
        "for --device-key (default: this machine's key for --world-size), --collective, --world-size "
        "and --dtype: every file found in the search path, in the order lookup reads them (an "
        "exact-shape row in any of them beats an M-range row).",
        "Tile form: BMxBNxBK gmGROUP_M wWARPS sSTAGES (ws: warp specialized). cap: NCCL CTA cap "
        "(default: NCCL's). signal: tiles per signal unit. groups: sizes in signal units (relative "
        "weights on an M-range row). A copy-engine row (engine: copy_engine) shows 'copy engine' "
        "and its mode as its tile (with the tiled mode's tile) and the relative row weights of its "
        "chunks as groups.",
        "--format yaml prints the table(s) as YAML, --format csv one CSV line per row (with a file "
        "column), for scripts.",
        "Exit code 0 when shown, 2 when no table is found or a file is malformed.",
    ]
)

LOOKUP_HELP = "\n\n".join(
    [
        "Print the row the runtime (fo_kernels.lookup_schedule) would use for one call, as YAML: "
        "source (the table file it comes from), kind (measured or predicted) and the row with its "
        "provenance.",
        "The runtime reads every table for the device key, collective, world size and dtype in its "
        "search path ($FO_TUNE_TABLE_DIR, the user folder, the packaged tables) and takes a "
        "measured exact-shape row, else a measured M-range row covering M, else a predicted "
        "exact-shape row, else a predicted M-range row; between rows of the same kind the folder "
        "order decides. Without a matching row it runs overlap: false (GEMM then the collective); "
        "lookup then prints that with source: no table row and the files it read.",
        "--device-key defaults to this machine's key for --world-size.",
        "Exit code 0 when printed (a row or overlap: false), 2 for bad options or a malformed table.",
    ]
)

VALIDATE_HELP = "\n\n".join(
    [
        "Check schedule table files: their format, then that every row gives the runtime a plan "
        "for the shapes it covers.",
        "Format: schema version, header, fingerprint, every row's fields (what loading checks).",
        "Plans: every overlapped exact-shape row must give a plan for its shape (groups summing to "
        "the signal units of the shape, row_band groups starting on whole bands of group_m tile "
        "rows, sms_free leaving a grid of the fingerprint's SM count); every overlapped M-range row "
        "must give a plan at m_min, m_max and a middle M (multiples of the world size for "
        "reduce_scatter and all_gather); M ranges for the same N, K must not overlap.",
        "Prints OK per good file on stdout and one line per problem on stderr. A note says when a "
        "file is not where lookup looks for it (<device-key>/<collective>-w<world>-<dtype>.yaml).",
        "Exit code 0 when every file is fine, 2 when any has a problem (fix the row named, or "
        "re-tune it with `fo-tune search`).",
    ]
)

DIFF_HELP = "\n\n".join(
    [
        "Compare two schedule tables row by row. Rows are matched by problem (exact M, or the same "
        "M range); each is only in A, only in B, changed (the fields that differ, A -> B: tile, "
        "sms_free, nccl_max_ctas, signal_tiles, groups, layout, wait_mode, overlap) or the same. "
        "Latencies from the rows' provenance (measured_ms, else predicted_ms) are shown side by "
        "side with their ratio B/A.",
        "Header and fingerprint differences (e.g. library versions) are listed above the rows. "
        "Provenance alone (a re-measured time) does not make a row changed: the runtime would do "
        "the same.",
        "Exit code 0 whether or not they differ; with --exit-code 1 when any row differs (as "
        "`git diff --exit-code`); 2 when a file is missing or malformed.",
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
DeviceKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--device-key",
        "-k",
        help="Device key of the table folder, e.g. nvidia-h200-cc90-132sm-w2-nvlink18. "
        "Default: this machine's for --world-size.",
        show_default=False,
    ),
]
CollectiveOpt = Annotated[
    str | None,
    typer.Option(
        "--collective",
        "-c",
        help=f"Collective of the table: {', '.join(COLLECTIVE_NAMES)}. Default: {DEFAULT_COLLECTIVE}.",
        show_default=False,
    ),
]
TableWorldSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        "-w",
        min=1,
        help=f"World size (ranks) of the table. Default: {DEFAULT_WORLD_SIZE}.",
        show_default=False,
    ),
]
TableDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        "-d",
        help=f"Operand dtype of the table: {', '.join(DTYPE_NAMES)}. Default: {DEFAULT_DTYPE}.",
        show_default=False,
    ),
]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help=f"Output format: {', '.join(FORMATS)}.")]
PathsArg = Annotated[
    list[Path],
    typer.Argument(metavar="PATH...", help="Table files to check.", show_default=False),
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
TableAArg = Annotated[Path, typer.Argument(metavar="A", help="The first table file.", show_default=False)]
TableBArg = Annotated[Path, typer.Argument(metavar="B", help="The second table file.", show_default=False)]
ExitCodeOpt = Annotated[
    bool, typer.Option("--exit-code", help="Exit with 1 when any row differs (0 when none does).")
]
AllRowsOpt = Annotated[
    bool, typer.Option("--all", "-a", help="List the rows that are the same too (default: only differences).")
]


# ------------------------------------------------------------------------------ show
def _check_choice(option: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise typer.BadParameter(f"{option} {value!r}: expected one of {', '.join(choices)}")
    return value


def _find(device_key: str | None, collective: str, world_size: int, dtype: str) -> list[Path]:
    from fo_kernels.errors import TableNotFoundError
    from fo_kernels.table import table_filename, table_search_path
    from fo_tune.tables.find import find_tables, known_device_keys

    if device_key is None:
        from fo_kernels.fingerprint import current_fingerprint

        device_key = current_fingerprint(None, world_size).device_key
    paths = find_tables(device_key, collective, world_size, dtype)
    if paths:
        return paths
    keys = known_device_keys()
    known = f"tables exist for device keys {', '.join(keys)}" if keys else "no table folder exists"
    folders = ", ".join(map(str, table_search_path()))
    raise TableNotFoundError(
        f"no table {device_key}/{table_filename(collective, world_size, dtype)} in {folders} ({known}); "
        "write one with `fo-tune search`, pass --device-key, or give a PATH"
    )


@handle_errors
def show(
    path: PathArg = None,
    device_key: DeviceKeyOpt = None,
    collective: CollectiveOpt = None,
    world_size: TableWorldSizeOpt = None,
    dtype: TableDtypeOpt = None,
    format_: FormatOpt = "table",
) -> None:
    _check_choice("--format", format_, FORMATS)
    header = {"--device-key": device_key, "--collective": collective, "--world-size": world_size}
    header["--dtype"] = dtype
    given = [name for name, value in header.items() if value is not None]
    if path is not None and given:
        raise typer.BadParameter(
            f"{', '.join(given)}: give a PATH or the header options that find a table, not both"
        )
    from fo_kernels.table import load_table

    if path is not None:
        paths = [path]
    else:
        collective = _check_choice("--collective", collective or DEFAULT_COLLECTIVE, COLLECTIVE_NAMES)
        dtype = _check_choice("--dtype", dtype or DEFAULT_DTYPE, DTYPE_NAMES)
        paths = _find(device_key, collective, world_size or DEFAULT_WORLD_SIZE, dtype)
    found = [(p, load_table(p)) for p in paths]
    if format_ == "csv":
        typer.echo(csv_rows(found), nl=False)
        return
    for i, (p, table) in enumerate(found):
        if format_ == "yaml":
            typer.echo(("---\n" if i else "") + f"# {p}\n" + table_yaml(table), nl=False)
            continue
        if i:
            console.print()
        show_rich(p, table)


# ------------------------------------------------------------------------------ lookup
ShapeOpt = Annotated[
    str | None,
    typer.Option(
        "--shape",
        "-s",
        metavar="MxNxK",
        help="The call's GEMM: M x N x K per rank (all_gather: M is the gathered M, w x a shard's rows).",
        show_default=False,
    ),
]
LookupWorldSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        "-w",
        help=f"World size of the call. Default: {DEFAULT_WORLD_SIZE}.",
        show_default=False,
    ),
]


@handle_errors
def lookup(
    shape: ShapeOpt = None,
    collective: CollectiveOpt = None,
    world_size: LookupWorldSizeOpt = None,
    dtype: TableDtypeOpt = None,
    device_key: DeviceKeyOpt = None,
) -> None:
    import yaml

    from fo_tune.cli.common import parse_shape

    if shape is None:
        raise typer.BadParameter("--shape MxNxK: the call to look up is missing")
    if world_size is not None and world_size < 1:
        raise typer.BadParameter(f"--world-size must be >= 1, got {world_size}")
    m, n, k = parse_shape(shape)
    collective = _check_choice("--collective", collective or DEFAULT_COLLECTIVE, COLLECTIVE_NAMES)
    dtype = _check_choice("--dtype", dtype or DEFAULT_DTYPE, DTYPE_NAMES)
    world = world_size or DEFAULT_WORLD_SIZE
    if collective in SHARDED_COLLECTIVE_NAMES and m % world:
        gathered = " (all_gather's M is the gathered M)" if collective == "all_gather" else ""
        raise typer.BadParameter(
            f"--shape {shape}: {collective} needs M divisible by the world size {world}{gathered}"
        )
    from fo_kernels.table import MISS_SOURCE
    from fo_tune.tables.find import find_row

    if device_key is None:
        from fo_kernels.fingerprint import current_fingerprint

        device_key = current_fingerprint(None, world).device_key
    row, path, read = find_row(device_key, collective, world, dtype, m, n, k)
    out: dict[str, Any] = {"device_key": device_key}
    if row is None:
        out.update(
            source=f"{MISS_SOURCE}: the runtime runs overlap: false (GEMM then the collective)",
            searched=[str(p) for p in read],
            row={"problem": {"m": m, "n": n, "k": k}, "overlap": False},
        )
    else:
        data = row.to_dict()
        for key in ("collective", "dtype", "world_size"):
            data.pop(key)
        out.update(source=str(path), kind=kind_label(row), row=data)
    typer.echo(yaml.safe_dump(out, sort_keys=False, width=110), nl=False)


# ------------------------------------------------------------------------------ validate
def _location_note(path: Path, table: ScheduleTable) -> str | None:
    from fo_kernels.table import table_filename

    expected = Path(table.fingerprint.device_key) / table_filename(
        table.collective, table.world_size, table.dtype
    )
    if (path.parent.name, path.name) == expected.parts:
        return None
    return f"{path}: lookup reads this table only as <table folder>/{expected}"


@handle_errors
def validate(paths: PathsArg, sm_count: SmCountOpt = None) -> None:
    from fo_kernels.errors import TableError, TableNotFoundError
    from fo_kernels.table import load_table
    from fo_tune.tables.validate import validate_table

    problems: list[str] = []
    bad_files = 0
    for path in paths:
        try:
            table = load_table(path)
        except (TableError, TableNotFoundError) as exc:
            problems.append(one_line(exc))
            bad_files += 1
            continue
        issues = validate_table(table, sm_count=sm_count)
        problems.extend(f"{path}: {issue}" for issue in issues)
        bad_files += bool(issues)
        if not issues:
            print_plain(
                f"OK {path}: {len(table.rows)} row(s), {table.collective} {table.dtype} world size "
                f"{table.world_size}, {table.fingerprint.device_key}"
            )
        note = _location_note(path, table)
        if note is not None:
            print_plain(f"note: {note}")
    for problem in problems:
        err_console.print(f"error: {problem}", markup=False)
    if problems:
        print_plain(
            f"{len(problems)} problem(s) in {bad_files} of {len(paths)} file(s); fix the rows named, "
            "or re-tune them with `fo-tune search`"
        )
        raise typer.Exit(EXIT_BAD_INPUT)


# ------------------------------------------------------------------------------ diff
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


def _print_diff(diffs: Sequence[RowDiff], show_all: bool) -> None:
    out = summary_table("", ["problem", "status", "changes (A -> B)", "A ms", "B ms", "B/A"], 3)
    for d in diffs:
        if not show_all and not d.differs:
            continue
        a_cell, a_key = _latency_cell(d.latency_a)
        b_cell, b_key = _latency_cell(d.latency_b)
        ratio = "-"
        if a_key is not None and a_key == b_key and d.latency_a[a_key] > 0:
            ratio = fmt(d.latency_b[b_key] / d.latency_a[a_key], ".3g")
        cells = [d.problem.describe(), STATUS_LABELS[d.status], _changes_cell(d), a_cell, b_cell, ratio]
        out.add_row(*(escape(cell) for cell in cells))
    if out.row_count:
        console.print(out)


@handle_errors
def diff(a: TableAArg, b: TableBArg, exit_code: ExitCodeOpt = False, all_: AllRowsOpt = False) -> None:
    from fo_kernels.table import load_table
    from fo_tune.tables.diff import DIFF_STATUSES, diff_tables, header_differences

    table_a, table_b = load_table(a), load_table(b)
    print_plain(f"A: {a} ({table_a.fingerprint.device_key}, {len(table_a.rows)} row(s))")
    print_plain(f"B: {b} ({table_b.fingerprint.device_key}, {len(table_b.rows)} row(s))")
    for name, value_a, value_b in header_differences(table_a, table_b):
        print_plain(f"header {name}: {value_label(value_a)} -> {value_label(value_b)}")
    diffs = diff_tables(table_a, table_b)
    _print_diff(diffs, all_)
    counts = {status: sum(d.status == status for d in diffs) for status in DIFF_STATUSES}
    differing = len(diffs) - counts["same"]
    if differing:
        print_plain(
            f"{counts['changed']} changed, {counts['only_a']} only in A, {counts['only_b']} only in B, "
            f"{counts['same']} same"
        )
    else:
        print_plain(f"no differences in {len(diffs)} row(s)")
    if exit_code and differing:
        raise typer.Exit(EXIT_DIFFERENT)


def register(app: typer.Typer) -> None:
    """Add the ``table`` command group (show, lookup, validate, diff) to the root app."""
    sub = typer.Typer(name="table", help=HELP, no_args_is_help=True, add_completion=False)
    sub.command("show", help=SHOW_HELP, short_help="Print a table, its rows and its fingerprint.")(show)
    sub.command("lookup", help=LOOKUP_HELP, short_help="The row the runtime would use for one call.")(lookup)
    sub.command("validate", help=VALIDATE_HELP, short_help="Check table files: format and plans.")(validate)
    sub.command("diff", help=DIFF_HELP, short_help="Compare two tables row by row.")(diff)
    app.add_typer(sub, name="table")
