"""Benchmark suite files (``suites/*.yaml``): name, dtype, shapes and odd shapes, validated on load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fo_kernels.errors import FoTuneError
from fo_kernels.files import read_yaml
from fo_kernels.schedule import DTYPES

Shape = tuple[int, int, int]
# The keys of a suite file; `fo-tune search --shapes` reads the same files and refuses any other key.
SUITE_KEYS = ("name", "dtype", "shapes", "odd_shapes")
# The key of an MoE suite (suites/moe/experts.yaml, which `fo-tune search -c moe` reads) in place of
# a suite's shapes.
MOE_SUITE_KEY = "models"


class SuiteError(FoTuneError, ValueError):
    """A suite file that is malformed; the message names the file and the key."""


class SuiteNotFoundError(SuiteError, FileNotFoundError):
    """A suite file that does not exist."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Suite:
    """A benchmark suite file (``suites/*.yaml``): name, dtype, shapes, and odd shapes beside them."""

    name: str
    dtype: str | None
    shapes: tuple[Shape, ...]
    odd_shapes: tuple[Shape, ...] = ()


def packaged_suite() -> Path:
    """The repository's benchmark suite (``suites/h200_tp.yaml``, five shapes, docs/design.md#the-card)."""
    return Path(__file__).resolve().parents[2] / "suites" / "h200_tp.yaml"


def _suite_shapes(data: dict, key: str, source: str) -> tuple[Shape, ...]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise SuiteError(f"{source}: {key}: expected a list of [M, N, K], got {value!r}")
    shapes = []
    for i, item in enumerate(value):
        ok = isinstance(item, list) and len(item) == 3
        if not ok or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in item):
            raise SuiteError(f"{source}: {key}[{i}]: expected [M, N, K] with integers >= 1, got {item!r}")
        shapes.append((item[0], item[1], item[2]))
    return tuple(shapes)


def suite_keys_refusal(data: object, source: str) -> str | None:
    """The refusal of the file ``source`` whose YAML is ``data`` where a suite goes, by its keys:
    an MoE suite (its models, no shapes), naming the command that reads it, or a key no suite has
    (a misspelt ``dtype:`` would run another dtype); None otherwise."""
    if not isinstance(data, dict):
        return None
    if MOE_SUITE_KEY in data and "shapes" not in data:
        return (
            f"{source}: an MoE suite ({MOE_SUITE_KEY}:), which `fo-tune search -c moe --shapes` reads; "
            f"give a suite of shapes: [M, N, K], e.g. {packaged_suite()}"
        )
    unknown = sorted(set(data) - set(SUITE_KEYS))
    return f"{source}: unknown key {unknown[0]!r}; known: {', '.join(SUITE_KEYS)}" if unknown else None


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite file; errors name the file and the key."""
    source = str(path)
    data = read_yaml(
        path,
        error=SuiteError,
        missing=SuiteNotFoundError,
        missing_hint=f"no suite file here; the shipped one is {packaged_suite()}",
        bad_hint=f"fix it, or give the shipped {packaged_suite()}",
    )
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: expected a mapping with name, dtype and shapes")
    if (refusal := suite_keys_refusal(data, source)) is not None:
        raise SuiteError(refusal)
    dtype = data.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise SuiteError(f"{source}: dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    shapes = _suite_shapes(data, "shapes", source)
    if not shapes:
        raise SuiteError(f"{source}: shapes: no shapes given")
    name = data.get("name", Path(path).stem)
    return Suite(
        name=str(name), dtype=dtype, shapes=shapes, odd_shapes=_suite_shapes(data, "odd_shapes", source)
    )
