"""Tests of fo_kernels.fingerprint: the device key, the CPU fingerprint, the CUDA probe (faked)."""

from __future__ import annotations

import dataclasses
import platform
import re
import sys
import types

import pytest
import torch
import yaml

from fo_kernels import fingerprint as fpmod
from fo_kernels.errors import TableError
from fo_kernels.fingerprint import (
    CPU_NOMINAL_PROGRAMS,
    Fingerprint,
    current_fingerprint,
    device_sm_count,
    interconnect_summary,
    make_device_key,
    read_device_key,
)

SAFE_KEY = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


# ------------------------------------------------------------------------------------ device key
def test_device_key_format_gpu() -> None:
    key = make_device_key("NVIDIA H200", "9.0", 132, 2, "nvlink18")
    assert key == "nvidia-h200-cc90-132sm-w2-nvlink18"


def test_device_key_format_cpu() -> None:
    assert make_device_key("cpu-x86_64", "cpu", 8, 2, "gloo") == "cpu-x86_64-cccpu-8sm-w2-gloo"


def test_a_device_key_reads_back_into_its_fields() -> None:
    key = make_device_key("NVIDIA H100 80GB HBM3", "9.0", 132, 1, "single")
    assert read_device_key(key) == {
        "gpu_name": "nvidia-h100-80gb-hbm3",
        "compute_capability": "90",
        "sm_count": 132,
        "world_size": 1,
        "interconnect": "single",
    }
    assert read_device_key("cpu-x86_64-cccpu-8sm-w2-gloo")["gpu_name"] == "cpu-x86_64"
    assert read_device_key("not-a-key") is None


@pytest.mark.parametrize(
    "name",
    ["NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-32GB", "  weird/Name..(x) ", ""],
)
def test_device_key_is_filesystem_safe(name: str) -> None:
    key = make_device_key(name, "8.9", 128, 4, "PCIe / Gen4")
    assert SAFE_KEY.match(key), key
    assert key == key.lower()
    assert "/" not in key and " " not in key and "." not in key


def test_device_key_is_stable_and_separates_hardware() -> None:
    # Pinned literals: a change to the key's format orphans every table written under the old one.
    assert make_device_key("NVIDIA H200", "9.0", 132, 2, "nvlink18") == "nvidia-h200-cc90-132sm-w2-nvlink18"
    variants = {
        make_device_key("NVIDIA H100", "9.0", 132, 2, "nvlink18"): "nvidia-h100-cc90-132sm-w2-nvlink18",
        make_device_key("NVIDIA H200", "8.0", 132, 2, "nvlink18"): "nvidia-h200-cc80-132sm-w2-nvlink18",
        make_device_key("NVIDIA H200", "9.0", 114, 2, "nvlink18"): "nvidia-h200-cc90-114sm-w2-nvlink18",
        make_device_key("NVIDIA H200", "9.0", 132, 4, "nvlink18"): "nvidia-h200-cc90-132sm-w4-nvlink18",
        make_device_key("NVIDIA H200", "9.0", 132, 2, "pcie"): "nvidia-h200-cc90-132sm-w2-pcie",
    }
    assert all(key == expected for key, expected in variants.items()), variants
    assert len(variants) == 5


def test_versions_do_not_enter_device_key(monkeypatch: pytest.MonkeyPatch) -> None:
    before = current_fingerprint("cpu", world_size=2)
    monkeypatch.setattr(torch, "__version__", "99.0.0")
    monkeypatch.setattr(fpmod, "_triton_version", lambda: "0.0.1")
    after = current_fingerprint("cpu", world_size=2)
    assert after.torch == "99.0.0" and after.triton == "0.0.1"
    assert before.torch != after.torch
    assert after.device_key == before.device_key
    assert "99" not in after.device_key and "0.0.1" not in after.device_key


# ------------------------------------------------------------------------------------ CPU
def test_cpu_fingerprint() -> None:
    fp = current_fingerprint("cpu", world_size=2)
    machine = platform.machine().lower() or "unknown"
    assert fp.gpu_name == f"cpu-{platform.machine() or 'unknown'}"
    assert fp.compute_capability == "cpu"
    assert fp.sm_count == CPU_NOMINAL_PROGRAMS == 8
    assert fp.world_size == 2
    assert fp.interconnect == "gloo"
    assert fp.driver == "none" and fp.nccl == "none"
    assert fp.torch == torch.__version__
    assert fp.cuda == (torch.version.cuda or "none")
    assert fp.device_key == f"cpu-{machine}-cccpu-8sm-w2-gloo"
    assert SAFE_KEY.match(fp.device_key)
    assert current_fingerprint(torch.device("cpu"), world_size=1).device_key.endswith("-w1-gloo")


def test_cpu_helpers() -> None:
    assert device_sm_count("cpu") == CPU_NOMINAL_PROGRAMS
    assert interconnect_summary("cpu", 1) == "gloo"
    assert interconnect_summary("cpu", 4) == "gloo"


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_bad_world_size(world_size: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        current_fingerprint("cpu", world_size=world_size)  # type: ignore[arg-type]


def test_interconnect_never_raises_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA fallback")
    assert interconnect_summary("cuda:0", 2) == "pcie"


# ------------------------------------------------------------------------------------ round trip
def test_fingerprint_round_trip() -> None:
    fp = current_fingerprint("cpu", world_size=2)
    assert Fingerprint.from_dict(fp.to_dict()) == fp
    assert Fingerprint.from_dict(yaml.safe_load(yaml.safe_dump(fp.to_dict()))) == fp


def test_fingerprint_versions_are_the_live_libraries() -> None:
    import triton

    versions = current_fingerprint("cpu", world_size=2).versions()
    assert list(versions) == ["driver", "cuda", "nccl", "torch", "triton"]
    assert versions["torch"] == torch.__version__
    assert versions["triton"] == triton.__version__
    assert versions["cuda"] == (torch.version.cuda or "none")
    # The CPU has no driver and no NCCL.
    assert versions["driver"] == "none" and versions["nccl"] == "none"


def test_fingerprint_round_trip_numeric_looking_versions() -> None:
    cpu = current_fingerprint("cpu", world_size=2)
    fp = dataclasses.replace(cpu, cuda="12.10", nccl="2.28", triton="3.0")
    assert Fingerprint.from_dict(yaml.safe_load(yaml.safe_dump(fp.to_dict()))) == fp


def test_fingerprint_from_dict_errors() -> None:
    data = current_fingerprint("cpu", world_size=2).to_dict()
    missing = {k: v for k, v in data.items() if k != "sm_count"}
    with pytest.raises(TableError, match="sm_count"):
        Fingerprint.from_dict(missing)
    with pytest.raises(TableError, match="colour"):
        Fingerprint.from_dict({**data, "colour": "green"})
    with pytest.raises(TableError, match="sm_count"):
        Fingerprint.from_dict({**data, "sm_count": "8"})
    with pytest.raises(TableError, match="world_size"):
        Fingerprint.from_dict({**data, "world_size": True})
    with pytest.raises(TableError, match="cuda"):
        Fingerprint.from_dict({**data, "cuda": 12.6})
    with pytest.raises(TableError, match="mapping"):
        Fingerprint.from_dict(["not", "a", "mapping"])


# ------------------------------------------------------------------------------------ CUDA (faked)
class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(states: dict[int, object], driver: str = "570.86.15") -> types.ModuleType:
    """A pynvml stand-in: link -> 1 (enabled), 0 (disabled) or an exception to raise."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = _FakeNVMLError  # type: ignore[attr-defined]
    mod.NVML_FEATURE_ENABLED = 1  # type: ignore[attr-defined]
    mod.NVML_NVLINK_MAX_LINKS = 6  # type: ignore[attr-defined]
    mod.nvmlInit = lambda: None  # type: ignore[attr-defined]
    mod.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByUUID = lambda uuid: ("handle", uuid)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda index: ("handle", index)  # type: ignore[attr-defined]
    mod.nvmlSystemGetDriverVersion = lambda: driver  # type: ignore[attr-defined]

    def link_state(handle: object, link: int) -> int:
        state = states.get(link, _FakeNVMLError("not supported"))
        if isinstance(state, Exception):
            raise state
        return state  # type: ignore[return-value]

    mod.nvmlDeviceGetNvLinkState = link_state  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """Make torch believe there are two H200s (nothing is launched, only properties are read)."""
    props = types.SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, uuid="1234-abcd"
    )
    peer = {"ok": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: peer["ok"])
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    fpmod._cuda_fingerprint.cache_clear()
    yield peer
    fpmod._cuda_fingerprint.cache_clear()


def test_interconnect_counts_active_nvlinks(monkeypatch: pytest.MonkeyPatch, fake_cuda) -> None:
    states = {0: 1, 1: 1, 2: 0, 3: _FakeNVMLError("link 3"), 4: 1}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(states))
    assert interconnect_summary("cuda:0", 2) == "nvlink3"
    assert interconnect_summary("cuda:0", 1) == "single"


def test_interconnect_falls_back_without_pynvml(monkeypatch: pytest.MonkeyPatch, fake_cuda) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    assert interconnect_summary("cuda", 2) == "p2p"
    fake_cuda["ok"] = False
    assert interconnect_summary("cuda", 2) == "pcie"


def test_interconnect_falls_back_when_no_link_is_active(monkeypatch: pytest.MonkeyPatch, fake_cuda) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({0: 0}))
    assert interconnect_summary("cuda", 2) == "p2p"


def test_cuda_fingerprint_faked(monkeypatch: pytest.MonkeyPatch, fake_cuda) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({i: 1 for i in range(6)}, driver="570.86.15"))
    fp = current_fingerprint(None, world_size=2)
    assert fp.device_key == "nvidia-h200-cc90-132sm-w2-nvlink6"
    assert fp.compute_capability == "9.0"
    assert fp.sm_count == 132 and fp.gpu_name == "NVIDIA H200"
    assert fp.driver == "570.86.15" and fp.cuda == "12.8" and fp.nccl == "2.28.9"
    assert device_sm_count("cuda") == 132
    assert current_fingerprint("cuda:0", world_size=2) == fp
