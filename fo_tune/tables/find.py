"""Finding tables: the row the runtime would use for a call and the file it comes from, and table
files in the runtime's search path.
"""

from __future__ import annotations

from pathlib import Path

from fo_kernels.schedule import Schedule
from fo_kernels.table import (
    best_row,
    load_table,
    table_path,
    table_search_path,
)


# ------------------------------------------------------------------------------------- find
def find_row(
    device_key: str, collective: str, world_size: int, dtype: str, m: int, n: int, k: int
) -> tuple[Schedule | None, Path | None, list[Path]]:
    """(row, its file, every file read) of the row ``lookup_schedule`` takes for this call on the
    machine of ``device_key`` (``fo_kernels.table.best_row`` over ``find_tables``); (None, None,
    files) when no row matches (the runtime then runs overlap: false)."""
    paths = find_tables(device_key, collective, world_size, dtype)
    tables = [load_table(path) for path in paths]
    row = best_row(tables, m, n, k)
    if row is None:
        return None, None, paths
    path = next(p for p, t in zip(paths, tables, strict=True) if any(r is row for r in t.rows))
    return row, path, paths


def find_tables(device_key: str, collective: str, world_size: int, dtype: str) -> list[Path]:
    """The existing table files for this header in ``table_search_path()`` order (the order
    ``lookup_schedule`` reads them in: an exact-shape row in any of them beats an M-range row)."""
    paths = (table_path(root, device_key, collective, world_size, dtype) for root in table_search_path())
    return [path for path in paths if path.is_file()]


def known_device_keys() -> list[str]:
    """Device keys that have a table folder somewhere in the search path, sorted."""
    keys: set[str] = set()
    for root in table_search_path():
        if root.is_dir():
            keys.update(
                child.name for child in root.iterdir() if child.is_dir() and any(child.glob("*.yaml"))
            )
    return sorted(keys)
