"""The cost model of one machine: what its calibration predicts for any schedule.

``CostModel(calibration, terms)`` holds the calibration's measurements as functions
(``profiles``), the library GEMM (``library``), and one term per engine, made on first use by the
factory it is handed for that engine (``fo_tune.engines.cost_model`` hands it every engine
plug-in's ``EngineTuner.term``; nothing here imports an engine). ``predict(schedule, m, n, k)``
asks the schedule's engine's term; an ``overlap: false`` schedule is the baseline:

    GEMM      = the library GEMM of (M, N, K) at the deciding measurements' clock
    comm      = the collective alone on the M x N output (NCCL's default communicator); for
                all_gather the gather of every rank's M/w x K shard into the M x K A, before the
                GEMM (its curve's size is the gathered bytes, nccl-tests sizing). Without the
                calibration's all_gather curve an all_gather is not priced (``CalibrationError``
                naming the section and the command that measures it); the shipped H200 x2
                calibration has none. No all_gather was measured on GPUs: unvalidated.
    sequential = max(GEMM + comm, sequential_host_ms)    eager, as the bench's sequential variant
    fallback   = max(GEMM + comm, fallback_host_ms)      the runtime's overlap: false call, replayed
                                                           from its own CUDA graphs

A row is decided against the fallback (what the row runs when it does not overlap).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fo_kernels.schedule import Schedule
from fo_kernels.tile import Tile
from fo_tune.calibrate.calibration import Calibration, CalibrationError
from fo_tune.model.library import PARAMS as LIBRARY_PARAMS
from fo_tune.model.library import LibraryGemm, LibraryPoint
from fo_tune.model.profiles import Curves, InterferenceTable, TileProfile
from fo_tune.model.types import Baseline, Interference, Prediction, element_bytes, output_bytes

# Host time of a baseline call (ms) when the calibration's copy_engine section does not say:
# the eager GEMM then collective 0.06 (one cuBLAS launch and one collective call, torch eager;
# docs/design.md#cost-model), the overlap: false fallback replayed from its graph 0.05 (median
# 32-67 us a call, docs/design.md#fallback).
DEFAULT_BASELINE_HOST = {"sequential_host_ms": 0.06, "fallback_host_ms": 0.05}


# Makes an engine's term from the model (the term keeps the model to read its measurements).
TermFactory = Callable[["CostModel"], Any]


class Terms:
    """A model's engine terms (the dense model's and the MoE model's alike): each made on first
    use by the factory handed for its engine, then kept."""

    def __init__(self, factories: Mapping[str, Callable[[Any], Any]], model_name: str) -> None:
        self._factories = dict(factories)
        self._made: dict[str, Any] = {}
        self._what = model_name  # what the error calls the model ("the cost model")

    def names(self) -> tuple[str, ...]:
        """The engines that have a term, in the order the factories were handed."""
        return tuple(self._factories)

    def get(self, engine: str, model: Any) -> Any:
        """``engine``'s term of ``model``; ``CalibrationError`` naming the engines that have one."""
        if engine not in self._made:
            factory = self._factories.get(engine)
            if factory is None:
                raise CalibrationError(
                    f"{self._what} has no term for engine {engine!r} (it has {', '.join(self._factories)})"
                )
            self._made[engine] = factory(model)
        return self._made[engine]


class CostModel:
    """Predictions for one calibration (see the module docstring)."""

    def __init__(self, cal: Calibration, terms: Mapping[str, TermFactory]) -> None:
        self.cal = cal
        self._terms = Terms(terms, "the cost model")
        self.sm_count = cal.fingerprint.sm_count
        self.world_size = cal.world_size
        self.tile_profile = TileProfile(cal)
        self.curves = Curves(cal)
        self.interference_table = InterferenceTable(cal)
        ce = cal.copy_engine.values() if cal.copy_engine is not None else {}
        if all(name in ce for name in LIBRARY_PARAMS):
            measured = cal.copy_engine.library_gemm if cal.copy_engine else []
            points = {(p.m, p.n, p.k, p.beta): LibraryPoint(p.paced_ms, p.sustained_ms) for p in measured}
            sibling = frozenset((p.m, p.n, p.k, p.beta) for p in measured if p.measured_on)
            if cal.library_ratio != 1.0:  # another dtype's GEMM (Calibration.for_dtype): its waves
                ce = {**ce, "library_wave_ms": ce["library_wave_ms"] * cal.library_ratio}
                points = {}  # (measured in the copy-engine section's dtype)
            self.library = LibraryGemm(ce, self.sm_count, points, sibling)
        else:
            self.library = LibraryGemm.from_cublas(self.tile_profile.cublas, self.sm_count)
        self.baseline_host = {key: ce.get(key, value) for key, value in DEFAULT_BASELINE_HOST.items()}

    # ------------------------------------------------------------------------------ the terms
    def term(self, engine: str) -> Any:
        """The cost-model term of ``engine`` (made by its factory on first use)."""
        return self._terms.get(engine, self)

    def predict(self, schedule: Schedule, m: int, n: int, k: int) -> Prediction:
        """Predicted latency of ``schedule`` on (m, n, k): its engine's term, or the fallback for
        ``overlap: false``. Raises ``ScheduleError`` when the schedule cannot run the shape."""
        if schedule.settings is None:
            base = self.baseline(schedule.collective, m, n, k, schedule.dtype)
            return Prediction(
                total_ms=base.fallback_ms,
                device_ms=base.gemm_ms + base.comm_ms,
                host_ms=self.baseline_host["fallback_host_ms"],
                gemm_alone_ms=base.gemm_ms,
                gemm_ms=base.gemm_ms,
                group_ready_ms=(base.gemm_ms,),
                group_start_ms=(base.gemm_ms,),
                group_end_ms=(base.gemm_ms + base.comm_ms,),
                group_comm_ms=(base.comm_ms,),
                exposed_comm_ms=base.comm_ms,
                gemm_source="library",
            )
        return self.term(schedule.settings.ENGINE).predict(schedule, m, n, k)

    # ------------------------------------------------------------------------------ baselines
    def baseline(self, collective: str, m: int, n: int, k: int, dtype: str) -> Baseline:
        """GEMM then the collective (all_gather: the gather, then the GEMM) on (m, n, k); an
        all_gather's ``m`` is the gathered M."""
        gemm = self.library.time(m, n, k)
        moved = m * k * element_bytes(dtype) if collective == "all_gather" else m * n * output_bytes(dtype)
        comm = self.curves.time(collective, 0, moved)
        return Baseline(
            gemm_ms=gemm,
            comm_ms=comm,
            sequential_ms=max(gemm + comm, self.baseline_host["sequential_host_ms"]),
            fallback_ms=max(gemm + comm, self.baseline_host["fallback_host_ms"]),
        )

    # ------------------------------------------------------------------------------ measured data
    def tiles(self) -> list[Tile]:
        """Tile configs the calibration profiled (the only ones the Triton term can predict)."""
        return self.tile_profile.tiles()

    def knows_tile(self, tile: Tile) -> bool:
        return self.tile_profile.knows(tile)

    def knows_collective(self, collective: str) -> bool:
        """The calibration has a bandwidth curve for ``collective``."""
        return self.curves.knows(collective)

    def gemm_time(self, tile: Tile, m: int, n: int, k: int, grid: int) -> tuple[float, str]:
        """(ms, source) of the signalled Triton GEMM alone on ``grid`` programs."""
        return self.tile_profile.time(tile, m, n, k, grid)

    def comm_time(self, collective: str, cap: int, nbytes: int) -> float:
        return self.curves.time(collective, cap, nbytes)

    def interference(self, collective: str, sms_free: int, cap: int) -> Interference:
        """How the collective and the Triton GEMM slow each other at (sms_free, cap)."""
        return self.interference_table.lookup(collective, sms_free, cap)

    def wave_model_time(self, tile: Tile, m: int, n: int, k: int, grid: int) -> float:
        """The tile's fitted wave model (ms), ignoring any profiled point."""
        return self.tile_profile.wave_model_time(tile, m, n, k, grid)
