"""The symmetric data regions of every rank, as views and addresses (both executors use this).

Each rank's data memory is one byte buffer of ``len(regions(world))`` equal regions and a small
``scales`` region after them (``fo_kernels.engines.copy_engine.layout``). ``Regions`` holds this
rank's buffer and a view of every peer's (on GPUs: ``torch.distributed._symmetric_memory``
buffers, on the CPU executor: plain tensors shared between thread-ranks) and turns a ``Rows`` of a
region into a typed view or a byte address. ``Dtypes`` says each buffer's dtype (fp8 calls have
two, and float32 scales).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fo_kernels.engines.copy_engine.layout import (
    BUFFER_ALIGN,
    K_WIDE,
    SCALE_BUFFERS,
    SCALE_REGION,
    Rows,
    regions,
)
from fo_kernels.engines.copy_engine.ops import CallPlan


@dataclass(frozen=True, slots=True)
class Dtypes:
    """The dtypes of a call's buffers: ``operand`` of A's rows (``a``, ``shard``, ``gathered``),
    ``out`` of the outputs and partial sums, float32 of the scale buffers (fp8, rowwise). One
    dtype for both but in fp8 (float8_e4m3fn operands, ``out_dtype`` outputs)."""

    operand: torch.dtype
    out: torch.dtype

    def of(self, buffer: str) -> torch.dtype:
        if buffer in SCALE_BUFFERS:
            return torch.float32
        return self.operand if buffer in K_WIDE else self.out


def dtypes_of(dtypes: Dtypes | torch.dtype) -> Dtypes:
    """``dtypes``, or one dtype for every buffer but the scales."""
    return dtypes if isinstance(dtypes, Dtypes) else Dtypes(dtypes, dtypes)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // BUFFER_ALIGN) * BUFFER_ALIGN


def region_bytes_for(plan: CallPlan, dtypes: Dtypes | torch.dtype) -> int:
    """Bytes each of the equal regions needs for ``plan`` (rounded up to ``BUFFER_ALIGN``)."""
    kinds = dtypes_of(dtypes)
    size = {"n": plan.spec.n * kinds.out.itemsize, "k": plan.spec.k * kinds.operand.itemsize}
    return _aligned(max((rows * size[w] for w, rows in plan.region_rows.items() if w in size), default=0))


def scale_bytes_for(plan: CallPlan) -> int:
    """Bytes the ``scales`` region needs for ``plan`` (0 unless it moves rowwise scales)."""
    return _aligned(plan.region_rows.get("s", 0) * torch.float32.itemsize)


def data_bytes(world: int, region_bytes: int, scale_bytes: int) -> int:
    """A rank's symmetric data memory: the equal regions, then the scales region."""
    return len(regions(world)) * region_bytes + scale_bytes


def width_of(buffer: str, n: int, k: int) -> int:
    """Columns of ``buffer``: K for A's rows (``a``, ``shard``, ``gathered``), 1 for the scales,
    else N."""
    if buffer in SCALE_BUFFERS:
        return 1
    return k if buffer in K_WIDE else n


@dataclass
class Regions:
    """Every rank's data buffer (``data[rank]``: bytes), cut into regions of ``region_bytes``
    and the ``scales`` region of ``scale_bytes`` after them."""

    world: int
    region_bytes: int
    data: Mapping[int, torch.Tensor]
    scale_bytes: int = 0

    def __post_init__(self) -> None:
        self._index = {name: i for i, name in enumerate(regions(self.world))}
        self._index[SCALE_REGION] = len(self._index)

    def _span(self, buffer: str) -> tuple[int, int]:
        start = self._index[buffer] * self.region_bytes
        return start, self.scale_bytes if buffer == SCALE_REGION else self.region_bytes

    def view(self, rows: Rows, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``rows`` of a region as a (rows, width) ``dtype`` tensor."""
        start, size = self._span(rows.buffer)
        region = self.data[rows.owner][start : start + size].view(dtype)
        return region[rows.r0 * width : rows.r1 * width].view(rows.count, width)

    def address(self, rows: Rows, row_bytes: int) -> int:
        """The byte address of ``rows``' first row."""
        start = self._span(rows.buffer)[0] + rows.r0 * row_bytes
        return self.data[rows.owner].data_ptr() + start
