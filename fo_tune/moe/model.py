"""The MoE cost model: the predicted time of one expert-parallel FFN call (``expert_parallel_ffn``
forward) on one calibration, for the no-overlap path and each engine's overlapped schedule.

A call, every rank alike (balanced routing: each rank's T x k rows spread evenly over the w
ranks, so each rank also receives R = T x k rows, R / w from each source, R / (w E_local) per
expert of a source):

    counts    the counts exchange: an All-to-All of w rows of (signature, tokens), then one of w
              rows of E_local counts
    dispatch  an All-to-All of T x k rows of H elements (nccl-tests size: the send buffer)
    up        the grouped GEMM (R, H) x (H, 2I), the SwiGLU after it
    down      the grouped GEMM (R, I) x (I, H)
    combine   an All-to-All of the results, as dispatch

    fallback  = counts + dispatch + up + down + combine            (engine: null, one step each)

Each engine's overlapped schedule is its term's (``fo_tune.engines.<engine>.moe``), handed in by
``fo_tune.engines.moe_cost_model`` (nothing here imports an engine). The terms read:

- ``comm``: the calibration's All-to-All, or one derived from another curve
  (``fo_tune.moe.alltoall``; its ``basis`` goes into every prediction);
- ``grouped_library_ms``: torch._grouped_mm as the dense library GEMM (``fo_tune.model.library``)
  of its rows, each expert's rows rounded up to whole 128-row tiles (a segment's last tile is
  computed whole), times ``GROUPED_UP_OVERHEAD`` / ``GROUPED_DOWN_OVERHEAD``;
- ``grouped_triton_ms``: the signalled Triton GEMM's tile profile (``TileProfile``) on the rows
  rounded per segment to the tile's BLOCK_M, times the same overheads (the Triton grouped kernel
  itself was not timed: the measured torch._grouped_mm overhead stands in for it).

Not modelled: the routing's sort and the row permutations, the weighted sum at the source, the
SwiGLU pass of the no-overlap path (the Triton path fuses it into its epilogue), skewed routing,
the read of every local expert's weights (a grouped GEMM is priced by its rows, as one dense GEMM
that reads one weight: with many experts of few rows each it is memory-bound, and predicted fast).
Host time: eager calls; each path's launches at ``HOST_*`` (see there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.plan import cdiv
from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import Calibration, CalibrationError
from fo_tune.model.core import CostModel
from fo_tune.model.types import element_bytes
from fo_tune.moe.alltoall import AllToAllCurve, all_to_all_curve

# torch._grouped_mm over one dense GEMM of the same rows, bf16, one H200, 2026-12-03 (issue 38; the
# design brief's "Measured since (one H200, 2026-12-03 ...)"): DeepSeek-V3 at EP=8 (32 experts,
# 32768 rows) up (K 7168, N 4096) 3.20 vs 2.89 ms, down (K 2048, N 7168) 1.71 vs 1.48 ms. The same
# run's other ratios: Qwen3-30B-A3B up 0.63 vs 0.56 (x1.125), Mixtral up 3.06 vs 2.88 (x1.063).
GROUPED_UP_OVERHEAD = 3.20 / 2.89
GROUPED_DOWN_OVERHEAD = 1.71 / 1.48
# Rows of the library GEMM's tile (``fo_tune.model.library.LIBRARY_TILES``: 128 x 256 and 128 x
# 128): each expert's rows round up to it.
LIBRARY_BLOCK_M = 128
# Host time of one eager torch op (a grouped GEMM, an All-to-All): the eager GEMM then collective
# took 0.06 ms of host time for its two calls (fo_tune.model.core.DEFAULT_BASELINE_HOST).
HOST_TORCH_OP_MS = 0.03
# Host time of one eager launch of a signalled Triton GEMM: ~84 us of CPU (docs/design.md, "The
# signalled GEMM's eager launch costs ~84 us of CPU", one H200).
HOST_TRITON_LAUNCH_MS = 0.084
# The counts exchange's first row: the signature (6 fields) and the tokens, int64; its second row
# holds the E_local counts (fo_kernels.moe.exchange).
COUNTS_FIELDS = 7
# The counts exchange's All-to-Alls: the signature rows, then the counts rows.
COUNTS_EXCHANGES = 2
COUNT_BYTES = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeCall:
    """One forward call's sizes: T tokens per rank of width H, k slots, E_local experts of
    intermediate size I on each of ``world`` ranks, in ``dtype``."""

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    world: int
    dtype: str

    @property
    def rows(self) -> int:
        """R: rows each rank sends and (balanced) receives."""
        return self.tokens * self.top_k

    @property
    def row_bytes(self) -> int:
        return self.hidden * element_bytes(self.dtype)

    @property
    def source_rows(self) -> int:
        """Rows from one source (R / w, rounded up)."""
        return cdiv(self.rows, self.world)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoePrediction:
    """The model's view of one call (ms). ``total_ms`` = max(device, host)."""

    total_ms: float
    device_ms: float
    host_ms: float
    dispatch_ms: float  # the dispatch All-to-All (or ring steps) alone
    up_ms: float  # the first grouped GEMM(s) alone
    down_ms: float  # the second grouped GEMM(s) alone
    combine_ms: float
    exposed_comm_ms: float  # device time not covered by a GEMM
    basis: str

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def padded_rows(rows: int, segments: int, block_m: int) -> int:
    """``rows`` split evenly over ``segments`` segments, each rounded up to whole ``block_m`` tiles."""
    if rows <= 0 or segments <= 0:
        return 0
    return segments * cdiv(cdiv(rows, segments), block_m) * block_m


# Makes an engine's MoE term from the model.
MoeTermFactory = Callable[["MoeCostModel"], Any]


class MoeCostModel:
    """Predictions of MoE calls on one calibration (see the module docstring)."""

    def __init__(self, cal: Calibration, dense: CostModel, terms: Mapping[str, MoeTermFactory]) -> None:
        self.cal = cal
        self.dense = dense
        self.world_size = cal.world_size
        self.sm_count = cal.fingerprint.sm_count
        self.comm: AllToAllCurve = all_to_all_curve(cal)
        self._factories = dict(terms)
        self._terms: dict[str, Any] = {}

    @property
    def basis(self) -> str:
        """What the predictions rest on: the All-to-All's source, and the calibration's own basis
        where it was extrapolated (``fo_tune.calibrate.extrapolate``)."""
        return f"{self.comm.basis}; {self.cal.basis}" if self.cal.basis else self.comm.basis

    def engines(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def term(self, engine: str) -> Any:
        """The MoE term of ``engine`` (made on first use)."""
        if engine not in self._terms:
            factory = self._factories.get(engine)
            if factory is None:
                raise CalibrationError(
                    f"the MoE model has no term for engine {engine!r} (it has {', '.join(self._factories)})"
                )
            self._terms[engine] = factory(self)
        return self._terms[engine]

    # ------------------------------------------------------------------------------ parts
    def counts_ms(self, call: MoeCall) -> float:
        """The counts exchange: the signature rows, then the counts rows (two All-to-Alls)."""
        head = self.comm.time(call.world * COUNTS_FIELDS * COUNT_BYTES)
        return head + self.comm.time(call.world * call.experts * COUNT_BYTES)

    def all_to_all_ms(self, call: MoeCall) -> float:
        """The dispatch (and the combine): an All-to-All of the call's rows."""
        return self.comm.time(call.rows * call.row_bytes)

    def grouped_library_ms(self, rows: int, n: int, k: int, segments: int, *, up: bool) -> float:
        """torch._grouped_mm of ``rows`` over ``segments`` experts' weights (K x N each)."""
        padded = padded_rows(rows, segments, LIBRARY_BLOCK_M)
        if padded == 0:
            return 0.0
        factor = GROUPED_UP_OVERHEAD if up else GROUPED_DOWN_OVERHEAD
        return self.dense.library.time(padded, n, k) * factor

    def grouped_triton_ms(
        self, tile: Tile, rows: int, n: int, k: int, segments: int, grid: int, *, up: bool
    ) -> float:
        """The Triton grouped GEMM of ``rows`` over ``segments`` segments on ``grid`` programs;
        ``CalibrationError`` for a tile the calibration did not profile."""
        padded = padded_rows(rows, segments, tile.block_m)
        if padded == 0:
            return 0.0
        factor = GROUPED_UP_OVERHEAD if up else GROUPED_DOWN_OVERHEAD
        return self.dense.gemm_time(tile, padded, n, k, grid)[0] * factor

    # ------------------------------------------------------------------------------ predictions
    def fallback(self, call: MoeCall) -> MoePrediction:
        """The no-overlap path (``engine: null``): every part one after the other."""
        a2a = self.all_to_all_ms(call)
        up = self.grouped_library_ms(call.rows, 2 * call.intermediate, call.hidden, call.experts, up=True)
        down = self.grouped_library_ms(call.rows, call.hidden, call.intermediate, call.experts, up=False)
        counts = self.counts_ms(call)
        device = counts + a2a + up + down + a2a
        # the counts exchange, the dispatch and the combine, two grouped GEMMs
        host = (COUNTS_EXCHANGES + 4) * HOST_TORCH_OP_MS
        return MoePrediction(
            total_ms=max(device, host),
            device_ms=device,
            host_ms=host,
            dispatch_ms=a2a,
            up_ms=up,
            down_ms=down,
            combine_ms=a2a,
            exposed_comm_ms=counts + 2 * a2a,
            basis=self.basis,
        )

    def predict(self, schedule: MoeSchedule, call: MoeCall) -> MoePrediction:
        """``schedule`` on ``call``: its engine's term, or the fallback for ``engine: null``.
        Raises ``ScheduleError`` / ``CalibrationError`` where it cannot be priced."""
        if schedule.engine is None:
            return self.fallback(call)
        return self.term(schedule.engine).predict(schedule, call)
