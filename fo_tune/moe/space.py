"""MoE search spaces: ``search_spaces/moe/*.yaml``, what ``fo-tune search -c moe`` explores.

A file (``schema_version: 1``, ``kind: fo-tune-moe-search-space``)::

    name: hopper-moe
    compute_capability: ["9.0"]          # or ["*"]: any device
    tokens_per_rank: [128, 256, ...]     # the default M buckets (ascending)
    engines:                             # one section per MoE engine, by its exact name
      triton: {tiles: [...], sms_free: [...], nccl_max_ctas: [...], wait_modes: [...]}
      copy_engine: {chunks: [...]}

Each section's keys are its term's ``SPACE_KEYS`` (``fo_tune.engines.<engine>.moe``); every value
is a non-empty list (tiles as ``fo_kernels.tile.Tile`` mappings, the rest integers or names the
schedule checks when a point is built). Errors are ``SpaceError`` naming the file and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fo_kernels.errors import ScheduleError
from fo_kernels.files import read_yaml
from fo_kernels.tile import Tile
from fo_tune.space import ANY_DEVICE, SPACE_KIND, SpaceError, SpaceNotFoundError, packaged_spaces_dir

MOE_SPACE_KIND = "fo-tune-moe-search-space"
# What to do with a file that is not an MoE search space.
_GIVE_MOE_SPACE = "give an MoE search space (search_spaces/moe/hopper.yaml)"
MOE_SPACE_SCHEMA_VERSION = 1
# The folder of the MoE spaces under the search spaces' folder.
MOE_SPACE_FOLDER = "moe"
_TOP_KEYS = ("schema_version", "kind", "name", "compute_capability", "tokens_per_rank", "engines")


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeSpace:
    """One MoE search space file, checked."""

    name: str
    compute_capability: tuple[str, ...]
    tokens_per_rank: tuple[int, ...]
    engines: dict[str, dict[str, tuple[Any, ...]]] = field(default_factory=dict)
    source: str = ""


def _fail(source: str, path: str, why: str) -> SpaceError:
    return SpaceError(f"{source}: {path}: {why}")


def _ints(source: str, path: str, value: Any, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise _fail(source, path, "expected a non-empty list")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
            raise _fail(source, f"{path}[{i}]", f"expected an integer >= {minimum}, got {item!r}")
    return tuple(value)


def _section(source: str, engine: str, node: Any, keys: tuple[str, ...]) -> dict[str, tuple[Any, ...]]:
    path = f"engines.{engine}"
    if not isinstance(node, Mapping):
        raise _fail(source, path, "expected a mapping")
    unknown = sorted(str(k) for k in set(node) - set(keys))
    if unknown:
        raise _fail(source, path, f"unknown key(s) {', '.join(unknown)}; valid: {', '.join(keys)}")
    out: dict[str, tuple[Any, ...]] = {}
    for key, value in node.items():
        where = f"{path}.{key}"
        if key == "tiles":
            if not isinstance(value, list) or not value:
                raise _fail(source, where, "expected a non-empty list of tiles")
            try:
                out[key] = tuple(Tile.from_dict(t) for t in value)
            except (ScheduleError, TypeError) as exc:
                raise _fail(source, where, str(exc)) from None
        elif key == "wait_modes":
            if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                raise _fail(source, where, "expected a non-empty list of names")
            out[key] = tuple(value)
        else:
            out[key] = _ints(source, where, value, 0 if key in ("sms_free", "nccl_max_ctas") else 1)
    return out


def parse_moe_space(data: Any, source: str, space_keys: Mapping[str, tuple[str, ...]]) -> MoeSpace:
    """The space of a file's ``data``; ``space_keys``: every MoE engine's section keys, by name."""
    if not isinstance(data, Mapping):
        raise SpaceError(f"{source}: expected a mapping at the top level; {_GIVE_MOE_SPACE}")
    if data.get("kind") == SPACE_KIND:
        raise SpaceError(
            f"{source}: a dense search space (kind {SPACE_KIND!r}), not an MoE one; {_GIVE_MOE_SPACE}"
        )
    if data.get("kind") != MOE_SPACE_KIND or data.get("schema_version") != MOE_SPACE_SCHEMA_VERSION:
        raise SpaceError(
            f"{source}: expected kind {MOE_SPACE_KIND!r} schema_version {MOE_SPACE_SCHEMA_VERSION}, got "
            f"{data.get('kind')!r} {data.get('schema_version')!r}; {_GIVE_MOE_SPACE}"
        )
    unknown = sorted(str(k) for k in set(data) - set(_TOP_KEYS))
    if unknown:
        raise SpaceError(f"{source}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(_TOP_KEYS)}")
    caps = data.get("compute_capability")
    if not isinstance(caps, list) or not caps or not all(isinstance(c, str) for c in caps):
        raise _fail(source, "compute_capability", 'expected a non-empty list of strings ("9.0", "*")')
    tokens = _ints(source, "tokens_per_rank", data.get("tokens_per_rank"), 1)
    if list(tokens) != sorted(set(tokens)):
        raise _fail(source, "tokens_per_rank", "expected ascending, distinct values")
    engines = data.get("engines")
    if not isinstance(engines, Mapping) or not engines:
        raise _fail(source, "engines", "expected a mapping of engine name to its section")
    sections = {}
    for name, node in engines.items():
        if name not in space_keys:
            raise _fail(source, f"engines.{name}", f"not an MoE engine; valid: {', '.join(space_keys)}")
        sections[name] = _section(source, name, node, space_keys[name])
    return MoeSpace(
        name=str(data.get("name", "")),
        compute_capability=tuple(caps),
        tokens_per_rank=tokens,
        engines=sections,
        source=source,
    )


def load_moe_space(path: str | Path, space_keys: Mapping[str, tuple[str, ...]]) -> MoeSpace:
    """The MoE search space of the YAML file at ``path`` (``parse_moe_space``); ``SpaceNotFoundError`` when
    there is none."""
    data = read_yaml(
        path, error=SpaceError, missing=SpaceNotFoundError, missing_hint="no such MoE space file"
    )
    return parse_moe_space(data, str(path), space_keys)


def moe_space_for(
    compute_capability: str,
    space_keys: Mapping[str, tuple[str, ...]],
    folder: Path | None = None,
    *,
    device_key: str = "",
) -> MoeSpace:
    """The MoE space of ``folder`` (default: the packaged ``search_spaces/moe``) naming
    ``compute_capability``, else its catch-all (``["*"]``); ``SpaceNotFoundError`` when none, naming
    the spaces there as ``--space`` arguments (a CPU calibration's plan runs on Hopper's space) and
    ``device_key``, the calibration's machine, where given."""
    folder = folder if folder is not None else packaged_spaces_dir() / MOE_SPACE_FOLDER
    spaces = [load_moe_space(p, space_keys) for p in sorted(folder.glob("*.yaml"))]
    for wanted in (compute_capability, ANY_DEVICE):
        for space in spaces:
            if wanted in space.compute_capability:
                return space
    whose = f" (the calibration's machine, {device_key})" if device_key else ""
    listed = "; ".join(f"{s.source} for {', '.join(s.compute_capability)}" for s in spaces) or "none"
    pick = f"--space {spaces[0].source}" if spaces else "--space FILE"
    raise SpaceNotFoundError(
        f"no MoE search space for compute capability {compute_capability}{whose} in {folder} (it "
        f"holds: {listed}); plan with another GPU's space, e.g. {pick}, or add one whose "
        f"compute_capability lists {compute_capability!r} (see search_spaces/moe/hopper.yaml)"
    )
