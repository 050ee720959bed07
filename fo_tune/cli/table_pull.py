"""``fo-tune table pull``: the tables of every study in a shared storage, written into a table
folder (library: ``fo_tune.tables.pull.pull_tables``; the storage: ``fo_tune.search.storage``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from fo_tune.cli.common import console, json_text, nonempty_path
from fo_tune.cli.errors import handle_errors

PULL_HELP = "\n\n".join(
    [
        "Write the tables of every study in a study storage: what a fleet of `fo-tune search` "
        "workers sharing one --storage decided. Each worker records every row it decides in its "
        "study (measured, predicted, M ranges; every mode); where several workers share a study, "
        "pull takes the rows decided from the most trials (among equals, the latest). It reads "
        "every study before it writes anything, groups the rows by "
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
        "$FO_TUNE_TABLE_DIR, else $XDG_DATA_HOME/fo-tune/tables (by default "
        "~/.local/share/fo-tune/tables), where the runtime finds them.",
        "Prints one line per table written (--json: JSON, with the number of studies read). Exit "
        "code 0 when written, or when no study records rows yet (the line says whether the storage "
        "holds no study at all: a storage the workers have not used). Exit code 2, with one line "
        "and no table written, when --table-dir or a table file under it cannot be written (a "
        "file in its place, a read-only folder), the storage cannot be opened (a missing driver, "
        "a server that does not answer, no such file) or fails "
        "during the read (pull again once it answers), a record is malformed, or a table file is "
        "malformed, for other hardware or holds another table's rows.",
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
        parser=nonempty_path,
        metavar="DIR",
        help="Root of the tables to write. Default: $FO_TUNE_TABLE_DIR, else "
        "$XDG_DATA_HOME/fo-tune/tables (by default ~/.local/share/fo-tune/tables).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")]


@handle_errors
def pull(storage: StorageArg = None, table_dir: PullTableDirOpt = None, json_out: JsonOpt = False) -> None:
    """``fo-tune table pull`` (its help: ``PULL_HELP``)."""
    if not storage:
        from fo_tune.search.storage import default_storage_file

        raise typer.BadParameter(
            "--storage URL: missing; pass the study storage the workers share, e.g. "
            f"--storage sqlite:///{default_storage_file()} (a search's default) "
            "or --storage postgresql://user@host/db"
        )
    from fo_tune.search.setup import default_table_dir
    from fo_tune.search.storage import check_storage_url, close_storage, open_storage, shown
    from fo_tune.tables.pull import check_table_dir, read_pull, write_pulled

    root = table_dir or default_table_dir()
    check_storage_url(storage)  # (its form: no file touched, no server asked)
    check_table_dir(root)
    opened = open_storage(storage, must_exist=True)
    try:
        read = read_pull(opened, storage)  # every study read before any table is written
    finally:
        close_storage(opened)
    pulled = write_pulled(read.records, root)
    if json_out:
        tables = [{**dataclasses.asdict(p), "path": str(p.path)} for p in pulled]
        data = {
            "kind": "fo-tune-table-pull",
            "storage": shown(storage),
            "studies": read.studies,
            "tables": tables,
        }
        typer.echo(json_text(data))
        return
    if not pulled:
        held = (
            f"holds {read.studies} stud{'y' if read.studies == 1 else 'ies'}, none records table rows yet "
            "(workers record each row as they decide it)"
            if read.studies
            else "holds no study: check that it is the --storage the workers use"
        )
        console.print(f"{shown(storage)} {held}; nothing written", markup=False, highlight=False)
        return
    for p in pulled:
        kept = f"; kept {p.kept_measured} measured row(s) over predicted ones" if p.kept_measured else ""
        console.print(
            f"table {p.path}: {p.pulled} row(s) from {p.studies} stud{'y' if p.studies == 1 else 'ies'}, "
            f"{p.rows} row(s) in the table{kept}",
            markup=False,
            highlight=False,
        )
