"""The hardware fingerprint and the stable device key.

Every file fo-tune writes (schedule tables here, calibrations in the tuner) records the
``Fingerprint`` of the machine it was measured on, and the runtime finds tables by the fingerprint's
``device_key``. This module is the one code path that builds both.

The device key names the hardware only (GPU, compute capability, SM count, world size,
interconnect); library versions stay out of it, so a driver or torch upgrade keeps finding the same
tables and is reported as version drift instead (``fo_kernels.table.check_fingerprint``).

Nothing is probed at import; ``current_fingerprint`` probes when called. On CUDA the probe (which
initialises NVML) is cached per (device index, world size); ``_cuda_fingerprint.cache_clear()``
forgets it.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from fo_kernels.errors import ArgumentError, EnvironmentMismatchError, ScheduleError, TableError

__all__ = [
    "CPU_NOMINAL_PROGRAMS",
    "Fingerprint",
    "current_fingerprint",
    "device_sm_count",
    "interconnect_summary",
    "make_device_key",
    "read_device_key",
    "resolve_device",
]

# The "SM count" of the CPU. The Triton interpreter runs a grid's programs one after another, so
# this number only fixes the size of the persistent grid (and thus the wave structure) CPU tests see.
CPU_NOMINAL_PROGRAMS = 8

# The largest shape (M x N x K multiply-adds) run on the CPU unless asked to: Triton's
# interpreter runs fo_tune's GEMM tile by tile in Python at ~0.02 G multiply-adds per second on a
# 2-core machine (512x512x512 float32 took 5.2 s a call), so 2**30 of them (1024^3) take about a
# minute a call, and a bench case makes about ten; a GPU suite's shapes would take hours. The
# fo-tune commands refuse larger shapes without GPUs unless --allow-slow, and the runtime's
# table-miss hint on the CPU names that option for them.
CPU_MAX_MACS = 2**30

# NVML's link count when the installed nvidia-ml-py lacks the constant (NVML_NVLINK_MAX_LINKS is 18
# since the Hopper-era NVML headers: H100/H200 SXM have 18 NVLink 4 links).
_FALLBACK_NVLINK_MAX_LINKS = 18

# Fields of Fingerprint that hold library versions (the rest describe the hardware).
_VERSION_FIELDS = ("driver", "cuda", "nccl", "torch", "triton")

_SLUG_DROP = re.compile(r"[^a-z0-9_]+")
# A device key as make_device_key writes it.
_DEVICE_KEY = re.compile(r"^(?P<gpu>.+)-cc(?P<cc>[a-z0-9_]+)-(?P<sms>\d+)sm-w(?P<world>\d+)-(?P<link>.+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    """The machine a measurement or a table belongs to: hardware first, then library versions."""

    device_key: str
    gpu_name: str
    compute_capability: str  # "9.0" style, or "cpu"
    sm_count: int
    world_size: int
    interconnect: str  # "nvlink18", "p2p", "pcie", "single" or "gloo"
    driver: str
    cuda: str
    nccl: str
    torch: str
    triton: str

    def versions(self) -> dict[str, str]:
        """The library-version part: driver, cuda, nccl, torch, triton."""
        return {name: getattr(self, name) for name in _VERSION_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> Fingerprint:
        """Build from a mapping; a missing, unknown or mistyped key raises ``TableError`` naming it."""
        if not isinstance(data, Mapping):
            raise TableError(f"fingerprint: expected a mapping, got {type(data).__name__}")
        spec = {f.name: f.type for f in fields(cls)}
        unknown = sorted(str(key) for key in set(data) - set(spec))
        if unknown:
            raise TableError(f"fingerprint: unknown key(s) {', '.join(unknown)}; valid: {list(spec)}")
        missing = [name for name in spec if name not in data]
        if missing:
            raise TableError(f"fingerprint.{missing[0]}: missing")
        for name, kind in spec.items():
            value = data[name]
            if kind == "int":  # (sm_count, world_size: counts, so a 0 or a negative is a hand edit)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TableError(f"fingerprint.{name}: expected an integer, got {value!r}")
                if value < 1:
                    raise TableError(f"fingerprint.{name}: must be >= 1, got {value}")
            elif not isinstance(value, str):
                raise TableError(f"fingerprint.{name}: expected a string (quote it in YAML), got {value!r}")
        return cls(**{name: data[name] for name in spec})


def _slug(text: str) -> str:
    slug = _SLUG_DROP.sub("-", str(text).lower()).strip("-_")
    return slug or "unknown"


def make_device_key(
    gpu_name: str, compute_capability: str, sm_count: int, world_size: int, interconnect: str
) -> str:
    """The stable, lowercase, filesystem-safe key of a device setup.

    Format: ``<gpu>-cc<capability>-<sm_count>sm-w<world_size>-<interconnect>``, where ``<gpu>``
    and ``<interconnect>`` are slugs (lowercase; every run of characters outside ``[a-z0-9_]``
    becomes ``-``) and ``<capability>`` is the capability without its dot. Examples:
    ``nvidia-h200-cc90-132sm-w2-nvlink18`` and ``cpu-x86_64-cccpu-8sm-w2-gloo``.
    Only these five inputs enter the key; library versions never do.
    """
    capability = _slug(compute_capability).replace("-", "")
    return f"{_slug(gpu_name)}-cc{capability}-{int(sm_count)}sm-w{int(world_size)}-{_slug(interconnect)}"


def read_device_key(key: str) -> dict[str, str | int] | None:
    """``make_device_key``'s five fields read back from ``key``, as the key spells them (slugs; the
    capability without its dot): ``gpu_name``, ``compute_capability``, ``sm_count``,
    ``world_size``, ``interconnect``; None where ``key`` is not a device key."""
    match = _DEVICE_KEY.match(key)
    if match is None:
        return None
    return {
        "gpu_name": match["gpu"],
        "compute_capability": match["cc"],
        "sm_count": int(match["sms"]),
        "world_size": int(match["world"]),
        "interconnect": match["link"],
    }


def resolve_device(device: torch.device | str | int | None = None) -> torch.device:
    """``None``: the current CUDA device when CUDA is available, else the CPU; ``cuda`` gets its index.

    Raises ``ArgumentError`` for something torch does not read as a device (``"foo"``, ``"cuda:x"``,
    a negative index), ``EnvironmentMismatchError`` for a device type other than cpu and cuda, or for
    a CUDA device when CUDA is not available.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):  # torch's own message lists device types fo-tune does not run on
        if isinstance(device, str) and read_device_key(device) is not None:
            # A user planning another machine's deployment passes its key: the runtime reads only
            # the tables of the machine it runs on, and `fo-tune table lookup -k` answers for a key.
            raise ArgumentError(
                f"device: {device!r} is a device key, not a device; the runtime looks up the tables "
                "of the device it runs on ('cpu', 'cuda', 'cuda:N' or a GPU index N): to see the row "
                "a call on that machine gets, run "
                f"`fo-tune table lookup --shape MxNxK -c COLLECTIVE -k {device}`"
            ) from None
        raise ArgumentError(
            f"device: {device!r} is not a device; give 'cpu', 'cuda', 'cuda:N' or a GPU index N"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise EnvironmentMismatchError(f"device: fo-tune runs on cpu or cuda, got {dev}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EnvironmentMismatchError(f"device: {dev} asked for, but CUDA is not available here")
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
    return dev


def device_sm_count(device: torch.device | str | int | None = None) -> int:
    """SMs of a CUDA device; ``CPU_NOMINAL_PROGRAMS`` on the CPU."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).multi_processor_count)
    return CPU_NOMINAL_PROGRAMS


def _nvml_handle(pynvml: Any, dev: torch.device) -> Any:
    """The NVML handle of a torch CUDA device: by UUID (CUDA_VISIBLE_DEVICES-proof), else by index."""
    try:
        uuid = str(torch.cuda.get_device_properties(dev).uuid)
        name = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        return pynvml.nvmlDeviceGetHandleByUUID(name)
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)


def _nvlink_count(dev: torch.device) -> int:
    """Active NVLink links of the device per NVML; 0 when pynvml is missing or anything fails."""
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        handle = _nvml_handle(pynvml, dev)
        active = 0
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", _FALLBACK_NVLINK_MAX_LINKS)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    active += 1
            except pynvml.NVMLError:
                continue
        return active
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def interconnect_summary(device: torch.device | str | int | None, world_size: int) -> str:
    """How the ranks talk: ``gloo`` (CPU), ``single``, ``nvlink<links>``, ``p2p`` or ``pcie``.

    Never raises: any failure of a probe falls back to the next one, and finally to ``pcie``.
    """
    try:
        dev = resolve_device(device)
        if dev.type != "cuda":
            return "gloo"
        if world_size <= 1:
            return "single"
        links = _nvlink_count(dev)
        if links > 0:
            return f"nvlink{links}"
        if torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1):
            return "p2p"
    except Exception:
        pass
    return "pcie"


def _driver_version() -> str:
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return "unknown"
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return "unknown"
    return version.decode() if isinstance(version, bytes) else str(version)


def _nccl_version() -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return "none"
    if isinstance(version, tuple):
        return ".".join(map(str, version))
    return str(version)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(getattr(triton, "__version__", "none"))


@functools.lru_cache(maxsize=16)
def _cuda_fingerprint(index: int, world_size: int) -> Fingerprint:
    dev = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(dev)
    gpu_name = str(props.name)
    capability = f"{props.major}.{props.minor}"
    sm_count = int(props.multi_processor_count)
    interconnect = interconnect_summary(dev, world_size)
    return Fingerprint(
        device_key=make_device_key(gpu_name, capability, sm_count, world_size, interconnect),
        gpu_name=gpu_name,
        compute_capability=capability,
        sm_count=sm_count,
        world_size=world_size,
        interconnect=interconnect,
        driver=_driver_version(),
        cuda=torch.version.cuda or "none",
        nccl=_nccl_version(),
        torch=str(torch.__version__),
        triton=_triton_version(),
    )


def _cpu_fingerprint(world_size: int) -> Fingerprint:
    gpu_name = f"cpu-{platform.machine() or 'unknown'}"
    interconnect = interconnect_summary("cpu", world_size)
    return Fingerprint(
        device_key=make_device_key(gpu_name, "cpu", CPU_NOMINAL_PROGRAMS, world_size, interconnect),
        gpu_name=gpu_name,
        compute_capability="cpu",
        sm_count=CPU_NOMINAL_PROGRAMS,
        world_size=world_size,
        interconnect=interconnect,
        driver="none",
        cuda=torch.version.cuda or "none",
        nccl="none",
        torch=str(torch.__version__),
        triton=_triton_version(),
    )


def current_fingerprint(device: torch.device | str | int | None = None, world_size: int = 1) -> Fingerprint:
    """The fingerprint of ``device`` (``None``: current CUDA device, else the CPU) in a ``world_size`` job."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ScheduleError(f"world_size: expected an integer >= 1, got {world_size!r}")
    dev = resolve_device(device)
    if dev.type == "cuda":
        return _cuda_fingerprint(dev.index or 0, world_size)
    return _cpu_fingerprint(world_size)
