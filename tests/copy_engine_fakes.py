"""Fakes of what the copy engine's GPU executor calls, for its CPU tests: the CUDA driver's stream
memory operations and copies, torch's streams and events, cuBLAS (``torch.mm``, ``addmm_``) and
``rows_gemm``. Each call is appended to a ``FakeLog`` as a tuple, so a test reads what the executor
issued, in order, without a GPU. How a test names addresses and tensors in those tuples is its own:
``fake_driver`` and ``install_torch_fakes`` take the naming functions. ``DRIVER`` and ``cpu_device``
instead carry each operation out (the virtual ranks' CPU tests)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fo_kernels.engines.copy_engine.gpu as gpu
from fo_kernels.engines.copy_engine.virtual import VirtualDevice


class FakeLog:
    """What the fakes saw, in order; ``current`` is the stream the ``torch.cuda.stream`` context
    names, ``names`` each fake stream's handle -> name."""

    def __init__(self, current: str) -> None:
        self.ops: list[tuple] = []
        self.current = current
        self.names: dict[int, str] = {}
        self.events = 0


class FakeStream:
    """A stream with a name and a driver handle (``cuda_stream``), recorded in the log's names."""

    def __init__(self, log: FakeLog, name: str, handle: int) -> None:
        self.log, self.name, self.cuda_stream = log, name, handle
        log.names[handle] = name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.ops.append(("join", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.ops.append(("wait_event", self.name, event.id))


class FakeEvent:
    """An event numbered in the order the executor made it."""

    def __init__(self, log: FakeLog) -> None:
        self.log, self.id = log, log.events
        log.events += 1

    def record(self, stream: FakeStream | None = None) -> None:
        self.log.ops.append(("record", stream.name, self.id))


def fake_driver(
    log: FakeLog, cell: Callable[[int], Any] = lambda a: a, where: Callable[[int], Any] = lambda a: a
) -> SimpleNamespace:
    """The CUDA driver calls the executor makes: flag waits, writes and memsets log ``cell(address)``,
    copies ``where(address)`` of both ends; streams by their name in the log."""

    def add(*op: Any) -> tuple[int]:
        log.ops.append(op)
        return (0,)

    name = log.names.__getitem__
    return SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=0),
        CUstreamWaitValue_flags=SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ="geq"),
        CUstreamWriteValue_flags=SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT="fence"),
        CUstream=lambda handle: handle,
        CUdeviceptr=int,
        cuStreamWaitValue32=lambda s, a, v, f: add("wait", name(s), cell(a), v),
        cuStreamWriteValue32=lambda s, a, v, f: add("write", name(s), cell(a), v),
        cuMemcpyDtoDAsync=lambda d, s, nbytes, st: add("copy", name(st), where(d), where(s), nbytes),
        cuMemsetD32Async=lambda a, v, count, st: add("memset", name(st), cell(a), v, count),
    )


def install_torch_fakes(
    monkeypatch: pytest.MonkeyPatch,
    log: FakeLog,
    gemm: Callable[[torch.Tensor, torch.Tensor, int], tuple],
    rows_gemm: Callable[..., tuple],
) -> None:
    """cuBLAS, ``rows_gemm``, ``torch.cuda.stream`` and ``torch.cuda.Event`` faked: a library GEMM
    logs ``("gemm", stream, *gemm(a, out, beta))``, a rows kernel ``("kernel", stream,
    *rows_gemm(a, b, out, tile, **its keywords))``."""

    def mm(x: torch.Tensor, y: torch.Tensor, *, out: torch.Tensor) -> None:
        log.ops.append(("gemm", log.current, *gemm(x, out, 0)))

    def addmm_(self: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        log.ops.append(("gemm", log.current, *gemm(x, self, 1)))
        return self

    def kernel(*args: Any, **kw: Any) -> None:
        log.ops.append(("kernel", log.current, *rows_gemm(*args, **kw)))

    @contextlib.contextmanager
    def stream(s: FakeStream):
        before, log.current = log.current, s.name
        try:
            yield
        finally:
            log.current = before

    monkeypatch.setattr(gpu, "rows_gemm", kernel)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kw: FakeEvent(log))
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch.Tensor, "addmm_", addmm_)


# ----------------------------------------------------------------------------- executing fakes
# A driver that carries out each operation when it is issued, on the CPU tensors' memory (a flag
# write stores the int32, a copy moves the bytes with ``ctypes.memmove``, a memset zeroes cells),
# a flag wait having to hold already (an ``AssertionError`` otherwise): a GPU whose streams all
# share one queue and finish each operation at once. The virtual ranks' CPU tests run on it.


class _DoneStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle

    def wait_stream(self, other: _DoneStream) -> None:  # (every operation is done when issued)
        pass

    def wait_event(self, event: object) -> None:
        pass


class _DoneEvent:
    def record(self, stream: object = None) -> None:
        pass


def _cell(address: int) -> ctypes.c_int32:
    return ctypes.c_int32.from_address(address)


def _wait(stream: int, address: int, value: int, flags: object) -> tuple[int]:
    got = _cell(address).value
    assert got >= value, f"a wait issued before its writer: the cell holds {got}, the wait needs {value}"
    return (0,)


def _write(stream: int, address: int, value: int, flags: object) -> tuple[int]:
    _cell(address).value = value
    return (0,)


def _memset(address: int, value: int, count: int, stream: int) -> tuple[int]:
    for i in range(count):
        _cell(address + 4 * i).value = value
    return (0,)


def _memcpy(dst: int, src: int, nbytes: int, stream: int) -> tuple[int]:
    ctypes.memmove(dst, src, nbytes)
    return (0,)


DRIVER = SimpleNamespace(
    CUresult=SimpleNamespace(CUDA_SUCCESS=0),
    CUstreamWaitValue_flags=SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ="geq"),
    CUstreamWriteValue_flags=SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT="fence"),
    CUstream=lambda handle: handle,
    CUdeviceptr=int,
    cuStreamWaitValue32=_wait,
    cuStreamWriteValue32=_write,
    cuMemcpyDtoDAsync=_memcpy,
    cuMemsetD32Async=_memset,
)


def cpu_device(monkeypatch: pytest.MonkeyPatch, sms: int = 132) -> VirtualDevice:
    """A ``VirtualDevice`` on the CPU through ``DRIVER`` (torch.cuda's events and stream contexts
    patched to do nothing for the test)."""
    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kw: _DoneEvent())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    handles = iter(range(1, 10_000))
    caller = _DoneStream(0)
    return VirtualDevice(
        device=torch.device("cpu"),
        driver=DRIVER,
        new_stream=lambda priority: _DoneStream(next(handles)),
        current_stream=lambda: caller,
        capturing=lambda: False,
        synchronize=lambda: None,
        sms=sms,
    )
