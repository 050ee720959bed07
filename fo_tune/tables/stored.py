"""Table rows kept in an Optuna study storage, so a fleet's workers share them: each search records
the rows it decides in the study they came from (``record_rows``), and ``stored_rows`` reads back
every study's, for ``fo-tune table pull`` (``fo_tune.tables.pull``).

A record is the study's user attribute ``ROWS_ATTR``: the table header the rows belong to
(fingerprint, collective, world size, dtype), the rows as a table file holds them, and when they
were recorded. A shape's study holds that shape's row; the M-range rows of an ``--m-range``
search go to a study of their own (``range_study_name``), since they come from several shapes'
searches. Recording again (a resumed or re-run search, or another worker on the same study)
replaces the study's record: the latest decision from those trials. Setting one study attribute
is one row's upsert in an RDB storage and one appended line in a journal, so workers on many
hosts record at once without a lock.
"""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fo_kernels.errors import ScheduleError, TableError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import Schedule

# The study user attribute that holds a record, and the record's kind and schema version.
ROWS_ATTR = "fo_tune_table_rows"
RECORD_KIND = "fo-tune-table-rows"
RECORD_SCHEMA_VERSION = 1
# Row keys the record's header owns (as in a table file).
_HEADER_KEYS = ("collective", "dtype", "world_size")


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredRows:
    """One study's record: the rows, the header they belong to, when and where they were recorded."""

    study: str
    fingerprint: Fingerprint
    collective: str
    world_size: int
    dtype: str
    rows: tuple[Schedule, ...]
    recorded: str  # ISO 8601, UTC
    host: str

    @property
    def table_key(self) -> tuple[str, str, int, str]:
        """(device key, collective, world size, dtype): the table file the rows go to."""
        return (self.fingerprint.device_key, self.collective, self.world_size, self.dtype)


def range_study_name(shape_study: str, problem_text: str) -> str:
    """The study of an M-range search's rows for one (N, K): a shape's study name,
    ``<collective>-w<W>-<dtype>-<MxNxK>-<mode>-<digest>`` (the digest covers space, machine and
    model), with the shape replaced by ``m<problem_text>`` (the span, ``[m_min,m_max]xNxK``)."""
    parts = shape_study.split("-")
    parts[3] = f"m{problem_text}"
    return "-".join(parts)


def record_rows(
    storage: Any,
    study_name: str,
    fingerprint: Fingerprint,
    rows: Sequence[Schedule],
) -> None:
    """Record ``rows`` (one table's: same collective, world size, dtype) as study ``study_name``'s
    record in ``storage``, creating the study when the search made none (an enumerated one)."""
    import optuna

    if not rows:
        return
    first = rows[0]
    record = {
        "kind": RECORD_KIND,
        "schema_version": RECORD_SCHEMA_VERSION,
        "fingerprint": fingerprint.to_dict(),
        "collective": first.collective,
        "world_size": first.world_size,
        "dtype": first.dtype,
        "rows": [{k: v for k, v in row.to_dict().items() if k not in _HEADER_KEYS} for row in rows],
        "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds"),
        "host": socket.gethostname(),
    }
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=study_name, storage=storage, direction="minimize", load_if_exists=True
    )
    study.set_user_attr(ROWS_ATTR, record)


def _parse(study: str, record: Any) -> StoredRows:
    """A record read back; ``TableError`` naming the study when it is malformed."""
    where = f"study {study!r}: {ROWS_ATTR}"
    if not isinstance(record, Mapping) or record.get("kind") != RECORD_KIND:
        raise TableError(f"{where}: not a fo-tune rows record; delete the attribute or the study")
    if record.get("schema_version") != RECORD_SCHEMA_VERSION:
        raise TableError(
            f"{where}: schema_version {record.get('schema_version')!r} is not {RECORD_SCHEMA_VERSION}; "
            "pull with the fo-tune version that recorded it, or re-run that search"
        )
    try:
        fingerprint = Fingerprint.from_dict(record.get("fingerprint"))
        header = {key: record.get(key) for key in _HEADER_KEYS}
        rows = record.get("rows")
        if not isinstance(rows, list) or not rows:
            raise ScheduleError(f"rows: expected a non-empty list, got {rows!r}")
        schedules = tuple(Schedule.from_dict(row, defaults=header) for row in rows)
    except (TableError, ScheduleError) as exc:
        raise TableError(f"{where}: {exc}") from None
    return StoredRows(
        study=study,
        fingerprint=fingerprint,
        collective=schedules[0].collective,
        world_size=schedules[0].world_size,
        dtype=schedules[0].dtype,
        rows=schedules,
        recorded=str(record.get("recorded", "")),
        host=str(record.get("host", "")),
    )


def stored_rows(storage: Any) -> list[StoredRows]:
    """Every study's record in ``storage``, oldest recorded first (studies without one are
    skipped); ``TableError`` naming the study for a malformed record."""
    records = [
        _parse(study.study_name, study.user_attrs[ROWS_ATTR])
        for study in storage.get_all_studies()
        if ROWS_ATTR in study.user_attrs
    ]
    return sorted(records, key=lambda r: (r.recorded, r.study))
