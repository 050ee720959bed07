"""``fo-tune table lookup`` and ``fo-tune table list``: the row the runtime would use for one call
(library: ``fo_tune.tables.find.find_row``; for an MoE call, ``--experts`` and ``--tokens``,
``find_moe_row``), and the table files in the runtime's search path, dense and MoE (a file that
does not read, or that lookup refuses where it sits, is a line of its own; the others are listed).

A lookup on a machine whose device key has no table (a CPU-only machine planning a GPU
deployment) names the device keys that have tables and the ``-k`` that picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from fo_tune.cli.common import (
    COLLECTIVE_NAMES,
    DTYPE_NAMES,
    SHARDED_COLLECTIVE_NAMES,
    console,
    err_console,
    json_text,
    summary_table,
)
from fo_tune.cli.errors import EXIT_FAILED, handle_errors, one_line
from fo_tune.cli.search_moe import MOE_COLLECTIVE
from fo_tune.cli.table_options import (
    DEFAULT_COLLECTIVE,
    DEFAULT_DTYPE,
    DEFAULT_WORLD_SIZE,
    CollectiveOpt,
    DeviceKeyOpt,
    TableDtypeOpt,
    check_choice,
    check_device_key,
    gc_paused,
    world_of,
)
from fo_tune.cli.table_rows import kind_label

if TYPE_CHECKING:
    from fo_kernels.fingerprint import Fingerprint

LOOKUP_HELP = "\n\n".join(
    [
        "Print the row the runtime (fo_kernels.lookup_schedule) would use for one call, as YAML "
        "(--json: as JSON): device_key, source (the table file it comes from), kind (measured or "
        "predicted) and the row with its provenance.",
        "The runtime reads every table for the device key, collective, world size and dtype in its "
        "search path ($FO_TUNE_TABLE_DIR, the user folder, the packaged tables) and takes a "
        "measured exact-shape row, else a measured M-range row covering M, else a predicted "
        "exact-shape row, else a predicted M-range row; between rows of the same kind the folder "
        "order decides. Without a matching row it runs overlap: false (GEMM then the collective); "
        "lookup then prints that with source: no table row and the files it read.",
        "--device-key (-k) defaults to this machine's key for --world-size. A table belongs to the "
        "machine it was tuned for: on a machine without that GPU (a CPU-only one planning an H200 "
        "deployment) pass its key, e.g. -k nvidia-h200-cc90-132sm-w2-nvlink18; the world size then "
        "defaults to the key's (its -w<N>-), and a --world-size the key contradicts is exit 2. When "
        "the key (this machine's or -k's) has no table, the answer names the keys that have one "
        "(hint, other_device_keys). `fo-tune table list` lists them all.",
        "An MoE call (expert_parallel_ffn with schedule=None): --experts H,I,E_LOCAL,K and --tokens "
        "T, the most tokens any rank of the call holds (the runtime looks its row up by that, so "
        "every rank takes the same row), with --world-size, --dtype and -k as above. The runtime "
        "reads moe-w<world>-<dtype>.yaml in every folder and takes the measured row whose bucket "
        "holds T, else the predicted one, the folder order deciding between rows of one kind; "
        "without one it runs the no-overlap path (dispatch, grouped GEMMs, combine), which lookup "
        "prints with source: no table row and the files it read.",
        "Exit code 0 when printed (a row or overlap: false), 2 for bad options, a malformed table or "
        "one the runtime refuses (another call's header under this call's name, another GPU's "
        "fingerprint in this device key's folder): the message names the file and what to do.",
    ]
)

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
        help="World size of the call. Default: the one in --device-key's key (its -w<N>-), else "
        f"{DEFAULT_WORLD_SIZE}.",
        show_default=False,
    ),
]
ExpertsOpt = Annotated[
    str | None,
    typer.Option(
        "--experts",
        metavar="H,I,E_LOCAL,K",
        help="An MoE call's experts' shape: hidden, intermediate, local experts per rank, top_k "
        "(with --tokens; instead of --shape).",
        show_default=False,
    ),
]
TokensOpt = Annotated[
    str | None,
    typer.Option(
        "--tokens",
        "-t",
        metavar="T",
        help="An MoE call's tokens per rank: one integer >= 0, the most any rank of the call holds "
        "(with --experts).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML.")]
ListJsonOpt = Annotated[bool, typer.Option("--json", help="Print the list as JSON.")]
ListDeviceKeyOpt = Annotated[
    str | None,
    typer.Option("--device-key", "-k", help="Only this device key's tables.", show_default=False),
]


def _miss_hint(device_key: str, read: list[Path], given: bool) -> dict[str, Any]:
    """What a miss adds when ``device_key`` (this machine's, or the one -k ``given``) has no table
    for the call: where the key holds tables of other collectives or dtypes, their names; where it
    holds none, the keys that have one, those of ``device_key``'s world size first, and how to pick
    one (its -w too where no key of the call's world size has one). Empty when a table of the call
    was read (the miss is its rows') or no key has a table."""
    from fo_kernels.fingerprint import read_device_key
    from fo_tune.tables.find import held_tables, known_device_keys

    def world(key: str) -> int | None:
        fields = read_device_key(key)
        return None if fields is None else int(fields["world_size"])

    if read:
        return {}
    known = known_device_keys()
    whose = "the device key" if given else "this machine's device key"
    if device_key in known:
        return {
            "hint": f"no table of this call for {whose} {device_key}; it holds "
            f"{', '.join(held_tables(device_key))}: pick the collective and dtype with -c and -d"
        }
    mine = world(device_key)
    others = sorted((key for key in known if key != device_key), key=lambda key: world(key) != mine)
    if not others:
        return {}
    example = others[0]  # (one of the call's world size where one has tables)
    theirs = world(example)
    pick = f"-k {example}" if theirs == mine or theirs is None else f"-k {example} -w {theirs}"
    none_here = "" if theirs == mine else f" (none of world size {mine})"
    return {
        "hint": f"no table for {whose} {device_key}; tables exist for "
        f"{', '.join(others)}{none_here}: pick one with -k KEY (--device-key), e.g. {pick}",
        "other_device_keys": others,
    }


@handle_errors
@gc_paused
def lookup(
    shape: ShapeOpt = None,
    collective: CollectiveOpt = None,
    world_size: LookupWorldSizeOpt = None,
    dtype: TableDtypeOpt = None,
    device_key: DeviceKeyOpt = None,
    json_out: JsonOpt = False,
    experts: ExpertsOpt = None,
    tokens: TokensOpt = None,
) -> None:
    """``fo-tune table lookup`` (its help: ``LOOKUP_HELP``)."""
    from fo_tune.cli.common import parse_shape

    if world_size is not None and world_size < 1:
        raise typer.BadParameter(f"--world-size must be >= 1, got {world_size}")
    if experts is not None or tokens is not None or collective == MOE_COLLECTIVE:
        # (the collective first: -c all_reduce -s MxNxK --tokens T is a dense call with a stray option)
        if collective not in (None, MOE_COLLECTIVE):
            given = [o for o, v in (("--experts", experts), ("--tokens", tokens)) if v is not None]
            verb = "looks" if len(given) == 1 else "look"
            raise typer.BadParameter(
                f"{' and '.join(given)} {verb} an MoE call up (-c moe), not -c {collective}; a dense call "
                "is --shape MxNxK alone"
            )
        if shape is not None:
            raise typer.BadParameter("--shape is a dense call's; an MoE call is --experts and --tokens")
        out = _moe_lookup(experts, tokens, world_size, dtype, device_key)
        _print_answer(out, json_out)
        return
    if shape is None:
        raise typer.BadParameter("--shape MxNxK: the call to look up is missing")
    m, n, k = parse_shape(shape)
    collective = check_choice(
        "--collective", DEFAULT_COLLECTIVE if collective is None else collective, COLLECTIVE_NAMES
    )
    dtype = check_choice("--dtype", DEFAULT_DTYPE if dtype is None else dtype, DTYPE_NAMES)
    from fo_tune.ranks.limits import Target, check_problem_size

    # a size above int32 or an fp8 N, K the ops refuse: no call of that shape runs, so no row answers
    check_problem_size([(m, n, k)], dtype, Target(None, "the call"))
    world = world_of(world_size, device_key)
    if collective in SHARDED_COLLECTIVE_NAMES and m % world:
        gathered = " (all_gather's M is the gathered M)" if collective == "all_gather" else ""
        raise typer.BadParameter(
            f"--shape {shape}: {collective} needs M divisible by the world size {world}{gathered}"
        )
    from fo_kernels.table import MISS_SOURCE
    from fo_tune.tables.find import find_row

    given = device_key is not None
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
        out.update(_miss_hint(device_key, read, given))
    else:
        data = row.to_dict()
        for key in ("collective", "dtype", "world_size"):
            data.pop(key)
        out.update(source=str(path), kind=kind_label(row), row=data)
    _print_answer(out, json_out)


def _print_answer(out: dict[str, Any], json_out: bool) -> None:
    import yaml

    if json_out:
        typer.echo(json_text(out))
    else:
        typer.echo(yaml.safe_dump(out, sort_keys=False, width=110), nl=False)


def _parse_call_tokens(text: str) -> int:
    """``--tokens T`` of one MoE call: an integer >= 0, else ``typer.BadParameter`` saying what to
    give (a list, what ``fo-tune search -c moe --tokens`` takes, names the search's option)."""
    try:
        tokens = int(text.strip())
    except ValueError:
        raise typer.BadParameter(
            f"--tokens {text!r}: expected one integer >= 0, the most tokens any rank of the call holds "
            "(a lookup answers one call; `fo-tune search -c moe --tokens T,...` takes a list of buckets)"
        ) from None
    if tokens < 0:
        raise typer.BadParameter(f"--tokens must be >= 0, got {tokens}")
    return tokens


def _moe_lookup(
    experts: str | None, text: str | None, world_size: int | None, dtype: str | None, device_key: str | None
) -> dict[str, Any]:
    """The answer of an MoE lookup: the row ``expert_parallel_ffn`` takes for the call (with its
    file and kind), or the no-overlap path and the files read."""
    if experts is None or text is None:
        missing = "--experts H,I,E_LOCAL,K" if experts is None else "--tokens T"
        raise typer.BadParameter(f"{missing}: an MoE lookup needs the experts' shape and the tokens per rank")
    tokens = _parse_call_tokens(text)
    from fo_tune.moe.plan import ExpertsShape, check_moe_dtype, check_moe_size
    from fo_tune.ranks.limits import Target

    shape = ExpertsShape.parse(experts)
    key = (shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    dtype = check_choice("--dtype", DEFAULT_DTYPE if dtype is None else dtype, DTYPE_NAMES)
    check_moe_dtype(dtype)
    check_moe_size([shape], [tokens], dtype, Target(None, "the call"))  # (int32 sizes, as the search's)
    world = world_of(world_size, device_key)
    named = "--world-size" if world_size is not None else "-k's world size" if device_key else ""
    shape.check_world(world, named or "the default --world-size")
    from fo_kernels.table import MISS_SOURCE
    from fo_tune.tables.find import find_moe_row

    given = device_key is not None
    if device_key is None:
        from fo_kernels.fingerprint import current_fingerprint

        device_key = current_fingerprint(None, world).device_key
    row, path, read = find_moe_row(device_key, world, dtype, key, tokens)
    out: dict[str, Any] = {"device_key": device_key}
    if row is None:
        problem = dict(zip(("hidden", "intermediate", "experts", "top_k"), key, strict=True))
        out.update(
            source=f"{MISS_SOURCE}: the runtime runs the no-overlap path (dispatch, grouped GEMMs, combine)",
            searched=[str(p) for p in read],
            row={"problem": {**problem, "tokens": tokens}, "engine": None},
        )
        out.update(_miss_hint(device_key, read, given))
        return out
    out.update(source=str(path), kind=row.kind, row=row.to_dict())
    return out


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
