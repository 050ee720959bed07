"""What the benchmark scripts in ``bench/`` hand to ``fo-tune``, read from the repository's files.

    python -m fo_tune.bench.script_inputs shapes suites/h200_profile.yaml
        the suite's shapes, one MxNxK a line (a shell loop's ``fo-tune profile --shape`` values)
    python -m fo_tune.bench.script_inputs space search_spaces/hopper.yaml OUT.yaml \\
            [--sms-free 0,8,12,16] [--ring-chunks 1,2,4]
        the space with the Triton engine's ``sms_free`` replaced (the grids ``fo-tune profile``
        times) or the copy engine's ring chunks replaced and its weightings dropped (what an
        M-range search offers), validated, written as a schema-2 file

A narrowed space keeps everything else of its base file (tiles first of all), so a bench run
follows the shipped space as it changes. Bad input (a missing file, a list the space's rules
refuse, an engine the space leaves out) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fo_kernels.errors import FoTuneError
from fo_kernels.files import atomic_write

from ..space import SearchSpace, SpaceError, load_space
from .suite import load_suite

__all__ = ["main", "narrow_space", "shape_args", "write_space"]


def shape_args(suite_path: str | Path) -> list[str]:
    """The suite's shapes (not its odd shapes) as ``MxNxK`` strings, in file order."""
    return ["x".join(map(str, shape)) for shape in load_suite(suite_path).shapes]


def _document(space: SearchSpace) -> dict[str, Any]:
    """``space.to_dict()`` as a file holds it: a copy-engine mode without weightings has no
    ``weights`` key (``to_dict`` writes an empty list, which a space file may not hold)."""
    data = space.to_dict()
    for mode in data["engines"].get("copy_engine", {}).values():
        if mode.get("weights") == []:
            del mode["weights"]
    return data


def narrow_space(
    space: SearchSpace,
    *,
    sms_free: Sequence[int] | None = None,
    ring_chunks: Sequence[int] | None = None,
) -> SearchSpace:
    """``space`` with the Triton engine's ``sms_free`` and/or the copy engine's ring ``chunks``
    replaced (the ring's ``weights`` dropped: only equal chunks are left), validated again.

    The calibration's ``quick_interference_sms_free`` must stay within ``sms_free``: it keeps the
    values that are, else the largest new one. A replaced list names an engine the space has."""
    data = _document(space)
    engines = data["engines"]
    if sms_free is not None:
        if "triton" not in engines:
            raise SpaceError(f"{space.source}: engines.triton: missing; --sms-free needs it")
        engines["triton"]["sms_free"] = list(sms_free)
        quick = data["calibration"]["quick_interference_sms_free"]
        kept = [r for r in quick if r in sms_free]
        data["calibration"]["quick_interference_sms_free"] = kept or [max(sms_free, default=0)]
    if ring_chunks is not None:
        if "ring" not in engines.get("copy_engine", {}):
            raise SpaceError(f"{space.source}: engines.copy_engine.ring: missing; --ring-chunks needs it")
        engines["copy_engine"]["ring"] = {"chunks": list(ring_chunks)}
    return SearchSpace.from_dict(data, source=f"{space.source} (narrowed)")


def write_space(space: SearchSpace, path: str | Path, *, header: str) -> Path:
    """Write ``space`` as a YAML file (atomically), ``header`` as its leading comment lines."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    text = comment + yaml.safe_dump(_document(space), sort_keys=False, width=110)
    return atomic_write(path, lambda f: f.write(text))


def _integers(text: str) -> list[int]:
    """``"0,8,12"`` -> ``[0, 8, 12]`` (argparse's type: a bad value is a usage error)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers joined by commas, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fo_tune.bench.script_inputs", description=__doc__.splitlines()[0]
    )
    sub = ap.add_subparsers(dest="command", required=True)
    shapes = sub.add_parser("shapes", help="print a suite's shapes, one MxNxK a line")
    shapes.add_argument("suite", type=Path)
    space = sub.add_parser("space", help="write a search space with fewer grids or ring chunks")
    space.add_argument("base", type=Path, help="the search space to start from")
    space.add_argument("out", type=Path, help="the YAML file to write")
    space.add_argument("--sms-free", type=_integers, metavar="R,R,...", help="the Triton engine's sms_free")
    space.add_argument("--ring-chunks", type=_integers, metavar="C,C,...", help="the ring mode's chunks")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The command line above; returns the exit code (0, or 2 for bad input)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "shapes":
            print("\n".join(shape_args(args.suite)))
            return 0
        base = load_space(args.base)
        narrowed = narrow_space(base, sms_free=args.sms_free, ring_chunks=args.ring_chunks)
        changes = [
            f"{name} {','.join(map(str, value))}"
            for name, value in (("--sms-free", args.sms_free), ("--ring-chunks", args.ring_chunks))
            if value is not None
        ]
        header = f"{args.base} narrowed ({'; '.join(changes) or 'unchanged'}) by fo_tune.bench.script_inputs"
        write_space(narrowed, args.out, header=header)
    except FoTuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
