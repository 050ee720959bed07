"""The experts' GEMMs in torch: grouped GEMMs over rows sorted by expert, and the SwiGLU between.

Rows of expert e are ``[offset_e, offset_e + counts[e])`` of the operand (``counts`` on the host).

    grouped_mm(a, b, counts)     out[rows of e] = a[rows of e] @ b[e]           b (E, K, N)
    grouped_mm_t(a, b, counts)   out[rows of e] = a[rows of e] @ b[e].T         b (E, N, K)
    weight_grad(a, g, counts)    out[e] = a[rows of e].T @ g[rows of e]         (E, K, N), ``acc_dtype``

On CUDA with bfloat16 operands whose layout ``torch._grouped_mm`` takes (a 16-byte aligned start
and strides; an operand cut from packed rows is copied to one where that is all it lacks), one
``torch._grouped_mm`` call runs all experts; elsewhere (the CPU, float32 and float16, odd sizes) a
loop of ``torch.mm`` per expert with rows. Both give the same math: each expert's product in the
operands' dtype with float32 accumulation. Sums and activations run in ``acc_dtype``: float32,
or float64 for float64 operands (a reference run).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# torch._grouped_mm needs each operand's strides to be multiples of 16 bytes (its check says so
# on the CPU: "strides should be multiple of 16 bytes").
GROUPED_MM_ALIGN_BYTES = 16


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and activations of ``dtype`` operands run in: float32 or wider."""
    return torch.promote_types(dtype, torch.float32)


def _layout_ok(t: torch.Tensor) -> bool:
    """True when ``torch._grouped_mm`` takes ``t``'s layout: a 16-byte aligned start and every
    stride but the unit one a multiple of 16 bytes (whatever the dimension's size: its check reads
    the leading stride of a one-row operand too)."""
    if t.data_ptr() % GROUPED_MM_ALIGN_BYTES:
        return False
    return all(
        stride == 1 or (stride * t.element_size()) % GROUPED_MM_ALIGN_BYTES == 0 for stride in t.stride()
    )


def _library_dtype(*tensors: torch.Tensor) -> bool:
    """True when ``torch._grouped_mm`` runs these operands' device and dtype."""
    return hasattr(torch, "_grouped_mm") and all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors)


def _library(*tensors: torch.Tensor) -> bool:
    """True when ``torch._grouped_mm`` takes these operands (see the module docstring)."""
    return _library_dtype(*tensors) and all(_layout_ok(t) for t in tensors)


def _for_library(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where only ``t``'s layout keeps ``torch._grouped_mm`` from
    taking it (a row cut from a packed byte row: its stride the packed row's, its start anywhere)."""
    if _layout_ok(t):
        return t
    copy = t.clone(memory_format=torch.contiguous_format)
    return copy if _layout_ok(copy) else t


def device_ints(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (host integers) as a tensor on ``device``, without a host synchronization: on a
    GPU from pinned memory with a non-blocking copy (torch's pinned-memory cache keeps the host
    block until the copy has run). ``torch.tensor(values, device=cuda)`` would wait for the current
    stream, which in an overlapped call holds waits on the peers' rows."""
    host = torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    return device_ints(itertools.accumulate(counts), torch.int32, device)


def _ranges(counts: Sequence[int]):
    at = 0
    for e, c in enumerate(counts):
        if c:
            yield e, at, at + c
        at += c


def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, counts: Sequence[int], *, library: bool | None = None
) -> torch.Tensor:
    """``a[rows of e] @ b[e]`` for every expert e: (R, K) x (E, K, N) -> (R, N)."""
    out = a.new_empty((a.shape[0], b.shape[2]))
    if not a.shape[0]:
        return out
    if library or (library is None and _library_dtype(a, b)):
        a = _for_library(a)
    if library if library is not None else _library(a, b):
        return torch._grouped_mm(a, b, offs=_offsets(counts, a.device))
    for e, r0, r1 in _ranges(counts):
        torch.mm(a[r0:r1], b[e], out=out[r0:r1])
    return out


def grouped_mm_t(
    a: torch.Tensor, b: torch.Tensor, counts: Sequence[int], *, library: bool | None = None
) -> torch.Tensor:
    """``a[rows of e] @ b[e].T`` for every expert e: (R, N) x (E, K, N) -> (R, K)."""
    return grouped_mm(a, b.transpose(1, 2), counts, library=library)


def weight_grad(
    a: torch.Tensor, g: torch.Tensor, counts: Sequence[int], *, library: bool | None = None
) -> torch.Tensor:
    """``a[rows of e].T @ g[rows of e]`` for every expert e, in ``acc_dtype``: (E, K, N); zero for
    an expert without rows."""
    experts, acc = len(counts), acc_dtype(a.dtype)
    if not a.shape[0]:
        return a.new_zeros((experts, a.shape[1], g.shape[1]), dtype=acc)
    if library or (library is None and _library_dtype(a, g)):
        a, g = _for_library(a), _for_library(g)
    if library if library is not None else _library(a.t(), g):
        # (the output in the operands' dtype: each expert's sum is one GEMM, rounded once)
        out = torch._grouped_mm(a.t(), g, offs=_offsets(counts, a.device)).float()
        empty = [e for e, c in enumerate(counts) if not c]
        if empty:  # an expert without rows has no gradient, whatever the library leaves there
            out.index_fill_(0, device_ints(empty, torch.int64, out.device), 0)
        return out
    out = a.new_zeros((experts, a.shape[1], g.shape[1]), dtype=acc)
    for e, r0, r1 in _ranges(counts):
        out[e] = (a[r0:r1].t() @ g[r0:r1]).to(acc)
    return out


# ----------------------------------------------------------------------------- SwiGLU
def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of (R, 2I) rows whose first I columns are the gate, in ``acc_dtype``,
    returned in ``gu``'s dtype."""
    inter, acc = gu.shape[1] // 2, acc_dtype(gu.dtype)
    g, u = gu[:, :inter].to(acc), gu[:, inter:].to(acc)
    return (F.silu(g) * u).to(gu.dtype)


def swiglu_backward(gu: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """The gradient of ``swiglu`` at ``gu`` for the output gradient ``dh`` (``acc_dtype`` (R, I)), as
    (R, 2I) in ``gu``'s dtype: d gate = dh * up * silu'(gate), d up = dh * silu(gate), with
    silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))."""
    inter, acc = gu.shape[1] // 2, acc_dtype(gu.dtype)
    g, u = gu[:, :inter].to(acc), gu[:, inter:].to(acc)
    sig = torch.sigmoid(g)
    dg = dh * u * sig * (1 + g * (1 - sig))
    du = dh * g * sig
    return torch.cat([dg, du], dim=1).to(gu.dtype)
