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
- ``grouped_library_ms``: torch._grouped_mm as the larger of its compute and its reads. Compute:
  the dense library GEMM (``fo_tune.model.library``) of its rows, each filled expert's rows
  rounded up to whole 128-row tiles (a segment's last tile is computed whole), times
  ``GROUPED_UP_OVERHEAD`` / ``GROUPED_DOWN_OVERHEAD``. Reads: every filled expert's K x N weight
  once, the rows in (K) and out (N), at the weight stream rate (``WeightStream``);
- ``grouped_triton_ms``: the persistent Triton kernel's waves over its own tiles (each filled
  segment's rows rounded up to the tile's BLOCK_M, times ceil(N / BLOCK_N), over the grid, no split
  tail) at the tile's wave model slope (``TileProfile``: a wave per K without the fixed cost that
  the model fits over 2-32 waves, 38 us on the packaged profile, most of a decode call's time),
  times the same overheads, or its reads at ``TRITON_STREAM_SPEEDUP`` times the weight stream rate
  where slower: a segment is one (source, expert) pair there, and each reads its expert's weight.
  Against the kernel's times on one H100 (``bench/moe_grouped_gemm.py``, 128x256x64 on 132
  programs) its mean error is 13% at 1-256 tokens a rank and 8% at 4096 (the dense profile's time
  at the padded rows, read at the grouped rate: 48% and 8.5%, +19..+78% median by token count).

Filled segments (``filled_segments``): routing balanced in expectation, each of a GEMM's rows lands
on one of its S segments uniformly, so S (1 - (1 - 1/S)^rows) of them get a row. Each rank
receives exactly R rows (the balance above), so this is the draw over its own E_local experts
that ``bench/moe_grouped_gemm.py`` makes. The global form (every rank's T x k rows over all
E = w E_local experts, E_local (1 - (1 - 1/E)^(w T k))) gives 0-3% fewer on the suite from one
token a rank up (14% for Mixtral's 1-2 local experts at one token: it lets a rank receive no row,
which the balance above does not); an exact even split (min(R, S) segments) cannot be even where
R < S, and reads more (8 of 32 experts at DeepSeek-V3 EP 8, one token, 8 rows, against 7.2).

Weight stream rate (``weight_stream``): the fastest rate at which the calibration's own library
GEMM moved its bytes (A, B and C once) among its measured points of at most ``STREAM_MAX_ROWS``
rows, where the weights are most of the bytes: on the packaged calibration 256x8192x3584, 1.93
TB/s, measured on an H100 (a sibling: ``basis`` says so), times ``GROUPED_STREAM_SPEEDUP``. The
dense rate is a lower bound of the memory's: at 1-256 tokens a rank (``bench/moe_grouped_gemm.py
--tokens``, one H100) torch._grouped_mm read its filled experts' weights at a median 2.5 TB/s,
1.32x it, where near the ridge (Llama-4-Maverick EP 4 at 4096 tokens, 128 rows an expert: up 5.4
GB in 2.69 ms) it reached ~2.0 TB/s, its compute and reads overlapping less than the larger of
the two says. A calibration without such a point prices no reads (its ``basis`` says so).

Not modelled: the routing's sort and the row permutations, the weighted sum at the source, the
SwiGLU pass of the no-overlap path (the Triton path fuses it into its epilogue), skewed routing
(it fills fewer experts with more rows), weights reused from L2 (none of the suite's fit in it),
compute and reads that do not fully overlap (the model takes the larger: near the ridge, e.g.
Llama-4-Maverick EP 8 at 4096 tokens, the GEMM takes longer than either), fewer SMs streaming
slower (the Triton path's programs on SMs - sms_free read at the full rate), and a partial wave
of few long-K tiles running faster than a full wave's share (Mixtral's down: 16-32 tiles of K 14336
on 132 programs, priced +42..+53% slow; Llama-4-Maverick's down at one token +39..+46%).
Host time (``host_times``): eager calls; each path's launches at ``HOST_TORCH_OP_MS`` /
``HOST_TRITON_LAUNCH_MS``; a piece's two phases and what a call spends besides them from the
calibration's ``moe_host`` record (``fo-tune calibrate --only moe_host``, ``fo_tune.moe.host``: this
host's, measured on rank 0), else ``HOST_PHASE1_MS``, ``HOST_PHASE2_MS`` and ``HOST_CALL_MS``,
measured on one H100's host (other hosts read 1.2x-2.5x them). Every prediction's ``basis`` says
which.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fo_kernels.moe.schedule import MoeSchedule
from fo_kernels.plan import cdiv
from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import Calibration, CalibrationError
from fo_tune.model.core import CostModel, Terms
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
# Host time of a stage's phases (bf16, torch._grouped_mm): phase 1 of a piece (unpack, the up
# grouped GEMM, SwiGLU) and phase 2 (the down grouped GEMM, pack), and what a call spends besides
# them (the checks, the routing, the stages, the weighted sum): the medians over six models' experts
# at EP 4 and 8, 64 and 512 tokens a rank, of `python bench/moe_host.py` on one H100's host
# (results/bench/nvidia-h100-80gb-hbm3-cc90-132sm-w1-single/moe_host.csv: phase 1 0.125 ms, phase 2
# 0.086 ms, the whole call at world size 1 0.674 ms, so 0.46 ms besides its two phases). Two short
# runs (5 calls a median) on other hosts of that machine kind read 1.2x and 2.5x these: the host's
# speed sets them, not the GPU's. The copy engine issues both phases for every piece of every
# source: w x chunks of each.
# These are the fallback for a calibration without a ``moe_host`` record (``host_times``).
HOST_PHASE1_MS = 0.125
HOST_PHASE2_MS = 0.086
HOST_CALL_MS = 0.674 - HOST_PHASE1_MS - HOST_PHASE2_MS
# What a prediction's basis says of host times from those constants.
CONSTANT_HOST_CLAUSE = (
    "MoE host times: the packaged constants of one H100 host (fo-tune calibrate --world-size 1 "
    "--only moe_host measures this host's)"
)
# The counts exchange's first row: the signature (6 fields) and the tokens, int64; its second row
# holds the E_local counts (fo_kernels.moe.exchange).
COUNTS_FIELDS = 7
# The counts exchange's All-to-Alls: the signature rows, then the counts rows.
COUNTS_EXCHANGES = 2
COUNT_BYTES = 8
# The library GEMM points whose rate stands for the weights' (``weight_stream``): at most this many
# rows, where a bf16 GEMM does <= 256 flops per byte it moves, about an H100's ridge (989 TFLOP/s
# over 3.35 TB/s: 295) and above an H200's (206).
STREAM_MAX_ROWS = 256
# How much faster a grouped GEMM reads its weights than the dense library GEMM's best small-M rate
# (``weight_stream``), between the two regimes measured on one H100 against that rate (1.93 TB/s):
# 1.32x at decode sizes (1-256 tokens a rank, six models at EP 4 and 8, median 2.54 TB/s), 1.04x
# near the ridge (Llama-4-Maverick at 4096 tokens). 1.25 takes the model's error against both
# (results/bench/nvidia-h100-80gb-hbm3-cc90-132sm-w1-single/moe_grouped_gemm{,_decode}.csv) from a
# mean 28.5% at decode and 8.6% at 4096 tokens to 16.8% and 10.9% (docs/perf-notes.md, "MoE
# grouped GEMMs' weight reads").
GROUPED_STREAM_SPEEDUP = 1.25
# How much faster the Triton grouped kernel (one tile, 128x256x64 w8 s3, 132 programs) reads its
# weights than the grouped stream rate (``weight_stream``, fitted to torch._grouped_mm): on one H100
# it streamed its filled experts' weights at 2.8-3.1 TB/s where they are most of the time (16-256
# tokens a rank; results/bench/nvidia-h100-80gb-hbm3-cc90-132sm-w1-single/moe_grouped_gemm_decode.csv,
# fo_ms), 1.15-1.2x the grouped rate (2.41 TB/s on the packaged calibration); 1.15 and 1.2 give the
# same mean error there, 1.15 the lower at 4096 tokens (moe_grouped_gemm.csv).
TRITON_STREAM_SPEEDUP = 1.15
# A filled segment count within this of a whole one is that whole one (float rounding).
_FILL_SLACK = 1e-9


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
    def itemsize(self) -> int:
        """Bytes per element of the rows and the weights."""
        return element_bytes(self.dtype)

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.itemsize

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


def filled_segments(rows: int, segments: int) -> float:
    """The expected segments of ``segments`` that get at least one of ``rows`` rows, each row on
    one of them uniformly (see the module docstring)."""
    if rows <= 0 or segments <= 0:
        return 0.0
    return segments * -math.expm1(rows * math.log1p(-1.0 / segments)) if segments > 1 else 1.0


def padded_rows(rows: int, segments: int, block_m: int) -> int:
    """``rows`` split evenly over the filled ones of ``segments`` segments (``filled_segments``,
    rounded up), each rounded up to whole ``block_m`` tiles."""
    if rows <= 0 or segments <= 0:
        return 0
    filled = min(segments, math.ceil(filled_segments(rows, segments) - _FILL_SLACK))
    return filled * cdiv(cdiv(rows, filled), block_m) * block_m


@dataclass(frozen=True, slots=True)
class WeightStream:
    """The rate a grouped GEMM's reads are priced at (bytes per ms; inf: reads not priced) and the
    clause a prediction's ``basis`` gains from it ("": nothing to say: measured on this GPU)."""

    bytes_per_ms: float
    clause: str

    @property
    def gbs(self) -> float:
        return self.bytes_per_ms / 1e6


def weight_stream(cal: Calibration, dense: CostModel) -> WeightStream:
    """The fastest bytes per ms (A, B, C once each, beta 0) over ``dense``'s library time among
    its measured points of at most ``STREAM_MAX_ROWS`` rows (see the module docstring)."""
    library = dense.library
    itemsize = element_bytes(cal.base_dtype or cal.dtype)  # the points' dtype
    best, shape = math.inf, None
    for m, n, k, beta in library.points:
        if beta or m > STREAM_MAX_ROWS:
            continue
        t = library.time(m, n, k, sibling=True)
        if not 0 < t < math.inf:
            continue
        per_byte = t / ((m * k + k * n + m * n) * itemsize)
        if per_byte < best:
            best, shape = per_byte, (m, n, k)
    if shape is None:
        return WeightStream(
            math.inf,
            f"grouped GEMMs' weight reads not priced (the calibration has no library GEMM of <= "
            f"{STREAM_MAX_ROWS} rows; fo-tune calibrate --world-size 1 --only copy_engine_n measures some)",
        )
    rate = GROUPED_STREAM_SPEEDUP / best
    section = cal.copy_engine
    where = next(
        (
            p.measured_on
            for p in (section.library_gemm if section else ())
            if (p.m, p.n, p.k, p.beta) == (*shape, 0)
        ),
        "",
    )
    clause = ""
    if where:
        label = "x".join(map(str, shape))
        clause = (
            f"weights read at {rate / 1e6:.0f} GB/s, the library GEMM {label} measured on {where}, "
            "a sibling GPU"
        )
    return WeightStream(rate, clause)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostTimes:
    """The host times (ms) the model prices a call's phases with: ``phase1_ms`` and ``phase2_ms``
    of one piece, ``call_ms`` what a call spends besides its phases; ``clause``: what the
    prediction's basis says of them."""

    phase1_ms: float
    phase2_ms: float
    call_ms: float
    clause: str


def host_times(cal: Calibration) -> HostTimes:
    """The calibration's measured host times (its ``moe_host`` record: the call less its two
    phases, never below 0), else the constants of one H100 host (``HOST_PHASE1_MS`` ...). Host
    times do not depend on the world size: an extrapolated calibration keeps its origin's."""
    record = cal.moe_host
    if record is None:
        return HostTimes(
            phase1_ms=HOST_PHASE1_MS,
            phase2_ms=HOST_PHASE2_MS,
            call_ms=HOST_CALL_MS,
            clause=CONSTANT_HOST_CLAUSE,
        )
    # (an extrapolation's record is its measured origin's)
    where = record.measured_on or (cal.origin or cal).fingerprint.device_key
    return HostTimes(
        phase1_ms=record.phase1_ms,
        phase2_ms=record.phase2_ms,
        call_ms=max(0.0, record.call_ms - record.phase1_ms - record.phase2_ms),
        clause=f"MoE host times measured on {where}",
    )


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
        self.stream = weight_stream(cal, dense)
        self.host = host_times(cal)
        self._terms = Terms(terms, "the MoE model")

    @property
    def basis(self) -> str:
        """What the predictions rest on: the All-to-All's source, and the calibration's own basis
        where it was extrapolated (``fo_tune.calibrate.extrapolate``), and the weight stream
        rate's where it was measured on a sibling GPU or is missing, and where the host times
        come from (``host_times``)."""
        parts = (self.comm.basis, self.cal.basis, self.stream.clause, self.host.clause)
        return "; ".join(b for b in parts if b)

    def engines(self) -> tuple[str, ...]:
        return self._terms.names()

    def term(self, engine: str) -> Any:
        """The MoE term of ``engine`` (made on first use)."""
        return self._terms.get(engine, self)

    # ------------------------------------------------------------------------------ parts
    def counts_ms(self, call: MoeCall) -> float:
        """The counts exchange: the signature rows, then the counts rows (two All-to-Alls)."""
        head = self.comm.time(call.world * COUNTS_FIELDS * COUNT_BYTES)
        return head + self.comm.time(call.world * call.experts * COUNT_BYTES)

    def all_to_all_ms(self, call: MoeCall) -> float:
        """The dispatch (and the combine): an All-to-All of the call's rows."""
        return self.comm.time(call.rows * call.row_bytes)

    def weight_read_ms(self, rows: int, n: int, k: int, segments: int, itemsize: int) -> float:
        """A grouped GEMM's reads at the weight stream rate: each filled segment's K x N weight,
        the ``rows`` rows in (K) and out (N), ``itemsize`` bytes an element."""
        if rows <= 0 or segments <= 0:
            return 0.0
        weights = filled_segments(rows, segments) * k * n
        return (weights + rows * (k + n)) * itemsize / self.stream.bytes_per_ms

    def grouped_library_ms(
        self, rows: int, n: int, k: int, segments: int, *, up: bool, itemsize: int
    ) -> float:
        """torch._grouped_mm of ``rows`` over ``segments`` experts' weights (K x N each): the
        larger of its compute and its reads."""
        padded = padded_rows(rows, segments, LIBRARY_BLOCK_M)
        if padded == 0:
            return 0.0
        factor = GROUPED_UP_OVERHEAD if up else GROUPED_DOWN_OVERHEAD
        compute = self.dense.library.time(padded, n, k) * factor
        return max(compute, self.weight_read_ms(rows, n, k, segments, itemsize))

    def grouped_triton_ms(
        self, tile: Tile, rows: int, n: int, k: int, segments: int, grid: int, *, up: bool, itemsize: int
    ) -> float:
        """The Triton grouped GEMM of ``rows`` over ``segments`` segments on ``grid`` programs, the
        larger of its compute and its reads; ``CalibrationError`` for a tile the calibration did
        not profile."""
        padded = padded_rows(rows, segments, tile.block_m)
        if padded == 0:
            return 0.0
        factor = GROUPED_UP_OVERHEAD if up else GROUPED_DOWN_OVERHEAD
        # the persistent kernel's waves over its own tiles, no split tail (it splits none)
        waves = cdiv((padded // tile.block_m) * cdiv(n, tile.block_n), max(1, grid))
        compute = waves * self.triton_wave_ms(tile, k) * factor
        reads = self.weight_read_ms(rows, n, k, segments, itemsize) / TRITON_STREAM_SPEEDUP
        return max(compute, reads)

    def triton_wave_ms(self, tile: Tile, k: int) -> float:
        """One wave of ``tile`` over K ``k`` without the wave model's fixed cost: the model's time
        at two tiles on one program less its time at one (``CalibrationError`` for a tile the
        calibration did not profile)."""
        if not self.dense.knows_tile(tile):
            raise CalibrationError(
                f"the calibration has no GEMM profile for tile {tile.label()}; profile it with "
                "`fo-tune calibrate` (or `fo-tune profile`), or search in --mode measure"
            )
        one = self.dense.wave_model_time(tile, tile.block_m, tile.block_n, k, 1)
        return self.dense.wave_model_time(tile, 2 * tile.block_m, tile.block_n, k, 1) - one

    # ------------------------------------------------------------------------------ predictions
    @staticmethod
    def exchange_host_ms(call: MoeCall, collectives: int) -> float:
        """Host time of the counts exchange and ``collectives`` more eager collectives between the
        ranks (none at world size 1)."""
        return (COUNTS_EXCHANGES + collectives) * HOST_TORCH_OP_MS if call.world > 1 else 0.0

    def fallback(self, call: MoeCall) -> MoePrediction:
        """The no-overlap path (``engine: null``): every part one after the other."""
        a2a = self.all_to_all_ms(call)
        rows, inter, hidden, experts, size = (
            call.rows,
            call.intermediate,
            call.hidden,
            call.experts,
            call.itemsize,
        )
        up = self.grouped_library_ms(rows, 2 * inter, hidden, experts, up=True, itemsize=size)
        down = self.grouped_library_ms(rows, hidden, inter, experts, up=False, itemsize=size)
        counts = self.counts_ms(call)
        device = counts + a2a + up + down + a2a
        # the call, its two phases on every row, and (between ranks) the counts exchange, the
        # dispatch and the combine
        times = self.host
        host = times.call_ms + times.phase1_ms + times.phase2_ms + self.exchange_host_ms(call, 2)
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
