"""What the ``fo-tune table`` commands share: the header options that find a table (device key,
collective or ``moe``, world size, dtype) with their defaults, the choice check, the row cap of
the terminal views (``show``, ``diff``: --limit N or --all), finding the table files of a
header in the runtime's search path (an error names the device keys that have tables), and
``gc_paused``, which runs a command with the garbage collector off."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from fo_tune.cli.common import COLLECTIVE_NAMES, DTYPE_NAMES
from fo_tune.cli.search_moe import MOE_COLLECTIVE
from fo_tune.cli.table_rows import SHOW_ROWS

# Defaults of the header options: the setup docs/perf-notes.md measured (bf16, TP=2).
DEFAULT_COLLECTIVE = "all_reduce"
# What --collective names a table by: a dense table's collective, or ``moe`` for the MoE table
# (``moe-w<W>-<dtype>.yaml``; the name `fo-tune search -c` takes for it).
TABLE_COLLECTIVES = (*COLLECTIVE_NAMES, MOE_COLLECTIVE)
DEFAULT_WORLD_SIZE = 2
DEFAULT_DTYPE = "bfloat16"

T = TypeVar("T")


def gc_paused(fn: Callable[..., T]) -> Callable[..., T]:
    """A command run with the garbage collector paused (``fo_tune.tables.kinds.paused_gc``; keeps
    its signature): a fleet-scale table's rows, and what a command makes of each, are many
    objects and no cycles, and each batch of them made the collector walk them all again."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        from fo_tune.tables.kinds import paused_gc

        with paused_gc():
            return fn(*args, **kwargs)

    return wrapper


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
        help=f"Collective of the table: {', '.join(COLLECTIVE_NAMES)}, or {MOE_COLLECTIVE} for the MoE "
        f"table. Default: {DEFAULT_COLLECTIVE}.",
        show_default=False,
    ),
]
TableWorldSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        "-w",
        min=1,
        help="World size (ranks) of the table. Default: the one in --device-key's key (its -w<N>-), "
        f"else {DEFAULT_WORLD_SIZE}.",
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


def check_choice(option: str, value: str, choices: Sequence[str]) -> str:
    """``value`` when it is one of ``choices``, else ``typer.BadParameter`` naming ``option``."""
    if value not in choices:
        raise typer.BadParameter(f"{option} {value!r}: expected one of {', '.join(choices)}")
    return value


def limit_option(rows: str) -> Any:
    """The ``--limit N`` option of a terminal view that prints ``rows`` (see ``row_cap``)."""
    return Annotated[
        int | None,
        typer.Option(
            "--limit",
            "-n",
            min=1,
            metavar="N",
            help=f"The terminal view prints the first N rows of {rows}. Default: {SHOW_ROWS}.",
            show_default=False,
        ),
    ]


# The ``--all`` option of a terminal view (see ``row_cap``).
AllRowsOpt = Annotated[
    bool, typer.Option("--all", help="The terminal view prints every row (slow beyond a few thousand).")
]


def row_cap(limit: int | None, all_rows: bool) -> int | None:
    """The rows a terminal view prints: every one with --all (None), else --limit's N, else
    ``SHOW_ROWS``; both given is ``typer.BadParameter``."""
    if limit is not None and all_rows:
        raise typer.BadParameter("--limit N and --all: give one of them")
    return None if all_rows else limit or SHOW_ROWS


def check_device_key(device_key: str | None) -> None:
    """``typer.BadParameter`` for a -k that is empty or a path: a key names one folder under each
    table folder, and a path would read files outside them (or, to ``list``, match none)."""
    if device_key is not None and (
        not device_key or "/" in device_key or "\\" in device_key or device_key in (".", "..")
    ):
        raise typer.BadParameter(
            f"--device-key {device_key!r}: a device key is a folder name under the table folders (e.g. "
            "nvidia-h200-cc90-132sm-w2-nvlink18), not a path; `fo-tune table list` lists the keys"
        )


def world_of(world_size: int | None, device_key: str | None) -> int:
    """The world size of a table or call: --world-size, else the one a -k device key names (a
    key's tables hold that world size's rows only: ``<gpu>-cc..-..sm-w<N>-<link>``), else the
    default. A --world-size the key contradicts is exit 2: no table could match; so is a key that
    is a path (it would read files outside the table folders)."""
    from fo_kernels.fingerprint import read_device_key

    check_device_key(device_key)
    fields = read_device_key(device_key) if device_key is not None else None
    keyed = int(fields["world_size"]) if fields is not None else None
    if world_size is None:
        return keyed or DEFAULT_WORLD_SIZE
    if keyed is not None and keyed != world_size:
        raise typer.BadParameter(
            f"--world-size {world_size}: the device key {device_key} is for world size {keyed}; "
            f"pass -w {keyed}, or leave --world-size out"
        )
    return world_size


def find_paths(device_key: str | None, collective: str, world_size: int, dtype: str) -> list[Path]:
    """The table files of this header in the search path (``device_key`` None: this machine's;
    ``collective`` ``moe``: the MoE tables);
    ``TableNotFoundError`` naming the device keys that have tables and the options that pick one."""
    from fo_kernels.errors import TableNotFoundError
    from fo_kernels.moe.table import moe_table_filename
    from fo_kernels.table import table_filename
    from fo_tune.tables.find import (
        find_moe_tables,
        find_tables,
        held_tables,
        known_device_keys,
        search_folders,
    )

    if device_key is None:
        from fo_kernels.fingerprint import current_fingerprint

        device_key = current_fingerprint(None, world_size).device_key
    if collective == MOE_COLLECTIVE:
        paths = find_moe_tables(device_key, world_size, dtype)
        filename = moe_table_filename(world_size, dtype)
    else:
        paths = find_tables(device_key, collective, world_size, dtype)
        filename = table_filename(collective, world_size, dtype)
    if paths:
        return paths
    keys = known_device_keys()
    known = f"tables exist for device keys {', '.join(keys)}" if keys else "no table folder exists"
    if device_key in keys:  # (the key is right: name what it holds, not the key list again)
        known = f"{device_key} holds {', '.join(held_tables(device_key))}: pick one with -c, -w and -d"
    folders = ", ".join(map(str, search_folders()))
    raise TableNotFoundError(
        f"no table {device_key}/{filename} in {folders} ({known}); "
        "write one with `fo-tune search`, pick a device key with -k KEY (`fo-tune table list` lists "
        "them), or give a PATH"
    )
