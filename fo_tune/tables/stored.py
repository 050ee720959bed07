"""Table rows kept in an Optuna study storage, so a fleet's workers share them: each search records
the rows it decides in the study they came from (``record_rows``), and ``best_records`` keeps
every study's best, for ``fo-tune table pull`` (``fo_tune.tables.pull``).

A record is a study user attribute: the table header the rows belong to (fingerprint, collective,
world size, dtype), the rows as a table file holds them, how many finished trials (or priced
points) the decision compared (``trials``), and when and where it was recorded. A shape's study
holds that shape's rows; the M-range rows of an ``--m-range`` search go to a study of their own
(``range_study_name``), since they come from several shapes' searches.

Several workers record in one study: a resumed or re-run search, or workers sharing one TPE study.
Optuna storages have no compare-and-set, so a worker that decided from fewer trials but records
later must not replace a better decision: each record is an attribute of its own,
``ROWS_ATTR:<random id>`` (setting one is one row's upsert in an RDB storage and one appended line
in a journal, so workers on many hosts record at once without a lock), and ``best_records`` takes,
per study, the record decided from the most trials, the latest recorded among equals. A record
under ``ROWS_ATTR`` itself (one key per study, no ``trials``) is read too, as decided from none.
"""

from __future__ import annotations

import datetime as dt
import socket
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fo_kernels.errors import ScheduleError, TableError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import Schedule
from fo_kernels.table.provenance import finite_only

# The study user attribute a record is kept under (each with its own ":<random id>" suffix: see the
# module docstring), and the record's kind and schema version.
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
    trials: int = 0  # the finished trials (or priced points) the rows were decided from
    key: str = ROWS_ATTR  # the study user attribute that holds the record

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
    *,
    trials: int,
) -> str | None:
    """Record ``rows`` (one table's: same collective, world size, dtype), decided from ``trials``
    finished trials (or priced points), in study ``study_name`` of ``storage``, creating the study
    when the search made none (an enumerated one). Returns the attribute that holds the record
    (a new one each call: see the module docstring), None when there are no rows."""
    import optuna

    if not rows:
        return None
    first = rows[0]
    record = {
        "kind": RECORD_KIND,
        "schema_version": RECORD_SCHEMA_VERSION,
        "fingerprint": fingerprint.to_dict(),
        "collective": first.collective,
        "world_size": first.world_size,
        "dtype": first.dtype,
        "rows": [{k: v for k, v in row.to_dict().items() if k not in _HEADER_KEYS} for row in rows],
        "trials": trials,
        "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds"),
        "host": socket.gethostname(),
    }
    key = f"{ROWS_ATTR}:{uuid.uuid4().hex[:16]}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=study_name, storage=storage, direction="minimize", load_if_exists=True
    )
    study.set_user_attr(key, record)
    return key


def is_record_key(key: str) -> bool:
    """Whether a study user attribute named ``key`` holds a record."""
    return key == ROWS_ATTR or key.startswith(f"{ROWS_ATTR}:")


def _measured_only(row: Schedule) -> Schedule:
    """``row`` with the NaN and infinite numbers of its provenance left out (``finite_only``): a
    record may hold one where its search measured nothing, as the search leaves it out of the rows
    it writes."""
    kept = finite_only(row.provenance)
    return row if len(kept) == len(row.provenance) else replace(row, provenance=kept)


def _check_one_table(where: str, fingerprint: Fingerprint, rows: Sequence[Schedule]) -> None:
    """``TableError`` (``where`` names the study and the attribute) unless ``rows`` are one table's:
    the first row's collective, world size and dtype in every row, that world size the
    fingerprint's. A pull checks it as it reads, so such a record stops it before any table is
    written (its merge would refuse the rows after the tables of earlier records were)."""
    first = rows[0]
    for i, row in enumerate(rows):
        for name in _HEADER_KEYS:
            if getattr(row, name) != getattr(first, name):
                raise TableError(
                    f"{where}: rows[{i}]: {name} {getattr(row, name)!r}, rows[0]'s is "
                    f"{getattr(first, name)!r} (a record holds one table's rows); delete the "
                    "attribute, or re-run that search"
                )
    if fingerprint.world_size != first.world_size:
        raise TableError(
            f"{where}: fingerprint.world_size {fingerprint.world_size} differs from the rows' world "
            f"size {first.world_size}; delete the attribute, or re-run that search"
        )


def _parse(study: str, key: str, record: Any) -> StoredRows:
    """A record read back; ``TableError`` naming the study and the attribute when it is malformed."""
    where = f"study {study!r}: {key}"
    if not isinstance(record, Mapping) or record.get("kind") != RECORD_KIND:
        raise TableError(f"{where}: not a fo-tune rows record; delete the attribute or the study")
    if record.get("schema_version") != RECORD_SCHEMA_VERSION:
        raise TableError(
            f"{where}: schema_version {record.get('schema_version')!r} is not {RECORD_SCHEMA_VERSION}; "
            "pull with the fo-tune version that recorded it, or re-run that search"
        )
    trials = record.get("trials", 0)
    if type(trials) is not int or trials < 0:
        raise TableError(
            f"{where}: trials {trials!r} is not a count; delete the attribute, or re-run that search"
        )
    try:
        fingerprint = Fingerprint.from_dict(record.get("fingerprint"))
        header = {name: record.get(name) for name in _HEADER_KEYS}
        rows = record.get("rows")
        if not isinstance(rows, list) or not rows:
            raise ScheduleError(f"rows: expected a non-empty list, got {rows!r}")
        schedules = tuple(_measured_only(Schedule.from_dict(row, defaults=header)) for row in rows)
    except (TableError, ScheduleError) as exc:
        raise TableError(f"{where}: {exc}") from None
    _check_one_table(where, fingerprint, schedules)
    return StoredRows(
        study=study,
        fingerprint=fingerprint,
        collective=schedules[0].collective,
        world_size=schedules[0].world_size,
        dtype=schedules[0].dtype,
        rows=schedules,
        recorded=str(record.get("recorded", "")),
        host=str(record.get("host", "")),
        trials=trials,
        key=key,
    )


def best_records(studies: Iterable[Any]) -> list[StoredRows]:
    """Per study (Optuna's ``FrozenStudy``, as ``get_all_studies`` lists them) the record decided
    from the most trials, the latest recorded among equals; oldest recorded first, studies without
    a record skipped. ``TableError`` naming the study and attribute for a malformed record."""
    best = []
    for study in studies:
        found = [
            _parse(study.study_name, key, value)
            for key, value in study.user_attrs.items()
            if is_record_key(key)
        ]
        if found:
            best.append(max(found, key=lambda r: (r.trials, r.recorded, r.key)))
    return sorted(best, key=lambda r: (r.recorded, r.study))
