"""The ``copy_engine`` engine: GEMM + ReduceScatter / AllReduce / AllGather between NVLink peers, no NCCL.

On Hopper, NCCL's kernels need SMs that a GEMM also wants, and beside a GEMM both slow down
(docs/design.md#copy-engine). Here the data moves through the GPUs' copy engines, which use no SM,
and the reduction is folded into the GEMM's epilogue (cuBLAS's ``beta = 1``, or the persistent
Triton GEMM's). The protocol is data: a mode builds the list of operations of one call for one rank
(GEMM chunks, flag signals and waits, resets, peer and local copies, joins between streams), and an
executor issues it: on GPUs through the CUDA driver, on the CPU by thread-ranks whose streams are
FIFO workers, so CI runs the same lists the GPUs run.

    layout.py   rows (shards, chunks), flag cells, buffer regions
    ops.py      the operation kinds and a call's plan
    modes.py    the modes by name (``ring``, ``tiled``), each building a call's operation list
    buffers.py  the symmetric regions as views and addresses
    gpu.py      the GPU executor (cuda-bindings, cuBLAS, ``rows_gemm``)
    cpu.py      the CPU executor (threads, FIFOs, shared tensors and counters, delays, timeouts)
    check.py    repeated calls on N thread-ranks checked against float64 (tests, the demo)
    peers.py    ``CopyEnginePeers``: the engine of one GPU and process group

Needs CUDA, GPUs with peer access (NVLink) between all ranks, ``torch.distributed.
_symmetric_memory`` and cuda-bindings (``pip install 'fo-tune[cuda]'``); ``copy_engine_blocker``
says what is missing. The CPU executor needs only torch.
"""

from __future__ import annotations

from ..graphs import GRAPH_AFTER_CALLS
from .check import CheckResult, CpuCheck, check_on_threads
from .cpu import CpuOptions, ProtocolError, ProtocolTimeout
from .layout import ROW_ALIGN, chunk_bounds, shard_rows, tile_row_bounds
from .modes import COLLECTIVES, MODE_NAMES, MODES, Mode, mode_blocker, mode_named, plan_call
from .peers import CopyEnginePeers, copy_engine_blocker

__all__ = [
    "COLLECTIVES",
    "GRAPH_AFTER_CALLS",
    "MODES",
    "MODE_NAMES",
    "ROW_ALIGN",
    "CheckResult",
    "CopyEnginePeers",
    "CpuCheck",
    "CpuOptions",
    "Mode",
    "ProtocolError",
    "ProtocolTimeout",
    "check_on_threads",
    "chunk_bounds",
    "copy_engine_blocker",
    "mode_blocker",
    "mode_named",
    "plan_call",
    "shard_rows",
    "tile_row_bounds",
]
