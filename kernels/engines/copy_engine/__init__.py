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
    warmup.py   the kernel-loading rule: a plan's kernels loaded before its first flag wait
    virtual.py  N ranks in one process on one GPU, each rank's list issued by a GPU executor
    cpu.py      the CPU executor (threads, FIFOs, shared tensors and counters, delays, timeouts)
    check.py    repeated calls on N thread-ranks (or virtual ranks) checked against float64
    peers.py    ``CopyEnginePeers``: the engine of one GPU and process group
    settings.py ``CopyEngineSettings``: its part of a schedule

fp8 (float8_e4m3fn operands with ``torch._scaled_mm``'s scales): the same protocols, the chunk
GEMMs scaled (``torch._scaled_mm``; a partial sum added after it), the AllGather moving fp8 rows
and, rowwise, their scale rows.

Needs CUDA, GPUs with peer access (NVLink) between all ranks, ``torch.distributed.
_symmetric_memory`` and cuda-bindings (``pip install cuda-bindings``, the cuda extra); ``copy_engine_blocker``
says what is missing. The CPU executor needs only torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fo_kernels.engines import Engine, EngineResult
from fo_kernels.engines.copy_engine.settings import CopyEngineSettings

if TYPE_CHECKING:
    from fo_kernels.gemm import BOperand
    from fo_kernels.runtime import OverlapRuntime
    from fo_kernels.scaling import Scales
    from fo_kernels.schedule import Schedule

# The protocol's public names, each loaded from its module on first use (PEP 562): importing the
# engine to read its settings defines no Triton kernel.
_EXPORTS = {
    "COLLECTIVES": "fo_kernels.engines.copy_engine.modes",
    "CheckResult": "fo_kernels.engines.copy_engine.check",
    "CopyEnginePeers": "fo_kernels.engines.copy_engine.peers",
    "CpuCheck": "fo_kernels.engines.copy_engine.check",
    "CpuOptions": "fo_kernels.engines.copy_engine.cpu",
    "GRAPH_AFTER_CALLS": "fo_kernels.graphs",
    "MODES": "fo_kernels.engines.copy_engine.modes",
    "MODE_NAMES": "fo_kernels.engines.copy_engine.modes",
    "Mode": "fo_kernels.engines.copy_engine.modes",
    "ProtocolError": "fo_kernels.errors",
    "ProtocolTimeout": "fo_kernels.errors",
    "ROW_ALIGN": "fo_kernels.engines.copy_engine.layout",
    "VirtualDevice": "fo_kernels.engines.copy_engine.virtual",
    "VirtualRanks": "fo_kernels.engines.copy_engine.virtual",
    "check_on_gpu": "fo_kernels.engines.copy_engine.check",
    "check_on_threads": "fo_kernels.engines.copy_engine.check",
    "chunk_bounds": "fo_kernels.engines.copy_engine.layout",
    "copy_engine_blocker": "fo_kernels.engines.copy_engine.peers",
    "cuda_device": "fo_kernels.engines.copy_engine.virtual",
    "issue_order": "fo_kernels.engines.copy_engine.virtual",
    "mode_blocker": "fo_kernels.engines.copy_engine.modes",
    "mode_named": "fo_kernels.engines.copy_engine.modes",
    "plan_call": "fo_kernels.engines.copy_engine.modes",
    "shard_rows": "fo_kernels.engines.copy_engine.layout",
    "tile_row_bounds": "fo_kernels.engines.copy_engine.layout",
}
__all__ = ["ENGINE", "CopyEngine", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


class CopyEngine(Engine):
    """The ``copy_engine`` engine through the runtime's peers object (``fo_kernels.engines.copy_engine``)."""

    name: ClassVar[str] = "copy_engine"
    collectives: ClassVar[tuple[str, ...]] = ("all_reduce", "reduce_scatter", "all_gather")

    def blocker(self, device: torch.device, world_size: int) -> str:
        from fo_kernels.engines.copy_engine import copy_engine_blocker

        return copy_engine_blocker(device, world_size)

    def run(
        self,
        schedule: Schedule,
        a: torch.Tensor,
        b: BOperand,
        runtime: OverlapRuntime,
        *,
        scales: Scales | None = None,
        own_graphs: bool = True,
    ) -> EngineResult:
        st = schedule.settings
        assert isinstance(st, CopyEngineSettings)
        peers_args = dict(
            mode=st.mode, weights=st.weights, tile=st.tile, own_graphs=own_graphs, scales=scales
        )
        if schedule.collective == "all_gather":  # (a is this rank's shard: every rank owns its rows)
            gathered, out = runtime.copy_engine().run_all_gather(a, b.tensor, **peers_args)
            return out, gathered
        if a.shape[0] < runtime.world_size:  # a rank would own no row (an M-range row reaching M = 1)
            fallback = runtime.fallback()
            return fallback.run(schedule.collective, a, b.tensor, scales=scales, own_graphs=own_graphs)
        return runtime.copy_engine().run(schedule.collective, a, b.tensor, **peers_args)


ENGINE = CopyEngine
