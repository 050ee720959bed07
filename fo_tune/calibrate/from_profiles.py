"""Another dtype's GEMM profile merged into a calibration from ``fo-tune profile`` CSVs, without a GPU
(``fo-tune calibrate --world-size 1 --only gemm --dtype D --from-profiles DIR --into FILE``).

    merge_profiles(target, DIR, dtype, sibling=...)
      1. every <M>x<N>x<K>-<dtype>.csv in DIR (profile_paths: not the -grids files, nor another
         fp8 scaling's -<scaling> files: the tuner's scaling alone, as a measured profile has)
      2. their rows as points (files.read_profile_csv); every row names one device key
      3. that key's GPU against the calibration's (check_mergeable, on the fields a device key holds:
         GPU, compute capability, SM count); another model of the same die with ``sibling``
      4. merged as a measured --into merge is (run.merge_gemm_dtype): ``gemm_dtypes[dtype]``, each
         point of a sibling recording its device key (``measured_on``)
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from fo_kernels.fingerprint import Fingerprint, make_device_key, read_device_key
from fo_tune.calibrate.calibration import Calibration, CalibrationError, GemmPoint
from fo_tune.calibrate.files import read_profile_csv
from fo_tune.calibrate.run import OTHER_DTYPE_PARTS, check_mergeable, merge_gemm_dtype


class ProfilesError(CalibrationError):
    """Profile CSVs that cannot be merged as asked; the message says what to do."""


def profile_paths(folder: Path, dtype: str) -> list[Path]:
    """The ``<M>x<N>x<K>-<dtype>.csv`` files in ``folder``, sorted; ``ProfilesError`` where there
    is no such folder or no such file in it."""
    if not folder.is_dir():
        what = "a file, not a folder" if folder.exists() else "no such folder"
        raise ProfilesError(f"--from-profiles {folder}: {what}; pass the folder `fo-tune profile` wrote")
    name = re.compile(rf"^\d+x\d+x\d+-{re.escape(dtype)}\.csv$")
    paths = sorted(p for p in folder.iterdir() if name.match(p.name) and p.is_file())
    if not paths:
        raise ProfilesError(
            f"--from-profiles {folder}: no <M>x<N>x<K>-{dtype}.csv profile there; write them with "
            f"`fo-tune profile --dtype {dtype}` on a GPU, or pass the folder that holds them"
        )
    return paths


def key_fingerprint(key: str, like: Fingerprint) -> Fingerprint:
    """``like`` with the fields a device key holds read from ``key`` (GPU and capability as the
    key spells them); ``ProfilesError`` where ``key`` is not a device key."""
    fields = read_device_key(key)
    if fields is None:
        raise ProfilesError(f"device key {key!r} is not <gpu>-cc<capability>-<sms>sm-w<world>-<interconnect>")
    return dataclasses.replace(like, device_key=key, **fields)


def read_profiles(folder: Path, dtype: str) -> tuple[list[GemmPoint], str]:
    """Every row of ``folder``'s ``dtype`` profiles and the one device key they name;
    ``ProfilesError`` naming two keys (and their files) where the rows disagree."""
    points: list[GemmPoint] = []
    first: tuple[str, Path] | None = None
    for path in profile_paths(folder, dtype):
        rows, keys = read_profile_csv(path)
        for key in keys:
            if first is None:
                first = (key, path)
            elif key != first[0]:
                raise ProfilesError(
                    f"--from-profiles {folder}: the profiles were measured on two GPUs, {first[0]} "
                    f"({first[1].name}) and {key} ({path.name}); keep one GPU's profiles in the folder"
                )
        points += rows
    if first is None:
        raise ProfilesError(f"--from-profiles {folder}: its {dtype} profiles hold no rows")
    return points, first[0]


def merge_profiles(target: Calibration, folder: Path, dtype: str, *, sibling: bool = False) -> Calibration:
    """``target`` with ``folder``'s ``dtype`` profiles as its GEMM profile in ``dtype`` (the module
    docstring), checked as a measured merge is (``check_mergeable``: ``CalibrationRequestError``)
    before anything changes."""
    if dtype == target.dtype:
        raise ProfilesError(
            f"--from-profiles adds a GEMM profile in another dtype than the calibration's {dtype} "
            f"(its own is measured with its collectives); pass another --dtype, e.g. float8_e4m3fn"
        )
    points, key = read_profiles(folder, dtype)
    # both sides as a device key spells them (the profiles have no fingerprint but their key)
    fp = target.fingerprint
    own = make_device_key(fp.gpu_name, fp.compute_capability, fp.sm_count, 1, "single")
    mine = dataclasses.replace(key_fingerprint(own, fp), device_key=fp.device_key)
    theirs = key_fingerprint(key, fp)
    check_mergeable(
        dataclasses.replace(target, fingerprint=mine),
        theirs,
        dtype,
        OTHER_DTYPE_PARTS,
        sibling=sibling,
        measured_by="the profiles are of",
    )
    return merge_gemm_dtype(target, dtype, points, key if theirs.gpu_name != mine.gpu_name else "")
