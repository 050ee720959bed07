"""Making a stream wait until a group counter reaches its target.

Two implementations behind one small interface (``Waiter``), picked by name:

- ``stream_wait``: ``cuStreamWaitValue32(stream, &counter[g], target, GEQ)`` through cuda-bindings.
  The GPU front end blocks the stream; no SM is used. The driver compares ``(int32)(*addr - target)
  >= 0``, so the never-reset counters may wrap.
- ``spin``: a one-program Triton kernel on the stream that acquire-loads the counter until the same
  wrap-around-safe test passes. It needs nothing beyond Triton and also runs under the interpreter,
  where the GEMM has already finished when it starts.

``make_waiter(mode)`` returns the requested one, or the spin waiter (warning once) when cuda-bindings
is missing or the tensors are not on a GPU.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Protocol

import torch
import triton
import triton.language as tl

from fo_kernels.engines.triton.settings import WAIT_MODES
from fo_kernels.errors import EnvironmentMismatchError, ScheduleError, install_hint

# The low 32 bits: the counters and cuStreamWaitValue32's targets are 32-bit words.
_U32 = 0xFFFFFFFF


def to_int32(value: int) -> int:
    """A running total modulo 2**32 as the signed int32 a kernel argument holds."""
    value &= _U32
    return value - (1 << 32) if value >= (1 << 31) else value


@triton.jit
def _spin_wait_kernel(counter, target):
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen - target < 0:  # int32 arithmetic: wrap-around safe
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


class Waiter(Protocol):
    """Enqueue, on the current stream, a wait until ``counters[index]`` reaches ``target``."""

    name: str

    def wait(self, counters: torch.Tensor, index: int, target: int) -> None: ...


class SpinWaiter:
    name = "spin"

    def wait(self, counters: torch.Tensor, index: int, target: int) -> None:
        _spin_wait_kernel[(1,)](counters[index:], to_int32(target), num_warps=1)


def driver_module() -> ModuleType | None:
    """cuda-bindings' driver module (new and old import paths), or None if it is not installed."""
    try:
        from cuda.bindings import driver  # cuda-bindings >= 12.6

        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver  # cuda-python < 12.6

        return driver
    except ImportError:
        return None


class StreamWaiter:
    name = "stream_wait"

    def __init__(self, driver) -> None:
        self._driver = driver
        self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ

    def wait(self, counters: torch.Tensor, index: int, target: int) -> None:
        drv = self._driver
        stream = drv.CUstream(torch.cuda.current_stream(counters.device).cuda_stream)
        address = drv.CUdeviceptr(counters.data_ptr() + index * counters.element_size())
        (err,) = drv.cuStreamWaitValue32(stream, address, target & _U32, self._geq)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise EnvironmentMismatchError(
                f"cuStreamWaitValue32 failed ({err}); use wait_mode: spin in the schedule"
            )


def make_waiter(mode: str, device: torch.device) -> Waiter:
    """The waiter for ``mode`` on ``device``, falling back to ``spin`` where ``stream_wait`` cannot run."""
    if mode not in WAIT_MODES:
        raise ScheduleError(f"wait_mode: {mode!r} is not one of {', '.join(WAIT_MODES)}")
    if mode == "spin":
        return SpinWaiter()
    if device.type != "cuda":
        return SpinWaiter()  # no streams to block on the CPU: the interpreter's GEMM is already done
    driver = driver_module()
    if driver is None:
        warnings.warn(
            f"wait_mode stream_wait needs cuda-bindings ({install_hint('cuda')}); using the spin kernel",
            RuntimeWarning,
            stacklevel=3,
        )
        return SpinWaiter()
    return StreamWaiter(driver)
