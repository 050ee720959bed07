"""A row's provenance checked for what no search records: a NaN or infinite number
(``check_finite_provenance``, called where a table is read whole, as the tuner reads it, and where
a row joins one; the runtime's lookup builds only the rows it takes and ignores their provenance),
and such numbers left out of what a search records (``finite_only``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fo_kernels.errors import ScheduleError


def _non_finite(value: Any, path: str) -> str | None:
    """The path of the first NaN or infinite float in ``value`` (nested mappings and lists)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, Mapping):
        items = [(f"{path}.{key}", item) for key, item in value.items()]
    else:
        items = (
            [(f"{path}[{i}]", item) for i, item in enumerate(value)]
            if isinstance(value, (list, tuple))
            else []
        )
    return next((found for where, item in items if (found := _non_finite(item, where))), None)


# The types of a provenance value that hold no float (a search's record is these and floats).
_NO_FLOAT = frozenset((str, int, bool, type(None)))


def check_finite_provenance(provenance: Mapping[str, Any]) -> None:
    """Refuse a NaN or infinite number in a row's provenance (``ScheduleError`` naming it): what a
    search records there is finite, and a NaN read back spoils every sum and ranking (``MAPE
    nan%``). One look at each scalar (``x - x`` is 0.0 for a finite float, else NaN)."""
    for value in provenance.values():
        kind = value.__class__
        if (kind is float and value - value) or (kind is not float and kind not in _NO_FLOAT):
            where = _non_finite(provenance, "provenance")
            if where is not None:
                raise ScheduleError(f"{where}: not a finite number; write the number, or remove the key")
            return


def finite_only(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without its NaN and infinite floats: a number a search did not measure (the
    interquartile range of one sample), which no table takes."""
    return {key: v for key, v in values.items() if not (isinstance(v, float) and not math.isfinite(v))}
