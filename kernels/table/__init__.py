"""YAML schedule tables: where they live (``paths``), their format, loading and saving (``format``;
the text ``text``), the index rows are found by (``index``), the runtime's view of a file
(``loaded``), the runtime lookup (``lookup``) and the rule merges put rows in by (``spans``).

One file per (device key, collective, world size, dtype),
``<root>/<device_key>/<collective>-w<world_size>-<dtype>.yaml`` (collective ``all_reduce``,
``reduce_scatter`` or ``all_gather``). Roots, in search order
(``table_search_path``): ``$FO_TUNE_TABLE_DIR`` when set; the user folder
``$XDG_DATA_HOME/fo-tune/tables`` (``~/.local/share/fo-tune/tables``); the packaged tables,
``importlib.resources.files("fo_results") / "tables"`` (skipped when not importable or zipped). A file::

    schema_version: 2
    kind: fo-tune-schedule-table
    fingerprint: {device_key: ..., gpu_name: ..., compute_capability: "9.0", ...}
    collective: all_reduce
    world_size: 2
    dtype: bfloat16
    rows:
    - {"problem": {"m": 4096, "n": 8192, "k": 4096}, "engine": "copy_engine", "settings": {...}}
    - {"problem": {"m_min": 512, "m_max": 1448, "n": 4096, "k": 4096}, "overlap": false}

(one row a line, as JSON, which is YAML's flow syntax: ``text``; a file in YAML's block style, as
a hand-written one, loads the same, only slower.)

The problem of an ``all_gather`` row is that of its GEMM: M is the gathered M (world size x the
rows of one rank's shard of A), N and K those of B; like a ``reduce_scatter`` row's, its M is
divisible by the world size. Rows leave out ``collective``, ``dtype`` and ``world_size``; they
come from the header (a row that states other values is refused). A row is a
``fo_kernels.schedule.Schedule``: common fields and one engine's ``settings``. A schema-1 file
(every engine's fields side by side in the row) is read by ``upgrade_v1_row`` and written back as
schema 2 by the next ``save_table``. A table keeps its rows sorted by (n, k, m or m_min) and
unique: two rows for one problem, or two overlapping M ranges of one (N, K), are refused with both
rows' indexes (``index``).

``lookup_schedule`` prefers, across every found file: a measured exact-shape row, a measured
M-range row, a predicted exact-shape row, a predicted M-range row (``row_kind``: a row whose
provenance says ``mode: predict`` came from the cost model alone; any other row was measured or
written by hand); between rows of the same kind, the folder order decides. Without a matching row
it returns ``overlap: false`` (GEMM then the collective, never slower than sequential) with a
``HeuristicScheduleWarning`` saying how to tune the shape (at world size 1, where the call is the
GEMM alone, without one). It reads a file as a ``LoadedTable``
(the header and every row's problem checked, a row built when first taken) and keeps it per
(path, inode, mtime, size), so an unchanged file is parsed once and a rewritten one
(``save_table`` renames) is read again. Its answer per call signature is kept for ``TABLE_RECHECK_S``: a layer
calling the op every step does not pay a filesystem round trip per GEMM (on H200 x2 that cost
0.3-0.45 ms a call, docs/design.md#tables), and a rewritten table is still picked up within
that time.
"""

from fo_kernels.table.checks import check_fingerprint, check_header_for
from fo_kernels.table.format import (
    SUPPORTED_SCHEMA_VERSIONS,
    TABLE_KIND,
    TABLE_SCHEMA_VERSION,
    ScheduleTable,
    TableHeader,
    load_table,
    row_kind,
    row_rank,
    save_table,
    upgrade_v1_row,
)
from fo_kernels.table.loaded import LoadedTable, read_table
from fo_kernels.table.lookup import MISS_SOURCE, TABLE_RECHECK_S, best_match, best_row, lookup_schedule
from fo_kernels.table.paths import (
    TABLE_DIR_ENV,
    table_dir_env_not_a_folder,
    table_filename,
    table_path,
    table_search_path,
    user_table_dir,
)

__all__ = [
    "MISS_SOURCE",
    "SUPPORTED_SCHEMA_VERSIONS",
    "TABLE_DIR_ENV",
    "TABLE_KIND",
    "TABLE_RECHECK_S",
    "TABLE_SCHEMA_VERSION",
    "LoadedTable",
    "ScheduleTable",
    "TableHeader",
    "best_match",
    "best_row",
    "check_fingerprint",
    "check_header_for",
    "load_table",
    "lookup_schedule",
    "read_table",
    "row_kind",
    "row_rank",
    "save_table",
    "table_dir_env_not_a_folder",
    "table_filename",
    "table_path",
    "table_search_path",
    "upgrade_v1_row",
    "user_table_dir",
]
