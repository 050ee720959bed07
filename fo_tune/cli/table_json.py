"""The JSON documents ``fo-tune table show --json`` and ``fo-tune table validate --json`` print
(one document on stdout, strict JSON through ``fo_tune.cli.common.json_text``), dense and MoE tables
alike.

show:     {"kind": "fo-tune-table-show", "tables": [{"path", "table_kind", "schema_version",
           "fingerprint", "collective" (dense), "world_size", "dtype", "bases", "rows"}]}
          each row as the file holds it, with its "kind" (measured or predicted) added; "bases"
          lists what predicted rows rest on, once per text, with its row count.
validate: {"kind": "fo-tune-table-validate", "ok", "files": [{"path", "ok", "rows", "problems",
           "note"}], "problems"}; "rows" is null for a file that does not load.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fo_kernels.moe.table import MoeTable
    from fo_kernels.table import ScheduleTable

SHOW_KIND = "fo-tune-table-show"
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
    return {
        "path": str(path),
        "table_kind": file_kind,
        **data,
        "bases": [{"basis": basis, "rows": count} for basis, count in bases.items()],
        "rows": rows,
    }


def show_document(found: list[tuple[Path, ScheduleTable | MoeTable]]) -> dict[str, Any]:
    return {"kind": SHOW_KIND, "tables": [table_entry(path, table) for path, table in found]}


@dataclass(slots=True)
class FileCheck:
    """What ``validate`` found in one file: its row count (None when it does not load), its
    problems (each a one-line message) and a note on where it sits."""

    path: Path
    rows: int | None
    problems: list[str] = field(default_factory=list)
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "ok": not self.problems,
            "rows": self.rows,
            "problems": self.problems,
            "note": self.note,
        }


def validate_document(checks: list[FileCheck]) -> dict[str, Any]:
    problems = [problem for check in checks for problem in check.problems]
    return {
        "kind": VALIDATE_KIND,
        "ok": not problems,
        "files": [check.to_dict() for check in checks],
        "problems": len(problems),
    }
