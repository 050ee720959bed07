"""The JSON documents ``fo-tune table show --json`` and ``fo-tune table validate --json`` print
(one document on stdout, strict JSON through ``fo_tune.cli.common.json_text``), dense and MoE tables
alike; ``document_text`` writes a document of every row of a fleet-scale table as ``json_text``
does, in a fraction of its time.

show:     {"kind": "fo-tune-table-show", "tables": [{"path", "table_kind", "schema_version",
           "fingerprint", "collective" (dense), "world_size", "dtype", "bases", "rows"}]}
          each row as the file holds it, with its "kind" (measured or predicted) added; "bases"
          lists what predicted rows rest on, once per text, with its row count.
validate: {"kind": "fo-tune-table-validate", "ok", "files": [{"path", "ok", "rows", "problems",
           "note"}], "problems"}; "rows" is null for a file that does not load.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fo_tune.cli.common import json_text

if TYPE_CHECKING:
    from fo_kernels.moe.table import MoeTable
    from fo_kernels.table import ScheduleTable

SHOW_KIND = "fo-tune-table-show"
# The indent of ``json_text``'s documents, per level.
INDENT = "  "
VALIDATE_KIND = "fo-tune-table-validate"


def _row_kind_and_basis(row: Any) -> tuple[str, str]:
    """(measured or predicted, basis) of a dense row (``Schedule``) or an MoE row (``MoeRow``, whose
    basis sits in its provenance)."""
    from fo_kernels.moe.table import MoeRow
    from fo_kernels.table import row_kind

    if isinstance(row, MoeRow):
        return row.kind, str(row.provenance.get("basis", ""))
    return row_kind(row), row.basis


def table_entry(path: Path, table: ScheduleTable | MoeTable) -> dict[str, Any]:
    """One table of ``show --json``: its file, header, fingerprint, bases and rows."""
    data = table.to_dict()
    file_kind = data.pop("kind")
    described = [_row_kind_and_basis(row) for row in table.rows]
    bases = Counter(basis for _kind, basis in described if basis)
    rows = [{"kind": kind, **row} for (kind, _basis), row in zip(described, data.pop("rows"), strict=True)]
    # the rows of one schedule share its settings (fo_tune.tables.kinds): one mapping of them, so
    # the document's writer writes it once (document_text)
    shared: dict[int, Any] = {}
    for schedule, row in zip(table.rows, rows, strict=True):
        settings = getattr(schedule, "settings", None)  # (a dense row's; an MoE row has none)
        if settings is not None and "settings" in row:
            row["settings"] = shared.setdefault(id(settings), row["settings"])
    return {
        "path": str(path),
        "table_kind": file_kind,
        **data,
        "bases": [{"basis": basis, "rows": count} for basis, count in bases.items()],
        "rows": rows,
    }


# The types json writes as a scalar of its own: a list or mapping holding only these is written in
# one call of its C encoder (a subclass goes item by item, as ``json_text`` may write it otherwise).
_SCALARS = frozenset({str, int, float, bool, type(None)})
_STR = frozenset({str})


@functools.cache
def _flat_encoder(level: int) -> Callable[[Any], str]:
    """``json``'s C encoder for a value at nesting ``level`` that holds no list or mapping: the
    items of a list or mapping one a line, each indented for ``level + 1``."""
    return json.JSONEncoder(
        separators=(",\n" + INDENT * (level + 1), ": "), allow_nan=False, default=str
    ).encode


def _flat_text(value: Any, level: int) -> str:
    """``value`` (a scalar, or a list or mapping of ``_SCALARS``) as ``json_text`` writes it at
    nesting ``level``."""
    if type(value) is str:
        return encode_basestring_ascii(value)
    try:
        text = _flat_encoder(level)(value)
    except ValueError:  # a NaN or infinity (null in json_text): its text, each line indented for level
        return json_text(value).replace("\n", "\n" + INDENT * level)
    if isinstance(value, (dict, list, tuple)) and value:  # "{" + items + "}" on lines of their own
        return f"{text[0]}\n{INDENT * (level + 1)}{text[1:-1]}\n{INDENT * level}{text[-1]}"
    return text


def _write(value: Any, level: int, out: list[str], seen: dict[tuple[int, int], str]) -> None:
    """Append ``value`` as ``json_text`` writes it at nesting ``level`` to ``out``: a list or mapping
    of scalars in one call of ``json``'s C encoder, the levels above it item by item (the
    pure-Python encoder that ``indent`` takes went item by item all the way down: 5 s for the 85 MB
    of a 100,000-row table on the 2-core CPU machine). A mapping of lists or mappings is written
    once per level and kept in ``seen`` by its id (every object of the document lives as long as
    it): the rows of one schedule share its settings' mapping (``table_entry``)."""
    if isinstance(value, dict):
        if not _STR.issuperset(map(type, value)):
            value = {str(key): item for key, item in value.items()}  # (json_text's keys; not kept)
            seen = {}
        values: Any = value.values()
    elif isinstance(value, (list, tuple)):
        values = value
    else:
        out.append(_flat_text(value, level))
        return
    if not value or _SCALARS.issuperset(map(type, values)):
        out.append(_flat_text(value, level))
        return
    is_map = isinstance(value, dict)
    known = seen.get((id(value), level)) if is_map else None
    if known is not None:
        out.append(known)
        return
    parts: list[str] = []
    line = "\n" + INDENT * (level + 1)
    sep, end = ("{", "}") if is_map else ("[", "]")
    pairs = value.items() if is_map else zip(itertools.repeat(None), value)
    for key, item in pairs:
        head = f"{sep}{line}" if key is None else f"{sep}{line}{encode_basestring_ascii(key)}: "
        if type(item) in _SCALARS:
            parts.append(head + _flat_text(item, level + 1))
        else:
            parts.append(head)
            _write(item, level + 1, parts, seen)
        sep = ","
    parts.append(f"\n{INDENT * level}{end}")
    text = "".join(parts)
    if is_map:
        seen[id(value), level] = text
    out.append(text)


def document_text(data: Any) -> str:
    """``fo_tune.cli.common.json_text(data)``: the same text (strict JSON indented by two spaces,
    NaN as null, keys as ``str`` makes them, other values as ``str`` writes them)."""
    out: list[str] = []
    _write(data, 0, out, {})
    return "".join(out)


def show_document(found: list[tuple[Path, ScheduleTable | MoeTable]]) -> dict[str, Any]:
    """The ``table show --json`` document of the tables ``found`` (path, table)."""
    return {"kind": SHOW_KIND, "tables": [table_entry(path, table) for path, table in found]}


@dataclass(slots=True)
class FileCheck:
    """What ``validate`` found in one file: its row count (None when it does not load), its
    problems (each a one-line message) and a note on where it sits."""

    path: Path
    rows: int | None
    problems: list[str] = field(default_factory=list)
    note: str | None = None
    # Whether one of the problems is where the file sits (its name or folder), not its rows.
    misplaced: bool = False
    # Whether the file does not exist (rows None: it does not load for another reason).
    missing: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "ok": not self.problems,
            "rows": self.rows,
            "problems": self.problems,
            "note": self.note,
        }


def validate_document(checks: list[FileCheck]) -> dict[str, Any]:
    """The ``table validate --json`` document of ``checks``: ok, per file what it found, the problem count."""
    problems = [problem for check in checks for problem in check.problems]
    return {
        "kind": VALIDATE_KIND,
        "ok": not problems,
        "files": [check.to_dict() for check in checks],
        "problems": len(problems),
    }
