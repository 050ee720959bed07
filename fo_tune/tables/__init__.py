"""The tuner's side of the schedule tables: ``merge`` (rows into a table file under a lock),
``validate`` (the checks that need a shape), ``diff`` (two tables compared), ``find`` (the row the
runtime would use, table files in its search path), ``kinds`` (a dense or an MoE table file),
``moe_validate`` and ``moe_diff`` (the MoE tables' checks and comparison).

The runtime (``fo_kernels.table``) owns the file format, loading, saving and the lookup; this
package owns what only the tuner and the ``fo-tune table`` commands need.
"""

from fo_tune.tables.diff import (
    DIFF_STATUSES,
    LATENCY_KEYS,
    SCHEDULE_FIELDS,
    DiffStatus,
    RowDiff,
    changed_fields,
    diff_tables,
    field_value,
    header_differences,
    latencies,
)
from fo_tune.tables.find import find_moe_row, find_moe_tables, find_row, find_tables, known_device_keys
from fo_tune.tables.kinds import TableKind, is_moe_name, load_any_table, table_kind
from fo_tune.tables.merge import LOCK_SUFFIX, LOCK_TIMEOUT_S, TableLockTimeout, lock_path, merge_rows
from fo_tune.tables.moe_diff import MoeRowDiff, diff_moe_tables, moe_header_differences
from fo_tune.tables.moe_validate import validate_moe_table
from fo_tune.tables.validate import validate_table

__all__ = [
    "DIFF_STATUSES",
    "LATENCY_KEYS",
    "LOCK_SUFFIX",
    "LOCK_TIMEOUT_S",
    "SCHEDULE_FIELDS",
    "DiffStatus",
    "MoeRowDiff",
    "RowDiff",
    "TableKind",
    "TableLockTimeout",
    "changed_fields",
    "diff_moe_tables",
    "diff_tables",
    "field_value",
    "find_moe_row",
    "find_moe_tables",
    "find_row",
    "find_tables",
    "header_differences",
    "is_moe_name",
    "known_device_keys",
    "latencies",
    "load_any_table",
    "lock_path",
    "merge_rows",
    "moe_header_differences",
    "table_kind",
    "validate_moe_table",
    "validate_table",
]
