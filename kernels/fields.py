"""Field checks shared by the schedule's dataclasses and the engines' settings: every error is a
``ScheduleError`` that names the field (``check_int`` takes another ``FoTuneError`` type for the
sizes of other dataclasses, e.g. ``ShapeError``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from fo_kernels.errors import ArgumentError, FoTuneError, ScheduleError

# The most values (scalars and containers, nested) a free-form record, a row's provenance, may hold
# written out: a search records about a dozen, while a YAML anchor whose aliases nest inside one
# another (an "anchor bomb") reads as a few lines and expands to billions when a reader prints or
# writes the row (`fo-tune table show` took minutes on one of 43 million values).
RECORD_MAX_VALUES = 10_000
# The types of a record's values that hold no others.
_SCALARS = frozenset((str, int, float, bool, type(None)))
# The type of a record's keys that needs no look at their names: text, as in JSON and CSV.
_TEXT_KEYS = frozenset((str,))


def check_record(name: str, value: Any) -> None:
    """Refuse ``value`` unless it is a mapping of at most ``RECORD_MAX_VALUES`` values written out
    (YAML aliases expanded; counting stops there), with a ``ScheduleError`` naming ``name``.
    A record of scalars (a search's) is passed in one look at its values' types: validating a
    100,000-row table checks 100,000 of them."""
    if not isinstance(value, Mapping):
        raise ScheduleError(f"{name}: expected a mapping, got {type(value).__name__}")
    text_keys = _TEXT_KEYS.issuperset(map(type, value))
    if len(value) <= RECORD_MAX_VALUES and text_keys and _SCALARS.issuperset(map(type, value.values())):
        return
    if not text_keys:
        _check_record_keys(name, value)
    stack = list(value.values())
    count = len(stack)
    while stack and count <= RECORD_MAX_VALUES:
        item = stack.pop()
        if isinstance(item, (Mapping, list, tuple)):
            items = item.values() if isinstance(item, Mapping) else item
            count += len(items)
            stack.extend(items)
    if count > RECORD_MAX_VALUES:
        raise ScheduleError(
            f"{name}: holds more than {RECORD_MAX_VALUES} values written out (YAML aliases expanded); "
            "keep it to what the search recorded, without anchors repeated inside one another"
        )


def _check_record_keys(name: str, value: Mapping[Any, Any]) -> None:
    """Refuse two keys of the record ``value`` that are one text (``7`` and ``"7"``, ``true`` and
    ``"True"``, as YAML reads a hand-written key): every place a record is shown names its keys by
    their text (a CSV column, a JSON key, ``fo-tune table show``'s lines), where one of the two
    would silently take the other's place. Renaming one column instead would leave a reader
    guessing which of two keys spelled alike is which; the record's writer knows."""
    names: dict[str, Any] = {}
    for key in value:
        first = names.setdefault(str(key), key)
        if first is not key:
            raise ScheduleError(
                f"{name}: the keys {first!r} and {key!r} read as one name, {str(key)!r}, in every file "
                "and column a record is shown in; keep one of them, or rename one"
            )


def is_pow2(x: int) -> bool:
    """Whether ``x`` is a positive power of two."""
    return x > 0 and (x & (x - 1)) == 0


def check_int(name: str, value: Any, *, minimum: int, error: type[FoTuneError] = ScheduleError) -> int:
    """``value`` when it is an int (not a bool) >= ``minimum``, else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise error(f"{name}: must be >= {minimum}, got {value}")
    return value


def check_bool(name: str, value: Any, *, error: type[FoTuneError] = ArgumentError) -> bool:
    """``value`` if it is a bool (numpy's too); anything else, which Python would read as true or
    false by its truthiness (``"no"`` as true), raises ``error`` naming the field."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise error(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` when it is one of ``choices``, else ``ScheduleError`` naming ``name`` and listing them."""
    if value not in choices:
        raise ScheduleError(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return value


@functools.cache
def field_names(cls: type) -> tuple[str, ...]:
    """The field names of dataclass ``cls``, in order (asked once per class: a table load asks per
    row)."""
    return tuple(f.name for f in fields(cls))


@functools.cache
def init_names(cls: type) -> tuple[str, ...]:
    """The field names of dataclass ``cls`` its constructor takes, in order (not those it derives,
    ``MoeSchedule.op_text``)."""
    return tuple(f.name for f in fields(cls) if f.init)


def from_mapping(cls: type, data: Any, where: str) -> Any:
    """``cls(**data)`` for a mapping of ``cls``'s field names; ``ScheduleError`` at ``where`` for another
    type, an unknown key (listing the valid ones) or a missing one."""
    if data is None:  # (a key left out, or left empty, in a hand-edited file)
        raise ScheduleError(f"{where}: missing; give a mapping of {', '.join(init_names(cls))}")
    if not isinstance(data, Mapping):
        raise ScheduleError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = init_names(cls)
    unknown = sorted(key for key in data if key not in known)
    if unknown:
        raise ScheduleError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; valid: {sorted(known)}")
    try:
        return cls(**data)
    except TypeError as exc:  # a missing required key: say which, as a field, not as Python's argument
        missing = [name for name in required_names(cls) if name not in data]
        raise ScheduleError(
            f"{where}: missing key(s) {', '.join(missing)}" if missing else f"{where}: {exc}"
        ) from None


@functools.cache
def required_names(cls: type) -> tuple[str, ...]:
    """The fields of dataclass ``cls`` that its constructor needs (no default)."""
    return tuple(
        f.name for f in fields(cls) if f.init and f.default is MISSING and f.default_factory is MISSING
    )


def check_weights(name: str, value: Any) -> tuple[int, ...]:
    """``value`` (a non-empty list or tuple of ints >= 1) as a tuple, else ``ScheduleError`` naming
    ``name``."""
    if not isinstance(value, (list, tuple)):
        raise ScheduleError(f"{name}: expected a list of integers, got {value!r}")
    out = tuple(value)
    if not out:
        raise ScheduleError(f"{name}: needs at least one entry")
    for i, g in enumerate(out):
        check_int(f"{name}[{i}]", g, minimum=1)
    return out
