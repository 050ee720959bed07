"""How ``fo-tune table`` shows MoE tables (``fo_kernels.moe.table``): the fingerprint header, the
rich table of ``show``, its YAML and CSV, the label of a row's schedule, and the cells of ``diff``.
The dense tables' counterparts are ``fo_tune.cli.table_rows``'."""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from fo_tune.cli.common import summary_table
from fo_tune.cli.table_rows import (
    PROVENANCE_LONG,
    SHOW_ROWS,
    device_lines,
    named,
    print_plain,
    print_shown,
    provenance_columns,
    provenance_keys,
    tile_label,
    value_label,
)

if TYPE_CHECKING:
    from fo_kernels.moe.schedule import MoeSchedule
    from fo_kernels.moe.table import MoeRow, MoeTable
    from fo_tune.tables.moe_diff import MoeRowDiff

# Provenance keys shown first, in this order; any other key follows, sorted.
MOE_PROVENANCE_ORDER = ("measured_ms", "predicted_ms", "fallback_ms", "speedup", "mode", "tokens_priced")
# Provenance values shared by many rows and too long for a cell: printed once each under the
# table, with the number of rows that carry them (every value is in --format yaml / csv).
MOE_PROVENANCE_NOTES = ("calibration", "basis")
# The label of a row without an engine: the runtime's no-overlap path.
NO_OVERLAP = "none (no overlap)"
# The settings columns of ``show``, in the order ``moe_settings_cells`` fills them.
MOE_SETTINGS_COLUMNS = ("engine", "tile", "sms_free", "cap", "wait", "chunks")

CSV_COLUMNS = (
    "file",
    "hidden",
    "intermediate",
    "experts",
    "top_k",
    "tokens_min",
    "tokens_max",
    "kind",
    "engine",
    "block_m",
    "block_n",
    "block_k",
    "group_m",
    "num_warps",
    "num_stages",
    "warp_specialize",
    "pingpong",
    "sms_free",
    "nccl_max_ctas",
    "wait_mode",
    "chunks",
)


def experts_label(schedule: MoeSchedule) -> str:
    """``H, I, E_local, k`` of the row's experts' shape."""
    p = schedule.problem
    return f"{p.hidden}, {p.intermediate}, {p.experts}, {p.top_k}"


def bucket_label(schedule: MoeSchedule) -> str:
    """The row's tokens per rank, ``tokens_min..tokens_max``."""
    return f"{schedule.problem.tokens_min}..{schedule.problem.tokens_max}"


def moe_schedule_label(schedule: MoeSchedule) -> str:
    """What the row runs in one cell: ``triton 128x256x64 gm8 w8 s3 free 4 cap 8 stream_wait``,
    ``copy_engine chunks 2`` or ``none (no overlap)``."""
    if schedule.engine == "triton":
        cap = schedule.nccl_max_ctas or "default"
        return f"triton {tile_label(schedule.tile)} free {schedule.sms_free} cap {cap} {schedule.wait_mode}"
    if schedule.engine == "copy_engine":
        return f"copy_engine chunks {schedule.chunks}"
    return NO_OVERLAP


def moe_settings_cells(schedule: MoeSchedule) -> list[str]:
    """engine, tile, sms_free, cap, wait, chunks of a row (``-`` where its engine has none)."""
    if schedule.engine == "triton":
        cap = str(schedule.nccl_max_ctas or "default")
        return ["triton", tile_label(schedule.tile), str(schedule.sms_free), cap, schedule.wait_mode, "-"]
    if schedule.engine == "copy_engine":
        return ["copy_engine", "-", "-", "-", "-", str(schedule.chunks)]
    return [NO_OVERLAP, "-", "-", "-", "-", "-"]


def moe_fingerprint_lines(table: MoeTable) -> list[str]:
    """The header lines ``table show`` prints for a MoE table: its device, then dtype, world size, rows."""
    return [
        *device_lines(table.fingerprint),
        f"moe {table.dtype}, world size {table.world_size}, {len(table.rows)} row(s)",
    ]


def show_moe_rich(path: Path, table: MoeTable, limit: int | None = SHOW_ROWS) -> None:
    """The MoE table as ``fo-tune table show`` prints it: the header, one line per row (experts'
    shape, bucket, measured or predicted, engine and its settings, provenance) for its first
    ``limit`` rows (every row when None) with a line on the rows left out, then the long
    provenance values (calibration, basis) once each."""
    hidden = {*PROVENANCE_LONG, *MOE_PROVENANCE_NOTES}
    prov = [key for key in provenance_keys(table.rows, MOE_PROVENANCE_ORDER) if key not in hidden]
    columns = ["experts (H, I, E_local, k)", "tokens", "row", *MOE_SETTINGS_COLUMNS, *prov]
    out = summary_table("", columns, 4)
    for row in table.rows[:limit]:
        s = row.schedule
        cells = [experts_label(s), bucket_label(s), row.kind, *moe_settings_cells(s)]
        cells += [value_label(row.provenance[key]) if key in row.provenance else "-" for key in prov]
        out.add_row(*(escape(cell) for cell in cells))
    predicted = sum(row.kind == "predicted" for row in table.rows)
    print_shown(path, moe_fingerprint_lines(table), out, len(table.rows), predicted, "covers the call")
    for key in MOE_PROVENANCE_NOTES:
        values = Counter(str(row.provenance[key]) for row in table.rows if key in row.provenance)
        for value, count in values.items():
            print_plain(f"{key} ({count} row(s)): {value}")


def moe_table_yaml(table: MoeTable) -> str:
    """The MoE table as ``table show --format yaml`` prints it: its file's dict as YAML."""
    import yaml

    return yaml.safe_dump(table.to_dict(), sort_keys=False, default_flow_style=None, width=110)


def moe_csv_rows(found: Sequence[tuple[Path, MoeTable]]) -> str:
    """One CSV line per row of every MoE table; provenance keys as columns (``provenance_columns``:
    each column name once)."""
    prov = provenance_keys([row for _path, table in found for row in table.rows], MOE_PROVENANCE_ORDER)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*CSV_COLUMNS, *provenance_columns(prov, CSV_COLUMNS)])
    for path, table in found:
        for row in table.rows:
            s = row.schedule
            values: dict[str, Any] = {"file": str(path), **s.problem.to_dict(), "kind": row.kind}
            values["engine"] = s.engine or ""
            if s.engine == "triton":
                values.update(s.tile.to_dict())
                values.update(sms_free=s.sms_free, nccl_max_ctas=s.nccl_max_ctas, wait_mode=s.wait_mode)
            elif s.engine == "copy_engine":
                values["chunks"] = s.chunks
            cells = [values.get(column, "") for column in CSV_COLUMNS]
            provenance = named(row.provenance)
            cells += [provenance.get(key, "") for key in prov]
            writer.writerow(cells)
    return buf.getvalue()


def _field_label(row: MoeRow, name: str) -> str:
    """A schedule field's value in a diff cell; ``none`` for no engine (the no-overlap path)."""
    value = getattr(row.schedule, name)
    return "none" if name == "engine" and value is None else value_label(value)


def moe_changes_cell(d: MoeRowDiff) -> str:
    """``diff``'s changes cell of an MoE row: what a one-sided row runs, else each changed field
    A -> B and the changed provenance keys."""
    row = d.a if d.status == "only_a" else d.b if d.status == "only_b" else None
    if row is not None:
        return moe_schedule_label(row.schedule)
    assert d.a is not None and d.b is not None
    parts = [f"{name} {_field_label(d.a, name)} -> {_field_label(d.b, name)}" for name in d.fields]
    if d.provenance_changed:
        parts.append("provenance: " + ", ".join(d.provenance_changed))
    return "; ".join(parts) or "-"
