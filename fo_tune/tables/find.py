"""Finding tables: the row the runtime would use for a call and the file it comes from, and table
files in the runtime's search path; for a dense call (``lookup_schedule``) and for an MoE call
(``expert_parallel_ffn``'s table lookup); and what lookup makes of a table file where it sits
(``placement``: its name and its device key folder).
"""

from __future__ import annotations

import re
from pathlib import Path

from fo_kernels.errors import TableError
from fo_kernels.fingerprint import Fingerprint, read_device_key
from fo_kernels.moe.table import (
    MOE_TABLE_PREFIX,
    ExpertsKey,
    MoeRow,
    best_moe_row,
    load_moe_table,
    moe_table_path,
)
from fo_kernels.schedule import COLLECTIVES, DTYPES, Schedule
from fo_kernels.table import (
    TABLE_DIR_ENV,
    best_match,
    check_header_for,
    read_table,
    table_dir_env_not_a_folder,
    table_path,
    table_search_path,
)
from fo_kernels.table.format import MOE_TABLE_KIND, TABLE_KIND, file_stamp
from fo_kernels.table.paths import folder_refuses, where_it_belongs


# ------------------------------------------------------------------------------------- find
def search_folders() -> list[Path]:
    """``table_search_path()``, refusing a ``$FO_TUNE_TABLE_DIR`` that names a file: the runtime
    finds no table under a file, so listing or looking up past it would hide the mistake (a search
    refuses it too, as a place it cannot write). A folder that does not exist yet is searched as
    empty."""
    env = table_dir_env_not_a_folder()
    if env is not None:
        raise TableError(
            f"{TABLE_DIR_ENV}={env} is a file, not a folder of tables; point {TABLE_DIR_ENV} at a "
            "folder (it is created by `fo-tune search`), or unset it"
        )
    return table_search_path()


def find_row(
    device_key: str, collective: str, world_size: int, dtype: str, m: int, n: int, k: int
) -> tuple[Schedule | None, Path | None, list[Path]]:
    """(row, its file, every file read) of the row ``lookup_schedule`` takes for this call on the
    machine of ``device_key`` (``fo_kernels.table.best_match`` over ``find_tables``, read as the
    runtime reads them); (None, None, files) when no row matches (the runtime then runs overlap:
    false). A file whose header is for another call (collective, dtype, world size), or whose
    fingerprint is a GPU of another compute capability than ``device_key``'s (a file in another
    machine's folder), is a ``TableError``, as in the runtime."""
    paths = find_tables(device_key, collective, world_size, dtype)
    tables = [read_table(path) for path in paths]
    for path, table in zip(paths, tables, strict=True):
        check_header_for(
            table.header, collective=collective, dtype=dtype, world_size=world_size, source=str(path)
        )
        check_machine(path, table.fingerprint, device_key)
    match = best_match(tables, m, n, k)
    if match is None:
        return None, None, paths
    return match[1], paths[match[0]], paths


def check_machine(path: Path, fp: Fingerprint, device_key: str) -> None:
    """Refuse the table at ``path`` (in ``device_key``'s folder) whose fingerprint ``fp`` is a GPU
    of another compute capability, as the runtime refuses it on ``device_key``'s machine: a
    ``TableError`` saying the table's device key is not its folder's, and what to do (move it to
    its own device key's folder, or tune one for ``device_key``)."""
    if not any(field == "compute_capability" for field, _, _ in folder_refuses(fp.device_key, device_key)):
        return
    home = path.parent.parent / fp.device_key / path.name
    raise TableError(
        f"table {path} sits in the folder of device key {device_key}, but its fingerprint is device "
        f"key {fp.device_key} ({fp.gpu_name}): it was tuned on that machine, and lookup, as the "
        f"runtime, refuses it here; move it to {home} (then look it up with -k {fp.device_key}), "
        f"or tune a table for {device_key} with `fo-tune search`"
    )


# The names lookup reads a table file under: a dense call's and the MoE table's.
_KINDS = "|".join((*COLLECTIVES, MOE_TABLE_PREFIX))
_LOOKUP_NAME = re.compile(rf"({_KINDS})-w[0-9]+-({'|'.join(DTYPES)})\.yaml")


def lookup_reads(path: Path) -> bool:
    """Whether lookup reads a file of ``path``'s name: a dense call's table or the MoE table's."""
    return _LOOKUP_NAME.fullmatch(path.name) is not None


def misnamed(path: Path, name: str) -> bool:
    """Whether the table at ``path``, whose header belongs under the file name ``name``, sits under
    a name lookup reads for other calls (another collective, world size or dtype): lookup then
    reads it for those calls and refuses it, naming the file."""
    return path.name != name and lookup_reads(path)


def _what_is_misnamed(path: Path, name: str) -> str:
    """What is wrong with the name of the table at ``path`` whose header's file name is ``name``:
    the other kind of table's name, or another call's."""
    prefix = f"{MOE_TABLE_PREFIX}-"
    moe, under_moe = name.startswith(prefix), path.name.startswith(prefix)
    if moe and not under_moe:
        return f"an MoE table (kind {MOE_TABLE_KIND!r}) under a dense table's name"
    if under_moe and not moe:
        return f"a dense schedule table (kind {TABLE_KIND!r}) under the MoE table's name"
    return f"a table of {name.removesuffix('.yaml')}'s rows under another call's name"


def _spelled(value: str | int) -> str:
    """A device key's field as a reader spells it: a capability with its dot (``90``: ``9.0``)."""
    text = str(value)
    return f"{text[:-1]}.{text[-1]}" if isinstance(value, str) and len(text) > 1 and text.isdigit() else text


def _folder_refuses(fp: Fingerprint, folder: str) -> str | None:
    """Why lookup on the device key ``folder`` refuses a table of fingerprint ``fp`` (another
    compute capability or world size, as the runtime refuses it), None where it takes it (or
    ``folder`` is no device key)."""
    whys = [
        f"{field.replace('_', ' ')} {_spelled(have)}, the folder's {_spelled(want)}"
        for field, have, want in folder_refuses(fp.device_key, folder)
    ]
    return f"its fingerprint is device key {fp.device_key} ({'; '.join(whys)})" if whys else None


def placement(path: Path, fp: Fingerprint, name: str) -> tuple[str | None, str | None]:
    """(note, problem) about where the table at ``path`` (fingerprint ``fp``, header's file name
    ``name``) sits, each one line saying what is wrong and where the file belongs:

    - a problem where lookup reads the file and refuses it: under a name lookup reads for other
      calls (another collective, world size or dtype, or the other kind of table: an MoE table
      under a dense table's name, a dense one under the MoE table's), or, under its own name, in
      the folder of a device key of another compute capability or world size;
    - a note where lookup never reads it (another name, or a folder of another world size), or
      reads it on another device key of the same capability (with a ``VersionDriftWarning``).

    ``None, None`` where it sits at ``<table folder>/<its device key>/<name>`` (the folder is the
    absolute path's: a bare file name given in its device key's folder sits there too)."""
    folder = path.absolute().parent.name
    if (folder, path.name) == (fp.device_key, name):
        return None, None
    refused = _folder_refuses(fp, folder)
    fix = where_it_belongs(path, fp.device_key, name)
    if misnamed(path, name):
        also = f"; {refused}" if refused else ""
        return None, (
            f"{_what_is_misnamed(path, name)}{also}: lookup reads it for the calls its name says and "
            f"refuses it; {fix}"
        )
    folder_key = read_device_key(folder)
    if path.name == name and refused is not None and folder_key and folder_key["world_size"] == fp.world_size:
        return None, (
            f"{refused}: lookup on device key {folder} reads this file for its calls and refuses it; "
            f"{fix} (then look it up with -k {fp.device_key})"
        )
    if path.name == name and refused is None and folder_key is not None:
        return (
            f"{path}: lookup on device key {folder} reads this table, tuned on {fp.device_key}, and "
            "warns (VersionDriftWarning) that its schedules may not be the fastest there"
        ), None
    where = f"; {refused}, and lookup never reads it there" if refused else ""
    return f"{path}: lookup reads this table only as <table folder>/{fp.device_key}/{name}{where}", None


def check_file_name(path: Path, name: str) -> None:
    """Refuse, as lookup does, the table at ``path`` that is ``misnamed`` (its header's file name
    ``name``): a ``TableError`` saying to rename it."""
    if misnamed(path, name):
        raise TableError(
            f"table {path} holds {name.removesuffix('.yaml')}'s rows under another call's name: "
            f"lookup reads it for the calls its name says and refuses it; rename it to {name}"
        )


def find_tables(device_key: str, collective: str, world_size: int, dtype: str) -> list[Path]:
    """The existing table files for this header in ``table_search_path()`` order (the order
    ``lookup_schedule`` reads them in: an exact-shape row in any of them beats an M-range row)."""
    paths = (table_path(root, device_key, collective, world_size, dtype) for root in search_folders())
    return [path for path in paths if _there(path)]


def find_moe_tables(device_key: str, world_size: int, dtype: str) -> list[Path]:
    """The existing MoE table files of this (device key, world size, dtype) in
    ``table_search_path()`` order (the order the runtime's MoE lookup reads them in)."""
    paths = (moe_table_path(root, device_key, world_size, dtype) for root in search_folders())
    return [path for path in paths if _there(path)]


def _there(path: Path) -> bool:
    """Whether the runtime's lookup reads ``path``: anything but nothing there (a folder or a
    symlink loop under a table's name it refuses, and so does reading it here)."""
    try:
        return file_stamp(path) is not None
    except TableError:
        return True


def find_moe_row(
    device_key: str, world_size: int, dtype: str, key: ExpertsKey, tokens: int
) -> tuple[MoeRow | None, Path | None, list[Path]]:
    """(row, its file, every file read) of the row ``expert_parallel_ffn`` takes for a call of the
    experts' shape ``key`` whose ranks hold at most ``tokens`` tokens each, on the machine of
    ``device_key`` (``fo_kernels.moe.table.best_moe_row`` over ``find_moe_tables``); (None, None,
    files) when no row covers it (the runtime then runs the no-overlap path). A file holding
    another dtype or world size, or whose fingerprint is a GPU of another compute capability than
    ``device_key``'s, is a ``TableError``, as in the runtime."""
    paths = find_moe_tables(device_key, world_size, dtype)
    tables = [load_moe_table(path) for path in paths]
    for path, table in zip(paths, tables, strict=True):
        if (table.dtype, table.world_size) != (dtype, world_size):
            raise TableError(
                f"{path}: holds {table.dtype} w{table.world_size} rows, expected {dtype} w{world_size}"
            )
        check_machine(path, table.fingerprint, device_key)
    match = best_moe_row(tables, key, tokens)
    if match is None:
        return None, None, paths
    return match[1], paths[match[0]], paths


def held_tables(device_key: str) -> list[str]:
    """The names of the table files ``device_key``'s folders hold in the search path, sorted: files
    under a name lookup reads (``lookup_reads``)."""
    names = {
        p.name for root in search_folders() for p in (root / device_key).glob("*.yaml") if lookup_reads(p)
    }
    return sorted(names)


def known_device_keys() -> list[str]:
    """Device keys that have a table folder somewhere in the search path, sorted: folders holding a
    file under a name lookup reads (``lookup_reads``). A folder of notes or other YAML beside the
    tables is no device key: lookup with ``-k`` of its name finds nothing there."""
    keys: set[str] = set()
    for root in search_folders():
        if root.is_dir():
            keys.update(
                child.name
                for child in root.iterdir()
                if child.is_dir() and any(lookup_reads(path) for path in child.glob("*.yaml"))
            )
    return sorted(keys)
