"""Test setup: Triton's CPU interpreter unless a GPU run asks otherwise, and GPU markers.

TRITON_INTERPRET must be set before any kernel is defined, so it is set here, before the tests
import fo_kernels. A GPU run sets TRITON_INTERPRET=0 itself and selects ``-m "gpu or multigpu"``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
# One intra-op thread a process (torch reads this when it loads, so before the import below; the
# ranks inherit it): the tests' tensors are tiny, and two pytest workers whose gloo ranks each
# start a thread per core oversubscribe the cores (~13% more CPU time for the gloo tests on 2).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton's interpreter without its per-call listing of triton.language (tests/interpreter_site):
# in this process now, and in every process it starts through PYTHONPATH.
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interpreter_site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)
_spec = importlib.util.spec_from_file_location("fo_tests_site", os.path.join(_SITE, "sitecustomize.py"))
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))

import pytest  # noqa: E402 (after the environment above)
import torch  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    for item in items:
        if "gpu" in item.keywords and (gpus < 1 or interp):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU and TRITON_INTERPRET=0"))
        if "multigpu" in item.keywords and (gpus < 2 or interp):
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs and TRITON_INTERPRET=0"))


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """Every test leaves autograd's grad mode as it found it (on): a test that leaves it off (a
    ``yield`` inside ``torch.no_grad()``) would change what later tests in its process check."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left grad mode off (torch.is_grad_enabled() is False)")


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo process group in this process, for the runtime's collectives (a test
    module that needs more around it, warnings or Dynamo's reset, defines its own)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_rank(tmp_path, monkeypatch, backend: str, **init) -> Iterator[None]:
    """One rank of ``backend`` in this process: no user table anywhere (``FO_TUNE_TABLE_DIR`` and
    ``XDG_DATA_HOME`` under ``tmp_path``), no warnings kept (heuristic schedules, torch's paths),
    Dynamo reset after."""
    import warnings

    import torch.distributed as dist

    monkeypatch.setenv("FO_TUNE_TABLE_DIR", str(tmp_path / "tables"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, **init)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


@pytest.fixture
def quiet_one_rank(tmp_path, monkeypatch):
    """``one_rank`` for calls that look up tables and may be compiled (``_quiet_rank`` on gloo)."""
    with _quiet_rank(tmp_path, monkeypatch, "gloo"):
        yield


@pytest.fixture
def nccl_one_rank(tmp_path, monkeypatch):
    """One NCCL rank on GPU 0 in this process, for the GPU tests (``_quiet_rank`` on nccl)."""
    torch.cuda.set_device(0)
    with _quiet_rank(tmp_path, monkeypatch, "nccl", device_id=torch.device("cuda", 0)):
        yield


class _OverLimits:
    """A small float32 Triton-engine call at world size 1 (``shape``, ``schedule(collective)``) and
    ``failing()``: inside it the engine's GEMM launch fails as a kernel too large for the GPU does
    (Triton's ``OutOfResources`` as it loads the kernel, with the bytes a 256x128x64 4-stage tile
    needs in float32 on Hopper); the interpreter has no such limit to meet."""

    shape = (64, 48, 32)  # (M, N, K): 2 x 3 tiles of 32x16, one band row a signal unit
    required, limit = 327704, 232448

    def __init__(self, monkeypatch) -> None:
        self._monkeypatch = monkeypatch

    def schedule(self, collective: str):
        from fo_kernels import Problem, Schedule, Tile, TritonSettings

        m, n, k = self.shape
        tile = Tile(block_m=32, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=2)
        settings = TritonSettings(
            tile=tile, signal_tiles=3, groups=(1, 1), layout="row_band", wait_mode="spin"
        )
        return Schedule(
            collective=collective,
            dtype="float32",
            world_size=1,
            problem=Problem(m=m, n=n, k=k),
            settings=settings,
        )

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        from triton.runtime.errors import OutOfResources

        from fo_kernels.engines.triton import executor

        def too_large(*args, **kwargs):
            raise OutOfResources(self.required, self.limit, "shared memory")

        with self._monkeypatch.context() as patch:
            patch.setattr(executor, "signalled_gemm", too_large)
            yield


@pytest.fixture
def over_limits(monkeypatch) -> _OverLimits:
    """``_OverLimits``: a call whose launch fails as a tile too large for the GPU, inside ``failing()``."""
    return _OverLimits(monkeypatch)


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
