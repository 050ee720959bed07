"""Search space files: reading one (``load_space``) and choosing the one for a device (``space_for``)."""

from __future__ import annotations

from pathlib import Path

from fo_kernels.files import read_yaml
from fo_tune.space.core import ANY_DEVICE, SearchSpace, SpaceError, SpaceNotFoundError

__all__ = ["load_space", "packaged_spaces_dir", "space_for"]


def packaged_spaces_dir() -> Path:
    """The repository's ``search_spaces/`` folder (beside the ``fo_tune`` package)."""
    return Path(__file__).resolve().parents[2] / "search_spaces"


def load_space(path: str | Path) -> SearchSpace:
    """Read and validate one search space file."""
    data = read_yaml(
        path,
        error=SpaceError,
        missing=SpaceNotFoundError,
        missing_hint=f"no search space file here; the shipped ones are in {packaged_spaces_dir()}",
        bad_hint=f"fix it, or give one of {packaged_spaces_dir()}",
    )
    return SearchSpace.from_dict(data, source=str(path))


def space_for(compute_capability: str, *, directory: Path | None = None) -> SearchSpace:
    """The space of ``directory`` (default: the packaged one) that names ``compute_capability``
    (``"9.0"``), else its catch-all (``compute_capability: ["*"]``); ``"cpu"`` gets the catch-all.

    Every ``*.yaml`` there is loaded and validated; two files naming the same device are an error.
    """
    folder = Path(directory) if directory is not None else packaged_spaces_dir()
    if not folder.is_dir():
        raise SpaceNotFoundError(f"{folder}: no such folder of search spaces")
    spaces = [load_space(p) for p in sorted(folder.glob("*.yaml"))]
    named = [s for s in spaces if compute_capability in s.compute_capability and compute_capability != "*"]
    catch_all = [s for s in spaces if ANY_DEVICE in s.compute_capability]
    for matches in (named, catch_all):
        if len(matches) > 1:
            files = " and ".join(s.source for s in matches)
            raise SpaceError(f"{folder}: compute_capability: {files} both apply to {compute_capability!r}")
        if matches:
            return matches[0]
    raise SpaceNotFoundError(
        f"{folder}: no search space for compute capability {compute_capability!r} and no catch-all "
        f'file (compute_capability: ["*"], as the shipped default.yaml)'
    )
