"""The copy engine's MoE term: the protocol of ``fo_kernels.engines.copy_engine.moe_protocol``
priced on a calibration.

Rank r of w, s = R / w rows a source cut into C pieces (``chunks``: ranges of ceil(E_local / C)
experts, s / C rows each); ``push`` a copy-engine copy of one piece into a peer
(``peer_copy_latency_ms + bytes / peer_copy_gbs``) and its flag (``flag_ms``); ``up`` / ``down``
torch._grouped_mm of one piece (``MoeCostModel.grouped_library_ms``: each piece reads the weights
of its experts that its rows reach, w C pieces in all) times ``copy_contention`` plus
``chunk_overhead_ms``::

    side:  counts; for j = 1 .. w-1: for c: push piece c of my rows for r + j    (back to back)
    main:  up of my own C pieces; for j: for c: up of piece (r - j, c) once it has landed
    main:  for j: for c: down of piece (r - j, c)             side: push it back once done
    main:  down of my own C pieces (last: they go nowhere)
    local: copy every peer's returned rows out of the outbox
    device = the later of main and the last copy out

Host: every operation of the list issued eagerly at ``host_eager_op_ms`` (the calibration's fit
over the dense copy engine's calls), each Phase's torch ops besides (the model's ``host``
phase times, ``fo_tune.moe.model.host_times``: w x C of each), the call's own (its ``call_ms``)
and the counts exchange.
Needs the calibration's copy_engine section.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from fo_kernels.errors import ScheduleError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.plan import cdiv
from fo_tune.calibrate.calibration import Calibration
from fo_tune.engines.copy_engine.tuner import params_gap, peer_blocker
from fo_tune.moe.model import MoeCall, MoeCostModel, MoePrediction

# The calibration's copy_engine parameters this term reads.
PARAMS = (
    "peer_copy_latency_ms",
    "peer_copy_gbs",
    "local_copy_latency_ms",
    "local_copy_gbs",
    "flag_ms",
    "copy_contention",
    "chunk_overhead_ms",
    "host_eager_op_ms",
)
SPACE_KEYS = ("chunks",)
# Operations of the list per piece and direction: the copy, its flag, the wait on it.
OPS_PER_PUSH = 3


class CopyEngineMoeTerm:
    """Prices ``engine: copy_engine`` MoE schedules (see the module docstring)."""

    name = "copy_engine"
    SPACE_KEYS = SPACE_KEYS

    def __init__(self, model: MoeCostModel) -> None:
        self.model = model
        section = model.cal.copy_engine
        self.p = section.values() if section is not None else {}

    @staticmethod
    def blocker(fingerprint: Fingerprint) -> str:
        return peer_blocker(fingerprint, "rows")

    @staticmethod
    def calibration_gap(cal: Calibration) -> str:
        return params_gap(cal, PARAMS)

    def points(self, section: Mapping[str, Any], call: MoeCall) -> Iterator[dict[str, Any]]:
        """One point per ``chunks`` candidate that cuts the local experts into non-empty ranges."""
        for chunks in section.get("chunks", (1,)):
            if chunks <= call.experts:
                yield {"engine": "copy_engine", "chunks": chunks}

    def _copy(self, nbytes: int, kind: str) -> float:
        if nbytes <= 0:
            return 0.0
        return self.p[f"{kind}_copy_latency_ms"] + nbytes / (self.p[f"{kind}_copy_gbs"] * 1e6)

    def predict(self, schedule: MoeSchedule, call: MoeCall) -> MoePrediction:
        m, p = self.model, self.p
        chunks, w = schedule.chunks, call.world
        if chunks > call.experts:
            raise ScheduleError(f"chunks: {chunks} pieces of {call.experts} local experts leave some empty")
        rows = cdiv(call.source_rows, chunks)
        segments = cdiv(call.experts, chunks)
        slow, extra = p["copy_contention"], p["chunk_overhead_ms"]
        hidden, inter = call.hidden, call.intermediate
        size = call.itemsize
        up = m.grouped_library_ms(rows, 2 * inter, hidden, segments, up=True, itemsize=size) * slow + extra
        down = m.grouped_library_ms(rows, hidden, inter, segments, up=False, itemsize=size) * slow + extra
        push = self._copy(rows * call.row_bytes, "peer") + p["flag_ms"]
        counts = m.counts_ms(call)
        t_side, landed = counts, []
        for _ in range((w - 1) * chunks):
            t_side += push
            landed.append(t_side)
        t_main = counts + chunks * up
        for t in landed:
            t_main = max(t_main, t) + up
        t_back = max(t_side, t_main)
        for _ in range((w - 1) * chunks):
            t_main += down
            t_back = max(t_back, t_main) + push
        t_main += chunks * down
        peers = w - 1
        t_local = t_back + peers * self._copy(call.source_rows * call.row_bytes, "local") if peers else 0.0
        device = max(t_main, t_local)
        pushes = 2 * peers * chunks
        ops = OPS_PER_PUSH * pushes + 2 * w * chunks + 2 * peers + 1
        phases = w * chunks * (m.host.phase1_ms + m.host.phase2_ms)
        host = m.host.call_ms + m.exchange_host_ms(call, 0) + phases + ops * p["host_eager_op_ms"]
        gemm_total = w * chunks * (up + down)
        return MoePrediction(
            total_ms=max(device, host),
            device_ms=device,
            host_ms=host,
            dispatch_ms=peers * chunks * push,
            up_ms=w * chunks * up,
            down_ms=w * chunks * down,
            combine_ms=peers * chunks * push,
            exposed_comm_ms=max(0.0, device - gemm_total),
            basis=f"{m.basis}; pushes at the copy_engine section's peer copies",
        )


MOE_TERM = CopyEngineMoeTerm
