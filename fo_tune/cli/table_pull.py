"""``fo-tune table pull``: the tables of every study in a shared storage, written into a table
folder (library: ``fo_tune.tables.pull.pull_tables``; the storage: ``fo_tune.search.storage``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from fo_tune.cli.common import console, handle_errors, json_text

PULL_HELP = "\n\n".join(
    [
        "Write the tables of every study in a study storage: what a fleet of `fo-tune search` "
        "workers sharing one --storage decided. Each worker records every row it decides in its "
        "study (measured, predicted, M ranges; every mode); pull reads them all, groups them by "
        "table (device key, collective, world size, dtype) and merges each group, oldest first, "
        "into <table-dir>/<device-key>/<collective>-w<world>-<dtype>.yaml with the rules of every "
        "merge: a row replaces the row for its problem, an M range every range it overlaps, and a "
        "predicted row never replaces a measured one (from the storage or already in the file). "
        "Run it again at any time: it merges what was recorded since.",
        "The MoE table (moe-w<world>-<dtype>.yaml) is not in a storage: `fo-tune search -c moe` "
        "plans it offline and records no study (it refuses --storage), so pull neither writes nor "
        "touches it; copy the file to share it.",
        "--storage takes the URL the workers used: postgresql://USER@HOST:PORT/DB, sqlite:///FILE "
        "or journal:FILE (a SQLite or journal file must exist). --table-dir defaults to "
        "$FO_TUNE_TABLE_DIR, else ~/.local/share/fo-tune/tables, where the runtime finds them.",
        "Prints one line per table written (--json: JSON). Exit code 0 when written (or when no "
        "study records rows yet), 2 when the storage cannot be opened (a missing driver, a server "
        "that does not answer, no such file), a record is malformed or a table file is for other "
        "hardware.",
    ]
)

StorageArg = Annotated[
    str | None,
    typer.Option(
        "--storage",
        metavar="URL",
        help="The study storage the workers share (postgresql://..., sqlite:///FILE, journal:FILE).",
        show_default=False,
    ),
]
PullTableDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--table-dir",
        metavar="DIR",
        help="Root of the tables to write. Default: $FO_TUNE_TABLE_DIR, else ~/.local/share/fo-tune/tables.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")]


@handle_errors
def pull(storage: StorageArg = None, table_dir: PullTableDirOpt = None, json_out: JsonOpt = False) -> None:
    if not storage:
        raise typer.BadParameter("--storage URL: the storage the workers share is missing")
    from fo_tune.search.setup import default_table_dir
    from fo_tune.search.storage import close_storage, open_storage, shown
    from fo_tune.tables.pull import pull_tables

    root = table_dir or default_table_dir()
    opened = open_storage(storage, must_exist=True)
    try:
        pulled = pull_tables(opened, root)
    finally:
        close_storage(opened)
    if json_out:
        tables = [{**dataclasses.asdict(p), "path": str(p.path)} for p in pulled]
        typer.echo(json_text({"kind": "fo-tune-table-pull", "storage": shown(storage), "tables": tables}))
        return
    if not pulled:
        console.print(
            f"no study in {shown(storage)} records table rows yet (workers record each row as they "
            "decide it); nothing written",
            markup=False,
            highlight=False,
        )
        return
    for p in pulled:
        kept = f"; kept {p.kept_measured} measured row(s) over predicted ones" if p.kept_measured else ""
        console.print(
            f"table {p.path}: {p.pulled} row(s) from {p.studies} stud{'y' if p.studies == 1 else 'ies'}, "
            f"{p.rows} row(s) in the table{kept}",
            markup=False,
            highlight=False,
        )
