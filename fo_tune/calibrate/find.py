"""Finding a calibration: this machine's (under ``results/calibration`` here), the packaged one for a
device key and world size, and the one a search reads for its mode (a predicting search at a world
size nothing measured reads an extrapolation: ``fo_tune.calibrate.extrapolate``)."""

from __future__ import annotations

from pathlib import Path

import torch

from fo_kernels.fingerprint import current_fingerprint
from fo_tune.calibrate.calibration import CALIBRATION_FILE, Calibration, CalibrationError, load_calibration
from fo_tune.calibrate.extrapolate import NVSWITCH_BOARD_GPUS, extrapolate
from fo_tune.calibrate.files import DEFAULT_ROOT
from fo_tune.calibrate.missing import missing_profile, packaged_root

# The packaged calibration an offline plan at a world size without one is extrapolated from.
EXTRAPOLATED_FROM_WORLD = 2
# The deployment an offline plan prices unless given a calibration: the packaged H200 x2 one. Named,
# not the first folder found: in a checkout installed in place (scripts/venv.sh, scripts/test.sh)
# the packaged folder is results/calibration, where `fo-tune calibrate` writes this machine's.
OFFLINE_DEVICE_KEY = "nvidia-h200-cc90-132sm-w2-nvlink18"


def packaged_calibration(device_key: str | None, world_size: int) -> Path | None:
    """The packaged calibration for ``device_key`` (``OFFLINE_DEVICE_KEY`` when None) and world
    size, None without one."""
    root = packaged_root()
    if root is None:
        return None
    path = root / (device_key or OFFLINE_DEVICE_KEY) / f"tp{world_size}" / CALIBRATION_FILE
    return path if path.is_file() else None


def find_calibration(device_key: str, world_size: int) -> Path | None:
    """This machine's calibration: under results/calibration here, else the packaged one."""
    local = DEFAULT_ROOT / device_key / f"tp{world_size}" / CALIBRATION_FILE
    if local.is_file():
        return local
    return packaged_calibration(device_key, world_size)


def choose_calibration(
    path: Path | None,
    mode: str,
    world_size: int,
    backend: str,
    device: torch.device,
    dtype: str | None = None,
) -> tuple[Calibration | None, str]:
    """(the calibration the search reads, the mode): ``path`` (--calibration), else the packaged one
    for a predict search, else this machine's (``device``, on ranks of ``backend``). A predict
    search at a world size its calibration (given, or packaged: world size 2) did not measure reads
    it extrapolated to ``world_size`` (``extrapolate``; its ``basis`` says so); world size 1, with
    nothing to overlap, is refused in every mode. No mode given: hybrid with a calibration, else
    measure. ``dtype``: the search's operands; a calibration in
    another dtype is read through its GEMM profile for ``dtype`` (``Calibration.for_dtype``, its
    ``basis`` naming a sibling GPU that measured it): a predicting search without one is refused,
    naming the command; a measured one runs without."""
    from fo_tune.search import SearchError

    cal: Calibration | None = None
    # every mode, a --calibration file or not: a measured search would start ranks to time nothing
    # (no engine runs on one rank) and write a row the runtime never reads
    if world_size < EXTRAPOLATED_FROM_WORLD:
        raise SearchError(
            f"--world-size {world_size} has no collective to overlap: every call runs the GEMM "
            "alone (overlap: false), with no table row to plan; plan the world size you deploy "
            f"(--world-size {EXTRAPOLATED_FROM_WORLD} or more; "
            f"{EXTRAPOLATED_FROM_WORLD}-{NVSWITCH_BOARD_GPUS} offline)"
        )
    if path is not None:
        cal = load_calibration(path)
    elif mode == "predict":
        found = packaged_calibration(None, world_size)
        if found is None:
            found = packaged_calibration(None, EXTRAPOLATED_FROM_WORLD)
        if found is None or not EXTRAPOLATED_FROM_WORLD <= world_size <= NVSWITCH_BOARD_GPUS:
            raise SearchError(
                f"no packaged calibration for world size {world_size} (extrapolated: "
                f"{EXTRAPOLATED_FROM_WORLD}-{NVSWITCH_BOARD_GPUS}); run `fo-tune calibrate --world-size "
                f"{world_size}` on the GPUs and pass --calibration FILE"
            )
        cal = load_calibration(found)
    else:
        key = current_fingerprint(device, world_size).device_key
        found = find_calibration(key, world_size)
        if found is not None:
            cal = load_calibration(found)
    predicting = mode in ("predict", "hybrid")
    # a predicting search without a GEMM profile in ``dtype`` is refused naming the file it is read
    # from (before an extrapolation, whose device key names no file)
    other = cal is not None and dtype not in (None, cal.dtype)
    if other and predicting and not cal.gemm_dtypes.get(dtype):
        raise CalibrationError(missing_profile(cal, dtype))
    if mode == "predict" and cal is not None and cal.world_size < world_size:
        cal = extrapolate(cal, world_size)
    if cal is not None and dtype is not None and dtype != cal.dtype:
        # measuring without a profile for ``dtype``: no model, the ranks measure
        cal = cal.for_dtype(dtype) if predicting or dtype in cal.gemm_dtypes else None
    if not mode:
        mode = "hybrid" if cal is not None else "measure"
    if (
        mode == "hybrid"
        and backend == "gloo"
        and cal is not None
        and cal.fingerprint.compute_capability != "cpu"
    ):
        raise SearchError(
            f"--mode hybrid measures on these ranks (gloo on the CPU), but the calibration is for "
            f"{cal.fingerprint.device_key}; use --mode predict, or a calibration of this machine"
        )
    if mode == "predict" and cal is None:
        raise SearchError("--mode predict needs --calibration FILE")
    return cal, mode
