"""How ``fo-tune table`` shows rows: labels of tiles, settings, values and row kinds, the rich
table of ``show``, its CSV, and the fingerprint header."""

from __future__ import annotations

import csv
import io
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from fo_tune.cli.common import console, fmt, summary_table

if TYPE_CHECKING:
    from rich.table import Table

    from fo_kernels.fingerprint import Fingerprint
    from fo_kernels.schedule import Schedule
    from fo_kernels.table import ScheduleTable
    from fo_kernels.tile import Tile

# Provenance keys shown first, in this order; any other key follows, sorted.
PROVENANCE_ORDER = ("measured_ms", "predicted_ms", "sequential_ms", "speedup", "mode", "source")
# Long provenance values kept out of the terminal table (they are in --format yaml / csv).
PROVENANCE_LONG = (
    "decision",
    "study",
    "date",
    "baseline",
    "search_ms",
    "iqr_ms",
    "sequential_iqr_ms",
    "trial",
)
# Rows the terminal view (`show`'s default format, `diff`'s) prints per table unless --limit or --all says
# otherwise: rich lays a table out in about 2 ms a row (a 20,000-row table took 37 s, an
# 80,000-row one 148 s), so a fleet-scale table would hold the terminal for minutes; 200 rows
# print in well under a second, and a line after them says how to see the others.
SHOW_ROWS = 200


def tile_label(tile: Tile | None) -> str:
    """``Tile.label()`` (``128x256x64 gm8 w8 s3``, `` ws`` when warp specialized); ``-`` for no tile."""
    return "-" if tile is None else tile.label()


def copy_engine_label(row: Schedule) -> str:
    """``copy engine ring`` or ``copy engine tiled 128x256x64 ...``."""
    st = row.settings
    tile = getattr(st, "tile", None)
    return f"copy engine {getattr(st, 'mode', '')}" + (f" {tile_label(tile)}" if tile is not None else "")


def kind_label(row: Schedule) -> str:
    """``measured`` or ``predicted`` (``fo_kernels.table.row_kind``)."""
    from fo_kernels.table import row_kind

    return row_kind(row)


def value_label(value: Any) -> str:
    """A provenance or field value in a cell: floats to 4 significant digits, tiles in short form."""
    from fo_kernels.tile import Tile

    if isinstance(value, Tile) or value is None:
        return tile_label(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return fmt(value, ".4g")
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(value_label(v) for v in value) + "]"
    return str(value)


def provenance_keys(rows: Sequence[Any], order: Sequence[str] = PROVENANCE_ORDER) -> list[str]:
    """Provenance keys present in any row (a dense or MoE table's: anything with a ``provenance``
    mapping): ``order``'s first, the rest sorted."""
    present = {str(key) for row in rows for key in row.provenance}
    return [key for key in order if key in present] + sorted(present - set(order))


def named(provenance: Mapping[Any, Any]) -> Mapping[str, Any]:
    """``provenance`` by the names ``provenance_keys`` gives its keys (``str``): a hand-written key
    YAML reads as another type (``7:``) keeps its value in the CSV's column ``7`` (a row whose
    provenance also holds ``"7"`` does not load: ``fo_kernels.fields.check_record``)."""
    if all(type(key) is str for key in provenance):
        return provenance
    return {str(key): value for key, value in provenance.items()}


def device_lines(fp: Fingerprint) -> list[str]:
    """A table fingerprint's machine and library versions, one line each."""
    return [
        f"fingerprint: {fp.device_key}: {fp.gpu_name}, compute capability {fp.compute_capability}, "
        f"{fp.sm_count} SMs, world size {fp.world_size}, {fp.interconnect}",
        "versions: " + ", ".join(f"{name} {value}" for name, value in fp.versions().items()),
    ]


def fingerprint_lines(table: ScheduleTable) -> list[str]:
    """The header lines ``table show`` prints for a table: its device, then collective, dtype, world size,
    schema, rows."""
    return [
        *device_lines(table.fingerprint),
        f"{table.collective} {table.dtype}, world size {table.world_size}, schema "
        f"{table.schema_version}, {len(table.rows)} row(s)",
    ]


def print_plain(text: str) -> None:
    """Print ``text`` on the console as it is (no markup, no highlighting)."""
    console.print(escape(text), highlight=False)


def settings_cells(row: Schedule) -> list[str]:
    """tile, sms_free, cap, signal, groups, layout, wait of a row (``-`` where it has none)."""
    from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
    from fo_kernels.engines.triton.settings import TritonSettings

    st = row.settings
    if isinstance(st, CopyEngineSettings):
        return [copy_engine_label(row), "-", "-", "-", value_label(st.weights), "-", "-"]
    if isinstance(st, TritonSettings):
        return [
            tile_label(st.tile),
            str(st.sms_free),
            str(st.nccl_max_ctas or "default"),
            str(st.signal_tiles),
            value_label(st.groups),
            st.layout,
            st.wait_mode,
        ]
    return ["-"] * 7


def left_out_line(shown: int, total: int, scripts: bool = True) -> str | None:
    """The line after a terminal table that shows ``shown`` of its ``total`` rows: how many are
    left out and how to see them (None when every row is shown); ``scripts``: the command also
    prints every row in script formats (``show``'s --format csv or yaml, --json)."""
    if shown >= total:
        return None
    line = (
        f"{total - shown} of {total} rows not shown (showing the first {shown}): --limit N shows N, "
        "--all every row (slow in a terminal beyond a few thousand)"
    )
    return line + (", --format csv or yaml or --json prints them all for scripts" if scripts else "")


def print_shown(
    path: Path, header: Sequence[str], out: Table, total: int, predicted: int, unless: str
) -> None:
    """What ``table show`` prints of a table of either kind: its path and ``header`` lines, then
    ``out`` (its first rows of ``total``), captioned with the count of its ``predicted`` rows, which
    the runtime uses only where no measured row ``unless`` says so ("matches", "covers the call"),
    then the line on the rows left out."""
    console.print(f"[bold]{escape(str(path))}[/]", highlight=False)
    for line in header:
        print_plain(f"  {line}")
    if predicted:
        out.caption = (
            f"{predicted} predicted row(s) (an offline search's; the runtime uses them only where no "
            f"measured row {unless})"
        )
    console.print(out)
    left_out = left_out_line(out.row_count, total)
    if left_out is not None:
        print_plain(left_out)


def show_rich(path: Path, table: ScheduleTable, limit: int | None = SHOW_ROWS) -> None:
    """The table as ``fo-tune table show`` prints it: the header, its first ``limit`` rows (every
    row when None) with a line on the rows left out, then the bases of its predicted rows."""
    prov = [key for key in provenance_keys(table.rows) if key not in PROVENANCE_LONG]
    columns = [
        "problem",
        "row",
        "overlap",
        "tile",
        "sms_free",
        "cap",
        "signal",
        "groups",
        "layout",
        "wait",
        *prov,
    ]
    # text columns among the numbers: the settings' lists and names, provenance that is not a number
    words = [
        key
        for key in prov
        if not all(
            isinstance(row.provenance[key], (int, float)) for row in table.rows if key in row.provenance
        )
    ]
    out = summary_table("", columns, 4, text=["groups", "layout", "wait", *words])
    for row in table.rows[:limit]:
        cells = [row.problem.describe(), kind_label(row), value_label(row.overlap), *settings_cells(row)]
        cells += [value_label(row.provenance[key]) if key in row.provenance else "-" for key in prov]
        out.add_row(*(escape(cell) for cell in cells))
    predicted = sum(kind_label(row) == "predicted" for row in table.rows)
    print_shown(path, fingerprint_lines(table), out, len(table.rows), predicted, "matches")
    # what the rows rest on (an extrapolated calibration's sentence), once per distinct text
    for basis, count in Counter(row.basis for row in table.rows if row.basis).items():
        print_plain(f"basis ({count} row(s)): {basis}")


# A number ``json`` writes with an exponent and no point (1e-05), which a row line writes as 1.0e-05
# (``fo_kernels.table.text.row_line``): the exponent of a float's text always has its sign, so
# every such number matches (a string holding such text only sends its row to row_line as well).
_BARE_EXPONENT = re.compile(r"[0-9]e[-+]")
_SCALARS = frozenset({str, int, float, bool, type(None)})
_STR = frozenset({str})
# A row line's JSON (``fo_kernels.table.text``'s separators), one encoder for every row.
_LINE_ENCODER = json.JSONEncoder(separators=(", ", ": "), ensure_ascii=False, allow_nan=False).encode


def _row_line(row: dict[str, Any]) -> str:
    """``fo_kernels.table.text.row_line(row)`` of a row ``Schedule.to_dict`` made: one call of
    ``json``'s C encoder where its provenance is a mapping of scalars under text keys (its only
    part read from a file as it is) and no number needs YAML's form, else row_line, which walks
    every value in Python (5 s for 100,000 rows on the 2-core CPU machine)."""
    from fo_kernels.table.text import row_line

    prov = row.get("provenance", {})
    if (
        type(prov) is dict
        and _STR.issuperset(map(type, prov))
        and _SCALARS.issuperset(map(type, prov.values()))
    ):
        try:
            text = _LINE_ENCODER(row)
        except (TypeError, ValueError):  # (a non-finite number: row_line writes a YAML flow mapping)
            return row_line(row)
        if _BARE_EXPONENT.search(text) is None:
            return text
    return row_line(row)


def table_yaml(table: ScheduleTable) -> str:
    """``table`` as YAML, as its file holds it (the header, then one row a line):
    ``fo_kernels.table.format.table_text(table)``, each row's line written by ``_row_line``."""
    import yaml

    data = table.to_dict()
    rows = data.pop("rows")
    header = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=110)
    if not rows:
        return f"{header}rows: []\n"
    return f"{header}rows:\n" + "".join(f"- {_row_line(row)}\n" for row in rows)


CSV_COLUMNS = (
    "file",
    "m",
    "m_min",
    "m_max",
    "n",
    "k",
    "overlap",
    "block_m",
    "block_n",
    "block_k",
    "group_m",
    "num_warps",
    "num_stages",
    "warp_specialize",
    "sms_free",
    "nccl_max_ctas",
    "signal_tiles",
    "groups",
    "layout",
    "wait_mode",
    "engine",  # after the other columns, so scripts reading by position keep working
    "mode",  # (copy engine rows)
    "kind",  # measured or predicted
    "pingpong",  # (Triton tiles; last, as the columns added after it)
    "basis",  # what a predicted row rests on (an extrapolated calibration's), else empty
)


# The prefix of a provenance key's column where the key is also a schedule column (provenance
# ``mode``, the search's, beside the copy engine's ``mode``): every column name is unique.
PROVENANCE_PREFIX = "provenance_"


def provenance_columns(keys: Sequence[str], columns: Sequence[str] = CSV_COLUMNS) -> list[str]:
    """The CSV column of each provenance key: the key, or ``provenance_<key>`` where the key is one
    of the schedule's ``columns`` or an earlier key's column (prefixed again until it is none: a
    provenance holding both ``mode`` and ``provenance_mode`` gets two columns)."""
    taken = set(columns)
    names = []
    for key in keys:
        name = key
        while name in taken:
            name = PROVENANCE_PREFIX + name
        taken.add(name)
        names.append(name)
    return names


def _settings_values(row: Schedule) -> dict[str, Any]:
    """The CSV values of a row's engine and settings (none for a row without overlap)."""
    st = row.settings
    if st is None:
        return {}
    values: dict[str, Any] = {"engine": row.engine}
    groups = getattr(st, "groups", None) or getattr(st, "weights", ())
    values["groups"] = " ".join(map(str, groups))
    tile = getattr(st, "tile", None)
    if tile is not None:  # every Triton row; a copy-engine row in its tiled mode
        values.update(tile.to_dict())
        values["warp_specialize"] = tile.warp_specialize
        values["pingpong"] = tile.pingpong
    for name in ("sms_free", "nccl_max_ctas", "signal_tiles", "layout", "wait_mode", "mode"):
        if hasattr(st, name):
            values[name] = getattr(st, name)
    return values


def csv_rows(found: Sequence[tuple[Path, ScheduleTable]]) -> str:
    """One CSV line per row of every table; groups space-separated, provenance keys as columns
    (``provenance_columns``: each column name once). A loaded table's rows of one schedule share
    its settings (``fo_tune.tables.kinds``): their values are made once, for the first of them."""
    from fo_kernels.table import row_kind

    prov = provenance_keys([row for _path, table in found for row in table.rows])
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*CSV_COLUMNS, *provenance_columns(prov)])
    blank = dict.fromkeys(CSV_COLUMNS, "")
    shared: dict[int, dict[str, Any]] = {}  # per settings (by id: the tables keep them alive)
    for path, table in found:
        file = str(path)
        for row in table.rows:
            settings = shared.get(id(row.settings))
            if settings is None:
                settings = shared[id(row.settings)] = {**blank, **_settings_values(row)}
            values = {**settings, "file": file, **row.problem.to_dict(), "overlap": row.overlap}
            values["kind"] = row_kind(row)
            values["basis"] = row.basis
            provenance = named(row.provenance)
            writer.writerow(
                [*map(values.__getitem__, CSV_COLUMNS), *(provenance.get(key, "") for key in prov)]
            )
    return buf.getvalue()
