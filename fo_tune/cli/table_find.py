"""``fo-tune table list``: the table files in the runtime's search path, dense and MoE (a file
that does not read, or that lookup refuses where it sits, is a line of its own; the others are
listed), and the folders a device key's tables sit in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from fo_tune.cli.common import (
    console,
    err_console,
    json_text,
    summary_table,
)
from fo_tune.cli.errors import EXIT_FAILED, handle_errors, one_line
from fo_tune.cli.search_moe import MOE_COLLECTIVE
from fo_tune.cli.table_options import (
    check_device_key,
    gc_paused,
)

if TYPE_CHECKING:
    from fo_kernels.fingerprint import Fingerprint

LIST_HELP = "\n\n".join(
    [
        "List the table files the runtime's search path holds ($FO_TUNE_TABLE_DIR, the user folder "
        "$XDG_DATA_HOME/fo-tune/tables (default ~/.local/share/fo-tune/tables), the packaged tables, "
        "in the order lookup reads them): per "
        "file its device key (its folder's name: the key lookup's -k and the runtime read it "
        "under), collective (moe for the MoE table, moe-w<world>-<dtype>.yaml), world "
        "size, dtype, rows and folder. --device-key keeps "
        "one device key's folder; --json prints them as JSON (tables, each with its "
        "fingerprint_device_key too: the machine it was tuned on, another GPU of the same die where "
        "a sibling's table was copied; problems: per bad file "
        "its path, folder and error; notes: per file left out, its path, folder and note).",
        "A file that does not read (not valid YAML, a bad header, a row's bad problem; a dense "
        "table's other row fields are read when lookup takes the row, and `fo-tune table validate "
        "PATH` checks them all), or that lookup refuses where it sits (another GPU's table in this "
        "device key's folder), is one line on stderr with its path, why "
        "and what to do, as is a table folder it cannot read (no permission, a link loop: lookup "
        "refuses every call whose table it looks for there); every other file is still listed. "
        "Lookup refuses every call of such a file's table until it is fixed or moved (`fo-tune "
        "table validate PATH` says more). A .yaml "
        "file that is no table under a name lookup never reads "
        "(notes beside the tables: not <collective>-w<world>-<dtype>.yaml or "
        "moe-w<world>-<dtype>.yaml) is left out with a note on stderr; lookup skips it too. Other "
        "files there are not read.",
        "Exit code 0 when every file is good or left out (also when there is no table), 1 when some "
        "file is not, 2 for bad options.",
    ]
)

ListJsonOpt = Annotated[bool, typer.Option("--json", help="Print the list as JSON.")]
ListDeviceKeyOpt = Annotated[
    str | None,
    typer.Option("--device-key", "-k", help="Only this device key's tables.", show_default=False),
]


def _file_entry(path: Path, root: Path) -> tuple[dict[str, Any], Fingerprint]:
    """The ``list`` entry of the table file at ``path`` (in the search path folder ``root``): its
    device key (its folder's name, which lookup's -k takes), header and row count, and its
    fingerprint; ``TableError`` when it does not read, or when it holds another call's rows under a
    name lookup reads (``check_file_name``)."""
    from fo_kernels.moe.table import load_moe_table, moe_table_filename
    from fo_kernels.table import read_table, table_filename
    from fo_tune.tables.find import check_file_name
    from fo_tune.tables.kinds import is_moe_name

    if is_moe_name(path):  # the MoE table (fo-tune search -c moe)
        moe = load_moe_table(path)
        fp, header = moe.fingerprint, (MOE_COLLECTIVE, moe.world_size, moe.dtype, len(moe.rows))
        name = moe_table_filename(moe.world_size, moe.dtype)
    else:
        table = read_table(path)
        fp, header = table.fingerprint, (table.collective, table.world_size, table.dtype, len(table))
        name = table_filename(table.collective, table.world_size, table.dtype)
    check_file_name(path, name)  # (another call's header under this call's name: lookup refuses it)
    names = ("collective", "world_size", "dtype", "rows")
    entry = {"device_key": path.parent.name, **dict(zip(names, header, strict=True))}
    entry = {**entry, "folder": str(root), "path": str(path), "fingerprint_device_key": fp.device_key}
    return entry, fp


@dataclass(frozen=True, slots=True)
class Listing:
    """What ``table list`` finds: per file that reads its path, folder, header and row count
    (``files``); per file that does not read, or that lookup refuses where it sits (another GPU's
    table in a device key's folder), its path, folder and why, in one line (``problems``); per file
    that is no table under a name lookup never reads, its path, folder and a note (``notes``)."""

    files: list[dict[str, Any]] = field(default_factory=list)
    problems: list[dict[str, str]] = field(default_factory=list)
    notes: list[dict[str, str]] = field(default_factory=list)


def table_files(device_key: str | None = None) -> Listing:
    """Every table file in the runtime's search path (``device_key``'s folder only, when given), in
    the order lookup reads the folders (``Listing``). One bad file never hides the others: a
    fleet's folders gather files from many hosts."""
    from fo_kernels.errors import TableError, TableNotFoundError
    from fo_tune.tables.find import check_machine, lookup_reads, search_folders

    def problem(path: Path, root: Path, exc: TableError) -> dict[str, str]:
        reason = one_line(exc)
        reason = reason if str(path) in reason else f"{path}: {reason}"
        return {"path": str(path), "folder": str(root), "error": reason}

    found = Listing()
    files, problems = found.files, found.problems
    for root in search_folders():
        paths: list[Path] = []
        for folder in _device_folders(root, device_key):
            try:
                paths += sorted(p for p in folder.iterdir() if p.name.endswith(".yaml"))
            except FileNotFoundError:  # (removed since, or a link to nothing: lookup finds no table)
                continue
            except OSError as exc:  # (lookup of this device key refuses every call: it cannot look)
                problems.append(_unreadable_folder(folder, root, exc))
        for path in paths:
            try:
                entry, fp = _file_entry(path, root)
            except TableNotFoundError:  # removed since the folder was read
                continue
            except TableError as exc:
                if lookup_reads(path):
                    problems.append(problem(path, root, exc))
                else:  # (notes beside the tables, say: lookup never reads the file)
                    found.notes.append(_left_out(problem(path, root, exc)))
                continue
            files.append(entry)
            try:
                check_machine(path, fp, path.parent.name)
            except TableError as exc:
                problems.append(problem(path, root, exc))
    return found


def _device_folders(root: Path, device_key: str | None) -> list[Path]:
    """The folders of ``root`` (a search path folder) a listing reads, sorted: its subfolders and
    the links among its entries that point at no file, only ``device_key``'s when given; none when
    ``root`` is not there. A ``root`` that cannot be read is returned itself, so reading it names
    the error."""
    try:
        children = sorted(root.iterdir())
    except FileNotFoundError:
        return []
    except OSError:
        return [root]
    return [
        child
        for child in children
        if (device_key is None or child.name == device_key)
        and (child.is_dir() or (child.is_symlink() and not child.is_file()))
    ]


def _unreadable_folder(folder: Path, root: Path, exc: OSError) -> dict[str, str]:
    """The ``list`` problem of a table folder it cannot read (no permission, a symbolic link
    loop): lookup refuses every call whose table it would look for there."""
    why = exc.strerror or str(exc)
    return {
        "path": str(folder),
        "folder": str(root),
        "error": f"{folder}: cannot read the folder: {why}; lookup refuses every call whose table it "
        "looks for there until it can (fix its permissions or the link, or move it away)",
    }


def _left_out(problem: dict[str, str]) -> dict[str, str]:
    """The note of a file that is no table under a name lookup never reads (``problem``: why it
    does not read as a table)."""
    from fo_kernels.table.format import GIVE_A_TABLE

    why = problem["error"].removeprefix(f"{problem['path']}: ").removesuffix(f"; {GIVE_A_TABLE}")
    note = f"{problem['path']}: not listed, and lookup never reads it under this name ({why})"
    return {"path": problem["path"], "folder": problem["folder"], "note": note}


@handle_errors
@gc_paused
def list_tables(device_key: ListDeviceKeyOpt = None, json_out: ListJsonOpt = False) -> None:
    """``fo-tune table list`` (its help: ``LIST_HELP``)."""
    check_device_key(device_key)
    found = table_files(device_key)
    files, problems = found.files, found.problems
    if json_out:
        doc = {"kind": "fo-tune-table-list", "tables": files, "problems": problems, "notes": found.notes}
        typer.echo(json_text(doc))
    elif files or not problems:  # (with bad files only, their lines below say what is there)
        _print_list(files, device_key)
    for left in found.notes:  # one line each, after the list (stdout and stderr may share a terminal)
        err_console.print(f"note: {left['note']}", markup=False)
    for bad in problems:
        err_console.print(f"error: {bad['error']}", markup=False)
    if problems:
        raise typer.Exit(EXIT_FAILED)


def _print_list(files: list[dict[str, Any]], device_key: str | None) -> None:
    """The terminal view of ``list``: a line per table file, or where none is."""
    if not files:
        from fo_tune.tables.find import known_device_keys, search_folders

        folders = ", ".join(map(str, search_folders()))
        known = known_device_keys()
        if device_key is not None and known:  # the tables there are other keys'
            text = (
                f"no table for device key {device_key} in {folders}; tables exist for "
                f"{', '.join(known)}: list them without -k, or pick one with -k KEY"
            )
        else:
            text = f"no table in {folders}; write one with `fo-tune search`"
        console.print(text, markup=False, highlight=False)
        return
    out = summary_table(
        "", ["device key", "collective", "world", "dtype", "rows", "folder"], 2, text=["dtype", "folder"]
    )
    for f in files:
        cells = [
            f["device_key"],
            f["collective"],
            str(f["world_size"]),
            f["dtype"],
            str(f["rows"]),
            f["folder"],
        ]
        out.add_row(*(escape(cell) for cell in cells))
    console.print(out)
    console.print(
        "look a call up in one with `fo-tune table lookup -s MxNxK -c COLLECTIVE -k DEVICE_KEY`",
        markup=False,
        highlight=False,
    )
    if any(f["collective"] == MOE_COLLECTIVE for f in files):
        console.print(
            "an MoE call with `fo-tune table lookup --experts H,I,E_LOCAL,K --tokens T -k DEVICE_KEY`",
            markup=False,
            highlight=False,
        )
