"""A table's header checked against what reads it: ``check_header_for`` (the call's collective, dtype
and world size: a file copied under another table's name) and ``check_fingerprint`` (the device's
compute capability and world size refused, another device key or library versions warned of),
for the dense tables and the MoE table alike."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from fo_kernels.errors import TableError, VersionDriftWarning
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.table.paths import table_filename, where_it_belongs

if TYPE_CHECKING:
    from fo_kernels.table.format import ScheduleTable, TableHeader


def check_header_for(
    header: ScheduleTable | TableHeader, *, collective: str, dtype: str, world_size: int, source: str
) -> None:
    """Refuse a table whose header is not for a call of ``collective``, ``dtype`` and
    ``world_size`` (a file copied under another table's name): what ``lookup_schedule`` and
    ``fo-tune table lookup`` check of every file they read (``TableError`` naming ``source``)."""
    name = table_filename(header.collective, header.world_size, header.dtype)
    fix = where_it_belongs(source, header.fingerprint.device_key, name)
    if (header.collective, header.dtype) != (collective, dtype):
        raise TableError(
            f"{source}: holds {header.collective} {header.dtype} rows, expected {collective} {dtype}; "
            f"lookup reads it for the calls its name says and refuses it; {fix}"
        )
    if header.world_size != world_size or header.fingerprint.world_size != world_size:
        raise TableError(
            f"table {source} is for world size {header.world_size}, this job has {world_size}; {fix}, "
            f"and tune one for world size {world_size} with `fo-tune search`"
        )


def check_fingerprint(table: ScheduleTable | TableHeader, current: Fingerprint, *, source: str) -> None:
    """Refuse a table for another compute capability or another world size; warn once where it was
    tuned on another device key (the same capability) and once on library version drift."""
    theirs = table.fingerprint
    collective = getattr(table, "collective", None)  # (None: an MoE table)
    name = (
        f"moe-w{table.world_size}-{table.dtype}.yaml"
        if collective is None
        else table_filename(collective, table.world_size, table.dtype)
    )
    fix = where_it_belongs(source, theirs.device_key, name)
    fix += ", and " if fix else ""  # (none where it sits where its fingerprint says it belongs)
    if theirs.compute_capability != current.compute_capability:
        raise TableError(
            f"table {source} is for compute capability {theirs.compute_capability} ({theirs.gpu_name}), "
            f"this device is {current.compute_capability} ({current.gpu_name}); {fix}tune one for this "
            "GPU with `fo-tune search`"
        )
    if table.world_size != current.world_size or theirs.world_size != current.world_size:
        raise TableError(
            f"table {source} is for world size {table.world_size}, this job has {current.world_size}; "
            f"{fix}tune one for world size {current.world_size} with `fo-tune search`"
        )
    if theirs.device_key != current.device_key:  # another GPU model, SM count or interconnect
        warnings.warn(
            f"table {source} was tuned on device key {theirs.device_key}, this device is "
            f"{current.device_key}: of the same compute capability, so lookup uses it, but its "
            "schedules may not be the fastest here; tune this device's with `fo-tune search`",
            VersionDriftWarning,
            stacklevel=2,
        )
    ours = current.versions()
    drift = [
        f"{name} {old} (now {ours[name]})" for name, old in theirs.versions().items() if old != ours[name]
    ]
    if drift:
        warnings.warn(
            f"table {source} was measured with {', '.join(drift)}; its schedules may no longer be the "
            "fastest, re-tune with `fo-tune search`",
            VersionDriftWarning,
            stacklevel=2,
        )
