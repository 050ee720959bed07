"""What a predicting search says when its calibration lacks a measurement (another dtype's GEMM
profile, a collective's bandwidth curve): the commands that measure it on the calibration's GPUs
into a file the user owns (the file it was read from, or a copy of a packaged one named after its
device key) and the search to run then, and that a machine without such GPUs cannot (``fo-tune
calibrate --into`` refuses another GPU's measurements: ``fo_tune.calibrate.run.check_mergeable``).
A calibration read from no file (measured in memory) is first written to a file by the command that
measures it; an extrapolated one's gaps go into its measured origin's file, measured at that world
size (the GEMM profile on one GPU, the copy engine's section on two), never at the world size it
stands in for. The engines' missing sections are answered the same way (``measure_into``), and the
rows a plan lacks measurements for name the commands that measure them (``measured_rows``).
``fo-tune calibrate --dtype D`` for more than the GEMM profile is answered the same way
(``gemm_only_refusal``). Also where the packaged calibrations are (``packaged_root``)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: the calibration's refusals use this module)
    from fo_tune.calibrate.calibration import Calibration


def packaged_root() -> Path | None:
    """The folder of the packaged calibrations (``fo_results/calibration``), None without one."""
    try:
        root = Path(str(resources.files("fo_results") / "calibration"))
    except (ModuleNotFoundError, TypeError):
        return None
    return root if root.is_dir() else None


@dataclass(frozen=True)
class _Target:
    """Where a missing measurement of a calibration is merged: its file, or for a packaged one (or
    one read from no file) a file the user owns, named after its device key; ``steps``: the
    command that makes that file, if any; ``dest``: the file, as the refusal names it."""

    named: str  # the calibration, as the refusal names it
    into: str  # shell-quoted
    steps: str
    dest: str


def _target(cal: Calibration) -> _Target:
    if cal.origin is not None:  # (an extrapolation: its measured calibration takes what it lacks)
        t = _target(cal.origin)
        return _Target(f"{t.named} extrapolated to world size {cal.world_size}", t.into, t.steps, t.dest)
    fp, source = cal.fingerprint, Path(cal.file) if cal.file else None
    root = packaged_root()
    packaged = source is not None and root is not None and source.resolve().is_relative_to(root.resolve())
    what = f"({fp.device_key}, {cal.base_dtype or cal.dtype})"
    if source is not None and not packaged:
        return _Target(f"the calibration {source} {what}", shlex.quote(str(source)), "", "that file")
    own = shlex.quote(f"{fp.device_key}.yaml")
    if source is None:  # (made in memory: its machine measures one into a folder named for it)
        folder, steps = _new_calibration(fp.world_size, fp.device_key)
        into = shlex.quote(f"{folder}/calibration.yaml")
        return _Target(f"the calibration {what}, read from no file,", into, steps, "a file of its own")
    steps = f"`cp {shlex.quote(str(source))} {own}`, then "
    return _Target(f"the packaged calibration {source} {what}", own, steps, "a copy you own")


def _new_calibration(world_size: int, name: str) -> tuple[str, str]:
    """(the folder, the step that measures a calibration into it): ``fo-tune calibrate --out``
    writes ``<folder>/calibration.yaml``."""
    folder = f"calibration-{name}"
    return folder, f"`fo-tune calibrate --world-size {world_size} --out {shlex.quote(folder)}`, then "


def missing_profile(cal: Calibration, dtype: str) -> str:
    """Why a predicting search in ``dtype`` whose calibration has no GEMM profile in that dtype is
    refused, and the commands that add one to a file the user owns (a copy of a packaged
    calibration) and search with it. The profile is measured on one GPU of the calibration's model,
    or of the same die with ``--into-sibling`` (``fo_tune.calibrate.run.check_mergeable``): a
    machine without one merges ``fo-tune profile`` CSVs measured on one (``--from-profiles``)."""
    t = _target(cal)
    return (
        f"{t.named} has no {dtype} GEMM profile. Measure it on one GPU of its model "
        f"({cal.fingerprint.gpu_name}; on another GPU of the same die add --into-sibling) into "
        f"{t.dest}: {t.steps}`fo-tune calibrate --world-size 1 "
        f"--only gemm --dtype {dtype} --into {t.into}`; then run this search again with "
        f"`--calibration {t.into}`. A machine without such a GPU cannot measure it (calibrate refuses "
        "to merge another GPU's measurements); it merges the CSVs of fo-tune profile run on one "
        f"instead: `fo-tune calibrate --world-size 1 --only gemm --dtype {dtype} --from-profiles DIR "
        f"--into {t.into}` (with --into-sibling for another GPU of the same die)"
    )


def missing_curves(cal: Calibration, collectives: Sequence[str]) -> str:
    """ "" when ``cal`` has a bandwidth curve of each of ``collectives``; else what it lacks (the
    fallback every row is decided against is GEMM then the collective), and the commands that
    measure it on the GPUs of its machine into a file the user owns and search with it."""
    measured = {b.collective for b in cal.bandwidth}
    lacking = [c for c in collectives if c not in measured]
    if not lacking:
        return ""
    t, source = _target(cal), cal.origin or cal  # (an extrapolation's curves: its origin's, scaled)
    return (
        f"{t.named} has no bandwidth curve for {', '.join(lacking)}. Measure it on "
        f"{source.world_size} GPUs of its model ({cal.fingerprint.gpu_name}) into {t.dest}: {t.steps}"
        f"`{curve_command(source, lacking, t.into)}`; then run this search again with `--calibration "
        f"{t.into}`. A machine without such GPUs cannot measure it (calibrate refuses to merge another "
        "machine's measurements)"
    )


def measure_into(cal: Calibration, command: str, gpus: str) -> str:
    """Where and how a part ``cal`` lacks is measured: ``command`` (``fo-tune calibrate
    --world-size W --only PART``, run on ``gpus``, e.g. "two GPUs", of its model) merged with
    ``--into`` into the file the user owns (for an extrapolation, its measured calibration's: the
    part is measured at that world size, never at the one extrapolated to), and the option that
    reads it then."""
    t = _target(cal)
    again = f" (at --world-size {cal.world_size} it is extrapolated again)" if cal.origin else ""
    return (
        f"{t.named} lacks it: measure it on {gpus} of its model ({cal.fingerprint.gpu_name}) into "
        f"{t.dest}: {t.steps}`{command} --into {t.into}`; then pass `--calibration {t.into}`{again}"
    )


def measured_rows(world_size: int, dtype: str) -> str:
    """The commands that make measured rows of a table of ``world_size`` GPUs in ``dtype``, run on
    such GPUs: a calibration of them (in another dtype than bfloat16, one measured into a folder of
    its own, then its GEMM profile in ``dtype`` added) and the search that reads it."""
    search = f"fo-tune search --world-size {world_size}"
    if dtype == "bfloat16":
        return f"`fo-tune calibrate --world-size {world_size}` and `{search}`"
    folder, steps = _new_calibration(world_size, f"w{world_size}")
    into = shlex.quote(f"{folder}/calibration.yaml")
    return (
        f"{steps}`fo-tune calibrate --world-size 1 --only gemm --dtype {dtype} --into {into}` and "
        f"`{search} --dtype {dtype} --calibration {into}`"
    )


def curve_command(cal: Calibration, collectives: Sequence[str], into: str) -> str:
    """The command that measures ``cal``'s bandwidth curves with ``collectives`` added and merges
    them into ``into`` (``--into`` replaces the whole bandwidth section, so it names every
    collective the section keeps)."""
    names = ",".join(dict.fromkeys([*(b.collective for b in cal.bandwidth), *collectives]))
    return (
        f"fo-tune calibrate --world-size {cal.world_size} --dtype {cal.base_dtype or cal.dtype} "
        f"--only bandwidth --collectives {names} --into {into}"
    )


def gemm_only_refusal(dtype: str, world_size: int) -> str:
    """Why ``fo-tune calibrate --dtype D`` (D measured for its GEMM profile only) is refused for more
    parts, and the commands that add the profile to a bfloat16 calibration of this GPU model: the
    one given with ``--into``, else one measured first into a folder of its own."""
    folder, steps = _new_calibration(world_size, f"w{world_size}")
    gemm = f"fo-tune calibrate --world-size 1 --only gemm --dtype {dtype} --into"
    return (
        f"--dtype {dtype} measures the GEMM profile only (the collectives and the copy engine are "
        f"measured in bfloat16): add it to this GPU model's bfloat16 calibration with `{gemm} FILE`; "
        f"without one, {steps}`{gemm} {shlex.quote(folder + '/calibration.yaml')}`"
    )
