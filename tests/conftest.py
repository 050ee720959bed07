"""Test setup: Triton's CPU interpreter unless a GPU run asks otherwise, and GPU markers.

TRITON_INTERPRET must be set before any kernel is defined, so it is set here, before the tests
import fo_kernels. A GPU run sets TRITON_INTERPRET=0 itself and selects ``-m "gpu or multigpu"``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
# One intra-op thread a process (torch reads this when it loads, so before the import below; the
# ranks inherit it): the tests' tensors are tiny, and two pytest workers whose gloo ranks each
# start a thread per core oversubscribe the cores (~13% more CPU time for the gloo tests on 2).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    for item in items:
        if "gpu" in item.keywords and (gpus < 1 or interp):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU and TRITON_INTERPRET=0"))
        if "multigpu" in item.keywords and (gpus < 2 or interp):
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs and TRITON_INTERPRET=0"))


@pytest.fixture(scope="module")
def h200():
    """The packaged H200 x2 calibration (``cli_checks.H200_KEY``, world size 2)."""
    from cli_checks import H200_KEY
    from fo_tune.calibrate.calibration import load_calibration
    from fo_tune.calibrate.find import packaged_calibration

    path = packaged_calibration(H200_KEY, 2)
    assert path is not None, "the packaged H200 TP2 calibration is missing"
    return load_calibration(path)


@pytest.fixture(scope="module")
def model(h200):
    """The cost model of the packaged H200 x2 calibration."""
    from fo_tune.engines import cost_model

    return cost_model(h200)
