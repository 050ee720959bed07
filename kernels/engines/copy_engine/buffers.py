"""The symmetric data regions of every rank, as views and addresses (both executors use this).

Each rank's data memory is one byte buffer of ``len(regions(world))`` equal regions
(``fo_kernels.engines.copy_engine.layout``). ``Regions`` holds this rank's buffer and a view of every
peer's (on GPUs: ``torch.distributed._symmetric_memory`` buffers, on the CPU executor: plain
tensors shared between thread-ranks) and turns a ``Rows`` of a region into a typed view or a
byte address.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fo_kernels.engines.copy_engine.layout import BUFFER_ALIGN, K_WIDE, Rows, regions
from fo_kernels.engines.copy_engine.ops import CallPlan


def region_bytes_for(plan: CallPlan, dtype: torch.dtype) -> int:
    """Bytes each region needs for ``plan`` (rounded up to ``BUFFER_ALIGN``)."""
    width = {"n": plan.spec.n, "k": plan.spec.k}
    need = max((rows * width[w] for w, rows in plan.region_rows.items()), default=0) * dtype.itemsize
    return -(-need // BUFFER_ALIGN) * BUFFER_ALIGN


def width_of(buffer: str, n: int, k: int) -> int:
    """Columns of ``buffer``: K for A's rows (``a``, ``shard``, ``gathered``), else N."""
    return k if buffer in K_WIDE else n


@dataclass
class Regions:
    """Every rank's data buffer (``data[rank]``: bytes), cut into regions of ``region_bytes``."""

    world: int
    region_bytes: int
    data: Mapping[int, torch.Tensor]

    def __post_init__(self) -> None:
        self._index = {name: i for i, name in enumerate(regions(self.world))}

    def view(self, rows: Rows, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``rows`` of a region as a (rows, width) ``dtype`` tensor."""
        start = self._index[rows.buffer] * self.region_bytes
        region = self.data[rows.owner][start : start + self.region_bytes].view(dtype)
        return region[rows.r0 * width : rows.r1 * width].view(rows.count, width)

    def address(self, rows: Rows, row_bytes: int) -> int:
        """The byte address of ``rows``' first row."""
        start = self._index[rows.buffer] * self.region_bytes + rows.r0 * row_bytes
        return self.data[rows.owner].data_ptr() + start
