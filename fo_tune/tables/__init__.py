"""The tuner's side of the schedule tables: ``merge`` (rows into a table file under a lock),
``validate`` (the checks that need a shape), ``diff`` (two tables compared), ``find`` (the row the
runtime would use, table files in its search path).

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
from fo_tune.tables.find import find_row, find_tables, known_device_keys
from fo_tune.tables.merge import LOCK_SUFFIX, LOCK_TIMEOUT_S, TableLockTimeout, lock_path, merge_rows
from fo_tune.tables.validate import validate_table

__all__ = [
    "DIFF_STATUSES",
    "LATENCY_KEYS",
    "LOCK_SUFFIX",
    "LOCK_TIMEOUT_S",
    "SCHEDULE_FIELDS",
    "DiffStatus",
    "RowDiff",
    "TableLockTimeout",
    "changed_fields",
    "diff_tables",
    "field_value",
    "find_row",
    "find_tables",
    "header_differences",
    "known_device_keys",
    "latencies",
    "lock_path",
    "merge_rows",
    "validate_table",
]
