"""Which kind of table a file holds, and loading it as that kind: a dense schedule table
(``fo_kernels.table``) or an MoE table (``fo_kernels.moe.table``).

A file is an MoE table when its name starts with the MoE prefix (``moe-w<W>-<dtype>.yaml``, the
only name the runtime reads MoE rows from) or its ``kind`` says so (``MOE_TABLE_KIND``); any other
file is a dense table. Either marker is the format's own, so a file is never loaded by trying one
format and falling back to the other: a ``moe-`` file holding a dense table is an MoE table with
the wrong ``kind`` (loading names it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from fo_kernels.moe.table import MOE_TABLE_KIND, MOE_TABLE_PREFIX, MoeTable
from fo_kernels.table import ScheduleTable
from fo_kernels.table.format import read_table_data

TableKind = Literal["dense", "moe"]


def is_moe_name(path: str | os.PathLike[str]) -> bool:
    """True when the file's name is an MoE table's (``moe-...``)."""
    return Path(path).name.startswith(f"{MOE_TABLE_PREFIX}-")


def table_kind(path: str | os.PathLike[str], data: Any) -> TableKind:
    """``moe`` for an MoE table (by its name or its ``kind``), else ``dense``; ``data``: the file's
    parsed content."""
    if is_moe_name(path):
        return "moe"
    if isinstance(data, Mapping) and data.get("kind") == MOE_TABLE_KIND:
        return "moe"
    return "dense"


def load_any_table(path: str | os.PathLike[str]) -> ScheduleTable | MoeTable:
    """The table file at ``path`` read once and checked as its kind: what ``load_moe_table`` or
    ``load_table`` checks (``TableNotFoundError`` when there is none, ``TableError`` naming the
    path when it is malformed)."""
    data = read_table_data(path)
    if table_kind(path, data) == "moe":
        return MoeTable.from_dict(data, source=str(path))
    return ScheduleTable.from_dict(data, source=str(path))
