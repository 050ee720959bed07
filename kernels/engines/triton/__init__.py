"""The ``triton`` engine: the signalled persistent Triton GEMM, NCCL per group as its tiles land.

    main stream:  [wait comm (previous call)] -> signalled GEMM -------------------> [restore]
    comm stream:  wait main (inputs ready) -> for each group g:                ^
                      wait counter[g] >= target[g]; collective(chunk g)  ------+ (main waits comm)

The GEMM (``fo_kernels.gemm.signalled_gemm``) runs on the caller's stream and signals each group's
counter as its tiles land; the high-priority communication stream waits per group
(``fo_kernels.wait``) and runs the collective on that group's contiguous chunk through
torch.distributed (NCCL on GPUs, with the schedule's CTA cap; gloo on the CPU, where the interpreter
has finished the GEMM before the first wait). Tile-major layouts are restored to row-major at the
end. On return the caller's stream is ordered after all of it. Geometry: ``fo_kernels.plan``.

``all_gather`` runs the other way (AllGather + GEMM, the column-parallel direction):

    comm stream:  wait main (shard ready) -> for each group g:
                      all_gather rows [i0, i1) of every shard into chunk g; record event g;
                      copy chunk g to its rows of the gathered A (row-major)
    main stream:  for each group g: wait event g; for each shard s:
                      out[s*Ms + i0 : s*Ms + i1] = chunk g's rows of shard s @ B    (Triton GEMM)
                  -> (main waits comm)

Chunk g is the plan's row_band chunk with E = K (shard-major inside the chunk), so one collective
fills it; the chunk GEMMs of group g run while the gathers of later groups are in flight. The GEMM
grid is ``sm_count - sms_free`` (SMs left to NCCL), the gathers run on the schedule's CTA-capped
group. Nothing is signalled, so the call holds no counters and is safe to capture in a CUDA graph.

fp8 (``scales``, ``fo_kernels.scaling``): the same streams and order; every GEMM applies the scales
in its epilogue before the signal, outputs (and the collectives' chunks) are in ``out_dtype``. The
AllGather moves the fp8 shard's bytes, and rowwise first gathers the shard's rows of ``scale_a``
(one small gather on the comm stream before the chunks). On a GPU a row-major fp8 B is first copied
K-major (the transposed view of an (N, K) weight needs no copy): Hopper's fp8 wgmma reads both
operands K-major from shared memory (the PTX ISA allows a transposed operand for 16-bit types only),
and torch._scaled_mm asks for the same layout.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, ClassVar

import torch

from fo_kernels.engines import Engine, EngineResult
from fo_kernels.errors import DeviceLimitError, TileStagesWarning
from fo_kernels.tile import DeviceLimits, Tile

# The output bytes an fp8 table row is tuned with (bfloat16: fo_tune/ranks/scaled.py). A wider
# out_dtype (float32) grows the epilogue's shared memory: on an H100, fp8's 128x256x128 tile with 4
# stages needs 262,176 bytes with a float32 output, over Hopper's 232,448, and loads with bfloat16.
TUNED_OUT_BYTES = 2
# The fewest stages such a call is retried with (a software pipeline of two: a load in flight
# beside the block the tensor cores read).
MIN_RETRY_STAGES = 2
# The runtime's engine_state key of the tiles that loaded only with fewer stages, by (the
# schedule's tile, out_dtype): later calls start from the tile that loaded, so the failed load, its
# warning and an AllGather's gathers before it happen once, not every call.
FITTED = "triton.fitted_tiles"

if TYPE_CHECKING:
    from fo_kernels.gemm import BOperand
    from fo_kernels.runtime import OverlapRuntime
    from fo_kernels.scaling import Scales
    from fo_kernels.schedule import Schedule


class TritonEngine(Engine):
    """Engine ``triton`` (see the module docstring)."""

    name: ClassVar[str] = "triton"
    collectives: ClassVar[tuple[str, ...]] = ("all_reduce", "reduce_scatter", "all_gather")

    def blocker(self, device: torch.device, world_size: int) -> str:
        return ""  # the Triton GEMM and torch.distributed run on any device and backend

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
        # (own_graphs: this engine keeps no CUDA graphs or output pools of its own)
        from fo_kernels.engines.triton.executor import gathered, kmajor_fp8, overlapped

        if not a.is_contiguous():
            a = a.contiguous()
        if scales is not None:
            b = kmajor_fp8(b)
        fitted: dict[tuple[Tile, torch.dtype | None], Tile] = runtime.engine_state.setdefault(FITTED, {})
        key = (schedule.settings.tile, None if scales is None else scales.out_dtype)
        if key in fitted:
            schedule = with_tile(schedule, fitted[key])
        while True:
            try:
                with DeviceLimits(schedule.settings.tile, f"{a.dtype} operands"):
                    if schedule.collective == "all_gather":
                        result = gathered(schedule, a, b, runtime, scales)
                    else:
                        result = overlapped(schedule, a, b, runtime, scales)
            except DeviceLimitError as exc:
                schedule = fewer_stages(schedule, scales, exc)
                continue
            if schedule.settings.tile != key[0]:
                fitted[key] = schedule.settings.tile
            return result


def with_tile(schedule: Schedule, tile: Tile) -> Schedule:
    """``schedule`` with its Triton settings' tile replaced by ``tile``."""
    return dataclasses.replace(schedule, settings=dataclasses.replace(schedule.settings, tile=tile))


def fewer_stages(schedule: Schedule, scales: Scales | None, exc: DeviceLimitError) -> Schedule:
    """``schedule`` with one stage fewer, after its tile failed to load (``exc``) on an fp8 call whose
    ``out_dtype`` is wider than the one the tables are tuned with: a row's tile then runs, with a
    ``TileStagesWarning``, where it would not load. ``exc`` again otherwise (the tile was the
    caller's or the tuner's choice for this very output, or has no stage left to give). The kernel
    fails when Triton loads it; every rank of the call fails alike, so all of them run the retry,
    and an AllGather's chunks, already gathered, are gathered again into the new call's buffers."""
    tile = schedule.settings.tile
    wide = scales is not None and scales.out_dtype.itemsize > TUNED_OUT_BYTES
    if not wide or tile.num_stages <= MIN_RETRY_STAGES:
        raise exc
    fewer = dataclasses.replace(tile, num_stages=tile.num_stages - 1)
    warnings.warn(
        f"{exc}; fp8 tables are tuned for a bfloat16 output and this call's is {scales.out_dtype}: "
        f"it runs with {fewer.label()}",
        TileStagesWarning,
        stacklevel=2,
    )
    return with_tile(schedule, fewer)


ENGINE = TritonEngine
