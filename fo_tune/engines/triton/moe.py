"""The Triton engine's MoE term: the ring of ``fo_kernels.engines.triton.moe`` priced on a calibration.

Rank r of w, s = R / w rows a source, ``step`` one ring step of s rows to one peer
(``AllToAllCurve.step_ms``), ``g1`` the SwiGLU grouped GEMM of one source's rows (E_local
segments), ``g2`` the persistent grouped GEMM over every source's rows (w x E_local segments),
both on SMs - sms_free programs (``MoeCostModel.grouped_triton_ms``; each segment with a row reads
its expert's weight, so g1 w times and g2's (source, expert) pairs read up to w times the
no-overlap path's weights)::

    comm: counts; steps j = 1 .. w-1 back to back        (step j lands source r - j)
    gemm: g1 of my own rows; for j: g1 of source r - j once it has landed
    gemm: g2, its tiles source by source (r - 1, ..., r - (w - 1), then mine)
    comm: for each source, once its share of g2 is done: one step sending its rows back
    device = the later of the last send and the end of g2

While both run, the GEMM and the steps slow each other by the calibration's interference at
(sms_free, the NCCL cap) (``CostModel.interference``: All-to-All was never timed beside the GEMM,
so the nearest calibrated collective's); where it says the collective does not run beside the
GEMM at that point, nothing overlaps and the parts add up. Host: w + 1 Triton launches, 2 (w - 1)
ring steps and the counts exchange, eager, and the call's own (the model's ``host.call_ms``,
``fo_tune.moe.model.host_times``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from fo_kernels.errors import ScheduleError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import Calibration
from fo_tune.engines.triton.tuner import CALIBRATE_GEMM
from fo_tune.moe.model import (
    HOST_TORCH_OP_MS,
    HOST_TRITON_LAUNCH_MS,
    MoeCall,
    MoeCostModel,
    MoePrediction,
)

# The space section's keys, each a list of candidates.
SPACE_KEYS = ("tiles", "sms_free", "nccl_max_ctas", "wait_modes")


class TritonMoeTerm:
    """Prices ``engine: triton`` MoE schedules (see the module docstring)."""

    name = "triton"
    SPACE_KEYS = SPACE_KEYS

    def __init__(self, model: MoeCostModel) -> None:
        self.model = model

    @staticmethod
    def blocker(fingerprint: Fingerprint) -> str:
        """Why the path cannot run on that machine ("": any GPU, any world size)."""
        return ""

    @staticmethod
    def calibration_gap(cal: Calibration) -> str:
        if not any(p.status == "ok" for p in cal.gemm):
            from fo_tune.calibrate.missing import measure_into

            return (
                f"needs the calibration's GEMM tile profile; {measure_into(cal, CALIBRATE_GEMM, 'one GPU')}"
            )
        return ""

    def points(self, section: Mapping[str, Any], call: MoeCall) -> Iterator[dict[str, Any]]:
        """The section's points (``MoeSchedule`` fields) whose tile the calibration profiled."""
        tiles = [t for t in section.get("tiles", ()) if self.model.dense.knows_tile(t)]
        for tile, free, cap, wait in itertools.product(
            tiles,
            section.get("sms_free", (0,)),
            section.get("nccl_max_ctas", (0,)),
            section.get("wait_modes", ("stream_wait",)),
        ):
            if free < self.model.sm_count:
                yield {
                    "engine": "triton",
                    "tile": tile,
                    "sms_free": free,
                    "nccl_max_ctas": cap,
                    "wait_mode": wait,
                }

    def predict(self, schedule: MoeSchedule, call: MoeCall) -> MoePrediction:
        m = self.model
        tile: Tile = schedule.tile
        grid = m.sm_count - schedule.sms_free
        if grid < 1:
            raise ScheduleError(f"sms_free: {schedule.sms_free} leaves no SM of {m.sm_count}")
        w, s, cap = call.world, call.source_rows, schedule.nccl_max_ctas
        hidden, inter, experts = call.hidden, call.intermediate, call.experts
        step = m.comm.step_ms(s * call.row_bytes, cap)
        size = call.itemsize
        g1 = m.grouped_triton_ms(tile, s, 2 * inter, hidden, experts, grid, up=True, itemsize=size)
        g2 = m.grouped_triton_ms(tile, call.rows, hidden, inter, w * experts, grid, up=False, itemsize=size)
        counts = m.counts_ms(call)
        noted = m.dense.interference("all_to_all", schedule.sms_free, cap)
        overlap = noted.concurrent and w > 1
        comm_slow = noted.comm_slowdown if overlap else 1.0
        gemm_slow = noted.gemm_slowdown if overlap else 1.0
        if overlap:
            t_comm, t_gemm = counts, counts + g1 * gemm_slow
            for _ in range(w - 1):
                t_comm += step * comm_slow
                t_gemm = max(t_gemm, t_comm) + g1 * gemm_slow
            start, share = t_gemm, g2 * gemm_slow / w
            t_send = start
            for i in range(1, w):
                t_send = max(t_send, start + i * share) + step * comm_slow
            device = max(t_send, start + g2 * gemm_slow)
            gemm_total = (w * g1 + g2) * gemm_slow
        else:
            gemm_total = w * g1 + g2
            device = counts + 2 * (w - 1) * step + gemm_total
        launches = (w + 1) * HOST_TRITON_LAUNCH_MS + 2 * (w - 1) * HOST_TORCH_OP_MS
        host = m.host.call_ms + m.exchange_host_ms(call, 0) + launches
        basis = m.basis if overlap or w == 1 else f"{m.basis}; no overlap at this point ({noted.matched})"
        return MoePrediction(
            total_ms=max(device, host),
            device_ms=device,
            host_ms=host,
            dispatch_ms=(w - 1) * step,
            up_ms=w * g1,
            down_ms=g2,
            combine_ms=(w - 1) * step,
            exposed_comm_ms=max(0.0, device - gemm_total),
            basis=basis,
        )


MOE_TERM = TritonMoeTerm
