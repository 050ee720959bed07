"""Where schedule tables live: the file name of a (collective, world size, dtype), the folders searched
in order (``$FO_TUNE_TABLE_DIR``, the user folder, the packaged tables), and the name checks the
table's header and the lookup share."""

from __future__ import annotations

import os
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from fo_kernels.errors import ScheduleError, ShapeError, TableDirWarning
from fo_kernels.fingerprint import read_device_key
from fo_kernels.schedule import COLLECTIVES, DTYPES, dtype_name

TABLE_DIR_ENV = "FO_TUNE_TABLE_DIR"


def check_name(name: str, value: Any, valid: tuple[str, ...]) -> str:
    """``value`` when it is one of the names ``valid``, else ``ScheduleError`` naming ``name`` and listing
    them."""
    if not isinstance(value, str) or value not in valid:
        raise ScheduleError(f"{name}: {value!r} is not one of {', '.join(valid)}")
    return value


def table_dtype(dtype: torch.dtype | str) -> str:
    """The dtype's name as table files spell it (``dtype_name``)."""
    return dtype_name(dtype)


def check_positive(name: str, value: Any) -> int:
    """``value`` when it is an int (not a bool) >= 1, else ``ShapeError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShapeError(f"{name}: expected an integer >= 1, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------- paths
def table_filename(collective: str, world_size: int, dtype: str) -> str:
    """``<collective>-w<world_size>-<dtype>.yaml``."""
    check_name("collective", collective, COLLECTIVES)
    check_name("dtype", dtype, DTYPES)
    return f"{collective}-w{int(world_size)}-{dtype}.yaml"


def table_path(
    root: str | os.PathLike[str], device_key: str, collective: str, world_size: int, dtype: str
) -> Path:
    """``<root>/<device_key>/<collective>-w<world_size>-<dtype>.yaml``."""
    return Path(root) / device_key / table_filename(collective, world_size, dtype)


def folder_refuses(device_key: str, folder: str) -> list[tuple[str, str | int, str | int]]:
    """Why lookup on the device key ``folder`` refuses a table whose fingerprint is ``device_key``:
    (field, the table's value, the folder's) of each of compute capability and world size that
    differ, as ``read_device_key`` spells them; none where they agree or either is no device key."""
    want, have = read_device_key(folder), read_device_key(device_key)
    if not want or not have:
        return []
    fields = ("compute_capability", "world_size")
    return [(field, have[field], want[field]) for field in fields if want[field] != have[field]]


def where_it_belongs(path: str | os.PathLike[str], device_key: str, name: str) -> str:
    """What to do with the table file at ``path`` whose fingerprint is ``device_key`` and whose
    header's file name is ``name``: "move it to <table folder>/<device_key>/<name>" where it sits in
    the folder of a device key that lookup refuses it on (``folder_refuses``), else "rename it to
    <name>"; "" where it sits there already. ``fo-tune table validate`` and every refusal of a
    misnamed or misplaced table say it."""
    here = Path(path).absolute().parent
    if folder_refuses(device_key, here.name):
        return f"move it to {here.parent / device_key / name}"
    return "" if Path(path).name == name else f"rename it to {name}"


def user_table_dir() -> Path:
    """The user's table folder: ``$XDG_DATA_HOME/fo-tune/tables``, by default
    ``~/.local/share/fo-tune/tables``. A relative ``$XDG_DATA_HOME`` is ignored, as the XDG base
    directory spec says: read as it stands, the folder the runtime finds would follow the working
    folder of each process."""
    data_home = Path(os.environ.get("XDG_DATA_HOME") or "").expanduser()
    base = data_home if data_home.is_absolute() else Path.home() / ".local" / "share"
    return base / "fo-tune" / "tables"


def _packaged_table_dir() -> Path | None:
    try:
        root = resources.files("fo_results") / "tables"
    except (ImportError, TypeError):
        return None
    return root if isinstance(root, Path) else None  # a zipped install is not searched


def table_dir_env_not_a_folder() -> str | None:
    """``$FO_TUNE_TABLE_DIR`` where it names something that exists and is no folder (a file): no
    table can be read from it. None where it is unset, a folder, or not there yet."""
    env = os.environ.get(TABLE_DIR_ENV)
    if env and Path(env).expanduser().exists() and not Path(env).expanduser().is_dir():
        return env
    return None


def table_search_path() -> list[Path]:
    """Folders searched for tables, in order: ``$FO_TUNE_TABLE_DIR``, the user folder, the packaged one.
    A ``$FO_TUNE_TABLE_DIR`` that names a file warns (``TableDirWarning``) and is left out."""
    folders: list[Path] = []
    env = os.environ.get(TABLE_DIR_ENV)
    not_a_folder = table_dir_env_not_a_folder()
    if not_a_folder is not None:
        # (a running job's calls go on with the other folders; the CLI refuses it outright)
        warnings.warn(
            f"{TABLE_DIR_ENV}={not_a_folder} is a file, not a folder: no table is read from it; point "
            "it at the folder that holds <device-key>/<collective>-w<world>-<dtype>.yaml tables",
            TableDirWarning,
            stacklevel=3,
        )
    elif env:
        folders.append(Path(env).expanduser())
    folders.append(user_table_dir())
    packaged = _packaged_table_dir()
    if packaged is not None:
        folders.append(packaged)
    unique: list[Path] = []
    for folder in folders:
        if folder not in unique:
            unique.append(folder)
    return unique
