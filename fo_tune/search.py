"""``fo-tune search`` as a library call: one Optuna study per shape, the best schedule as a table row.

    run_search(SearchRequest(shapes=((4096, 8192, 4096),), collective="all_reduce", mode="predict"))

Per shape (an ``--m-range`` adds the range's M values for each (N, K)):

1. The encoding (``fo_tune.encoding``) of the space's candidates for this shape.
2. The study ``<collective>-w<W>-<dtype>-<M>x<N>x<K>-<mode>-<space digest>`` in ``storage``
   (re-running the same command resumes it; several workers may share it). Sampler: Optuna's TPE
   (``TPESampler``): the space is categorical with conditional parameters (the custom grouping's
   cuts exist only for some group counts), which TPE samples natively; CMA-ES and GP samplers want
   a fixed numeric space. ``constant_liar`` keeps parallel workers from proposing the same point.
3. Warm start (a new study only): ``enqueue_trial`` of the heuristic default schedule, the same
   config with the model's DP grouping, and the nearest existing row of the target table.
4. Trials: infeasible points are pruned before anything runs; a schedule already completed in the
   study is answered from that trial (``cached_from``); every trial is predicted by the cost model
   when the calibration knows its tile. ``measure``: every trial checked then timed on the ranks;
   ``predict``: the model's value, no GPU; ``hybrid``: the model ranks ``trials`` points (an
   in-memory predict study plus the space's enumeration when small) and the ``top_k`` best distinct
   schedules are measured. ``exhaustive`` (measure/predict): every enumerated point.
5. The baseline (cuBLAS then the collective) is measured, or predicted. A measured search then
   re-times its ``CONFIRM_TOP`` best distinct schedules beside the baseline and the runtime's
   ``overlap: false`` fallback (what the row runs if it does not overlap) in alternating rounds
   (``ConfirmTask``) and takes the fastest of those; it becomes the row unless it beats the
   fallback (the baseline where the fallback was not timed) by no more than
   ``max(MIN_GAIN x fallback, measured spread)``, then the row says ``overlap: false``. The spread
   is the larger interquartile range of the two timings' samples (max - min is kept in the report
   but is set by single outliers).

The rows are merged into the table (``fo_tune.tables.merge_rows``, under a file lock); the report
(``fo_tune.search_report``) lists every trial with its predicted and measured latency.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import itertools
import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fo_kernels.errors import FoTuneError, ScheduleError, ShapeError, TableError, TableNotFoundError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.heuristics import default_schedule
from fo_kernels.plan import check_fits
from fo_kernels.schedule import COLLECTIVES, COPY_ENGINE_WORLD, DTYPES, Problem, Schedule
from fo_kernels.table import ScheduleTable, load_table, table_path

from .calibration import Calibration
from .encoding import Encoding, Infeasible, schedule_key
from .launch import fingerprinted_pool, visible_gpus
from .limits import Target, check_problem_size, fingerprint_target, local_target
from .model import CostModel
from .progress import Reporter, SilentReporter
from .space import SearchSpace, space_for
from .studies import DEFAULT_STORAGE_FILE, check_storage_url, is_rdb, open_storage
from .timing import Timing
from .trials import Measurer, Objective

MODES = ("measure", "predict", "hybrid")
# Trials per shape when --trials is not given: the model answers in well under a millisecond, so a
# predict study of 200 trials stays within the 10 s an offline search may take on a 2-core CPU;
# a measured trial takes ~0.1-1 s on H200 x2 (check + back-to-back timing).
DEFAULT_TRIALS = {"predict": 200, "measure": 40, "hybrid": 300}
# Schedules a hybrid search measures per shape.
DEFAULT_TOP_K = 8
# The no-gain fallback: overlap must beat GEMM-then-collective by at least this fraction, beyond the
# 2-4% the baseline drifts between measurements (docs/design.md#search).
MIN_GAIN = 0.02
# Measured searches re-time their best few distinct schedules beside GEMM-then-collective in
# alternating rounds before deciding the row: on H200 x2 the baseline drifted 2-4% between
# measurements minutes apart (docs/design.md#search), as much as the gains being decided on.
CONFIRM_TOP = 3
# --exhaustive refuses a space with more points than this for one shape (the shipped H200 space has
# ~22,000: hours of measurement); bench/h200_small_space.yaml has 112-128.
EXHAUSTIVE_LIMIT = 4000
# Hybrid: the space's enumeration is predicted in full when it has at most this many points.
ENUMERATE_LIMIT = 4000


class SearchError(FoTuneError, ValueError):
    """Bad search input (shapes, mode, calibration, storage); the message says what to do."""


@dataclass(frozen=True, kw_only=True)
class SearchRequest:
    shapes: tuple[tuple[int, int, int], ...]
    collective: str = "all_reduce"
    world_size: int = 2
    dtype: str = "bfloat16"
    mode: str = "predict"
    trials: int | None = None  # None: DEFAULT_TRIALS[mode]
    top_k: int = DEFAULT_TOP_K
    time_budget_s: float | None = None  # for the whole command, shared by the shapes left
    m_range: tuple[int, int] | None = None
    storage: str = ""  # an Optuna URL, "journal:PATH"; "" = sqlite at DEFAULT_STORAGE_FILE
    calibration: Calibration | None = None
    space: SearchSpace | None = None
    backend: str | None = None  # measure / hybrid
    exhaustive: bool = False
    seed: int = 0
    reps: int = 10
    table_dir: Path | None = None  # None: no table written (the caller writes)

    def trial_count(self) -> int:
        return self.trials if self.trials is not None else DEFAULT_TRIALS[self.mode]


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One trial of a study, flattened for the report."""

    shape: str
    number: int
    state: str  # COMPLETE, PRUNED (infeasible or failed check), FAIL, RUNNING, WAITING
    params: dict[str, Any]
    schedule: str
    predicted_ms: float
    measured_ms: float
    spread_ms: float
    rel_err: float
    value_ms: float
    speedup: float  # baseline / value
    cached_from: int | None
    note: str


@dataclass(frozen=True, slots=True)
class BaselineResult:
    source: str  # "measured" or "predicted"
    gemm_ms: float
    comm_ms: float
    sequential_ms: float
    spread_ms: float
    iqr_ms: float
    predicted_ms: float  # the model's sequential (nan without a model)


@dataclass(slots=True)
class ShapeResult:
    shape: tuple[int, int, int]
    study: str
    mode: str
    baseline: BaselineResult
    row: Schedule
    best_ms: float  # measured: the fastest re-timed median (confirmation); else the best trial's value
    best_trial: int | None  # its Optuna trial (None: a copy-engine schedule, not a trial)
    best_schedule: Schedule | None  # the fastest overlapped schedule, even when the row says no overlap
    confirmed: list[dict[str, Any]]  # measured searches: the best few re-timed beside the baseline
    speedup: float  # baseline / row's latency (1.0 for overlap: false)
    decision: str  # why the row is what it is
    trials: list[TrialRecord]
    measured: int  # trials timed on the ranks in this run (cache hits excluded)
    wall_s: float
    mape: float  # over trials with both numbers (nan if none)
    worst_ape: float


@dataclass(slots=True)
class SearchResult:
    request: SearchRequest
    fingerprint: Fingerprint
    shapes: list[ShapeResult]
    range_rows: list[Schedule] = field(default_factory=list)
    table: Path | None = None
    wall_s: float = 0.0
    storage: str = ""


# ------------------------------------------------------------------------------------ validation
def m_values(lo: int, hi: int) -> list[int]:
    """M values an ``--m-range`` tunes: lo, every power of two strictly inside, and hi."""
    out = [lo]
    p = 1 << lo.bit_length()
    while p < hi:
        if p > lo:
            out.append(p)
        p <<= 1
    if hi > lo:
        out.append(hi)
    return out


def expand_shapes(request: SearchRequest) -> list[tuple[int, int, int]]:
    """The exact shapes the request tunes (``--m-range`` replaces M by the range's values)."""
    if request.m_range is None:
        return list(dict.fromkeys(request.shapes))
    lo, hi = request.m_range
    pairs = list(dict.fromkeys((n, k) for _, n, k in request.shapes))
    return [(m, n, k) for n, k in pairs for m in m_values(lo, hi)]


def check_request(request: SearchRequest) -> None:
    """Everything checkable before a rank starts or anything is written (``SearchError``)."""
    if request.collective not in COLLECTIVES:
        raise SearchError(f"--collective {request.collective!r} is not one of {', '.join(COLLECTIVES)}")
    if request.dtype not in DTYPES:
        raise SearchError(f"--dtype {request.dtype!r} is not one of {', '.join(DTYPES)}")
    if request.mode not in MODES:
        raise SearchError(f"--mode {request.mode!r} is not one of {', '.join(MODES)}")
    if request.world_size < 1:
        raise SearchError(f"--world-size must be >= 1, got {request.world_size}")
    if not request.shapes:
        raise SearchError("no shape to search: give --shape MxNxK (repeatable) or --shapes FILE")
    if request.trials is not None and request.trials < 1:
        raise SearchError(f"--trials must be >= 1, got {request.trials}")
    if request.top_k < 1:
        raise SearchError(f"--top-k must be >= 1, got {request.top_k}")
    if request.time_budget_s is not None and not request.time_budget_s > 0:
        raise SearchError(f"--time-budget must be > 0 seconds, got {request.time_budget_s}")
    check_storage_url(request.storage)
    if request.exhaustive and request.mode == "hybrid":
        raise SearchError("--exhaustive enumerates the space in --mode measure or predict, not hybrid")
    if request.m_range is not None:
        lo, hi = request.m_range
        if not 1 <= lo <= hi:
            raise SearchError(f"--m-range {lo}:{hi}: needs 1 <= LO <= HI")
        if request.collective == "reduce_scatter" and (lo % request.world_size or hi % request.world_size):
            raise SearchError(
                f"--m-range {lo}:{hi}: reduce_scatter needs LO and HI divisible by the world size "
                f"{request.world_size}"
            )
    for m, n, k in expand_shapes(request):
        if min(m, n, k) < 1:
            raise SearchError(f"shape {m}x{n}x{k}: M, N and K must be >= 1")
        if request.collective == "reduce_scatter" and m % request.world_size:
            raise SearchError(
                f"shape {m}x{n}x{k}: reduce_scatter needs M divisible by the world size "
                f"{request.world_size}; choose another M"
            )
    if request.mode in ("predict", "hybrid"):
        cal = request.calibration
        if cal is None:
            raise SearchError(f"--mode {request.mode} needs a calibration: pass --calibration FILE")
        if cal.dtype != request.dtype:
            raise SearchError(
                f"the calibration was measured with {cal.dtype}, the search is for {request.dtype}; "
                f"calibrate with `fo-tune calibrate --dtype {request.dtype}` or search --dtype {cal.dtype}"
            )
        if cal.world_size != request.world_size:
            raise SearchError(
                f"the calibration is for world size {cal.world_size}, the search for {request.world_size}; "
                f"calibrate with `fo-tune calibrate --world-size {request.world_size}`"
            )
    check_problem_size(expand_shapes(request), request.dtype, _target(request))


def _target(request: SearchRequest) -> Target:
    """Where the searched shapes run: the calibration's machine when planning offline, else the
    ranks this search starts here."""
    if request.mode == "predict":
        assert request.calibration is not None
        return fingerprint_target(request.calibration.fingerprint)
    backend = request.backend or ("nccl" if visible_gpus() else "gloo")
    return local_target(backend, request.world_size)


def check_table_target(path: Path, fingerprint: Fingerprint) -> None:
    """Refuse (before searching) a table file that is malformed or for other hardware."""
    try:
        table = load_table(path)
    except TableNotFoundError:
        return
    theirs = table.fingerprint
    if (theirs.device_key, theirs.world_size) != (fingerprint.device_key, fingerprint.world_size):
        raise TableError(
            f"table {path} is for {theirs.device_key}, this search is for {fingerprint.device_key}; "
            "pass another --table-dir (or --out)"
        )


def study_name(request: SearchRequest, shape: tuple[int, int, int], enc: Encoding, context: str) -> str:
    """``<collective>-w<W>-<dtype>-<MxNxK>-<mode>-<digest>``; the digest covers the space's choices
    and ``context`` (the device key, and the calibration the model reads), so a study is resumed
    only by the same search on the same machine with the same model."""
    m, n, k = shape
    what = json.dumps([enc.fingerprint(), context], sort_keys=True)
    digest = hashlib.sha1(what.encode()).hexdigest()[:8]
    return f"{request.collective}-w{request.world_size}-{request.dtype}-{m}x{n}x{k}-{request.mode}-{digest}"


# -------------------------------------------------------------------------------------- driver
def _heuristic(request: SearchRequest, shape: tuple[int, int, int], sm_count: int, on_gpu: bool) -> Schedule:
    m, n, k = shape
    return default_schedule(
        request.collective,
        m,
        n,
        k,
        dtype=request.dtype,
        world_size=request.world_size,
        sm_count=sm_count,
        on_gpu=on_gpu,
    )


def _nearest_row(table: ScheduleTable | None, shape: tuple[int, int, int]) -> Schedule | None:
    if table is None:
        return None
    m, n, k = shape
    rows = [
        r
        for r in table.rows
        if r.overlap and r.engine == "triton" and not r.problem.is_range and r.problem.m != m
    ]
    same = [r for r in rows if (r.problem.n, r.problem.k) == (n, k)] or rows
    if not same:
        return None
    return min(same, key=lambda r: abs(math.log(r.problem.m * r.problem.n * r.problem.k / (m * n * k))))  # type: ignore[operator]


def _warm_start(
    study: Any, enc: Encoding, request: SearchRequest, heuristic: Schedule, near: Schedule | None
) -> int:
    """Enqueue the heuristic default (and its config with the DP grouping) and the nearest row."""
    seeds = []
    if heuristic.overlap and enc.sms_free and heuristic.sms_free not in enc.sms_free:
        # the heuristic's wave-aligned sms_free is rarely a candidate: take the nearest one
        near_r = min(enc.sms_free, key=lambda r: (abs(r - heuristic.sms_free), r))
        heuristic = dataclasses.replace(heuristic, sms_free=near_r)
    params = enc.params_of(heuristic)
    if params is not None:
        seeds.append(params)
        if "dp" in enc.groupings:
            seeds.append(
                {key: v for key, v in params.items() if not key.startswith(("cut_", "num_groups"))}
                | {"grouping": "dp"}
            )
    if near is not None:
        adapted = dataclasses.replace(near, problem=Problem(m=enc.m, n=enc.n, k=enc.k))
        params = enc.params_of(_regroup_exact(adapted))
        if params is not None:
            seeds.append(params)
    for p in seeds:
        study.enqueue_trial(p, skip_if_exists=True)
    return len(seeds)


def _regroup_exact(schedule: Schedule) -> Schedule:
    """A row taken to another M: its groups read as relative weights (``resolve_groups``)."""
    from fo_kernels.plan import resolve_groups

    from .model import num_units

    p = schedule.problem
    assert p.m is not None
    units = num_units(schedule, p.m, p.n)
    return dataclasses.replace(schedule, groups=resolve_groups(schedule.groups, units, exact=False))


def _rank_by_model(
    enc: Encoding, model: CostModel, trials: int, seed: int
) -> list[tuple[float, dict[str, Any], str]]:
    """(predicted ms, params, key) of distinct feasible schedules, best first: the enumeration when
    it is small, plus an in-memory TPE study of ``trials`` predictions."""
    import optuna

    seen: dict[str, tuple[float, dict[str, Any], str]] = {}

    def consider(params: dict[str, Any]) -> float:
        schedule = enc.build(params, model)
        key = schedule_key(schedule)
        pred = model.predict(schedule, enc.m, enc.n, enc.k).total_ms
        if key not in seen or pred < seen[key][0]:
            seen[key] = (pred, dict(params), key)
        return pred

    points = list(_take(enc.enumerate(), ENUMERATE_LIMIT + 1))
    if len(points) <= ENUMERATE_LIMIT:
        for params in points:
            with contextlib.suppress(Infeasible):
                consider(params)

    def objective(trial: Any) -> float:
        params = enc.suggest(trial)
        try:
            return consider(params)
        except Infeasible as exc:
            raise optuna.TrialPruned(str(exc)) from None

    sampler = optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.optimize(objective, n_trials=trials)
    return sorted(seen.values(), key=lambda item: item[0])


def _params_key(params: Mapping[str, Any]) -> str:
    return json.dumps(dict(params), sort_keys=True, default=str)


def _take(it: Iterator[Any], limit: int) -> Iterator[Any]:
    for i, x in enumerate(it):
        if i >= limit:
            return
        yield x


def _records(study: Any, shape: str, baseline_ms: float) -> list[TrialRecord]:
    out = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        value = float(t.value) if t.value is not None else math.nan
        out.append(
            TrialRecord(
                shape=shape,
                number=t.number,
                state=t.state.name,
                params=dict(t.params),
                schedule=str(ua.get("schedule", "")),
                predicted_ms=float(ua.get("predicted_ms", math.nan)),
                measured_ms=float(ua.get("measured_ms", math.nan)),
                spread_ms=float(ua.get("spread_ms", math.nan)),
                rel_err=float(ua.get("rel_err", math.nan)),
                value_ms=value,
                speedup=baseline_ms / value if value > 0 else math.nan,
                cached_from=ua.get("cached_from"),
                note=str(ua.get("note", "")),
            )
        )
    return out


def model_error(records: Sequence[TrialRecord]) -> tuple[float, float]:
    """(MAPE, worst absolute percentage error) of predicted vs measured, over distinct measured trials."""
    errs = [
        abs(r.predicted_ms - r.measured_ms) / r.measured_ms
        for r in records
        if r.cached_from is None and r.measured_ms > 0 and not math.isnan(r.predicted_ms)
    ]
    if not errs:
        return math.nan, math.nan
    return sum(errs) / len(errs), max(errs)


def _decide(
    best_ms: float, best_iqr: float, base_ms: float, base_iqr: float, base: str = "sequential"
) -> tuple[bool, float, str]:
    """(overlap?, speedup, decision text): overlap only when it gains more than
    ``max(MIN_GAIN x baseline, the larger interquartile range of the two timings)``; ``base``
    names the baseline in the text."""
    noise = [x for x in (base_iqr, best_iqr) if not math.isnan(x)]
    need = max(MIN_GAIN * base_ms, max(noise, default=0.0))
    gain = base_ms - best_ms
    if gain <= need:
        return (
            False,
            1.0,
            f"best {best_ms:.3f} ms vs {base} {base_ms:.3f} ms: gain {gain:.3f} ms <= "
            f"{need:.3f} ms (max of {MIN_GAIN:.0%} and the timings' interquartile range)",
        )
    return True, base_ms / best_ms, f"overlap {base_ms / best_ms:.3f}x over {base}"


def _distinct_best(trials: Sequence[Any], count: int) -> list[Any]:
    out, seen = [], set()
    for t in sorted(trials, key=lambda t: t.value):
        key = t.user_attrs.get("key")
        if key in seen:
            continue
        seen.add(key)
        out.append(t)
        if len(out) == count:
            break
    return out


def _copy_engine_candidates(
    request: SearchRequest, space: SearchSpace, shape: tuple[int, int, int], cpu: bool
) -> list[Schedule]:
    """``engine: copy_engine`` schedules that a measured search on two GPUs re-times beside its
    best Triton schedules: one per chunk count of the space (equal chunks) and per extra weighting;
    the tiled mode's chunk counts with each of its tiles (16-bit inputs). The cost model does not
    price them (it knows NCCL and the Triton GEMM), so they are measured, never predicted."""
    if cpu or request.world_size != COPY_ENGINE_WORLD:
        return []
    m, n, k = shape
    weightings = [(1,) * chunks for chunks in space.copy_engine_chunks]
    weightings += [w for w in space.copy_engine_weights if w not in weightings]
    kinds: list[dict[str, Any]] = [dict(groups=w) for w in weightings if len(w) <= m // COPY_ENGINE_WORLD]
    if request.dtype != "float32":
        kinds += [
            dict(groups=(1,) * chunks, tile=tile)
            for tile in space.copy_engine_tiles
            for chunks in space.copy_engine_tiled_chunks
            if chunks <= m // COPY_ENGINE_WORLD
        ]
    head = dict(collective=request.collective, dtype=request.dtype, world_size=request.world_size)
    return [Schedule(**head, problem=Problem(m=m, n=n, k=k), engine="copy_engine", **kind) for kind in kinds]


def _row(
    request: SearchRequest,
    shape: tuple[int, int, int],
    schedule: Schedule | None,
    trial: Any,
    numbers: dict[str, Any],
) -> Schedule:
    """The table row: ``schedule`` with its provenance, or ``overlap: false`` when it is None."""
    m, n, k = shape
    prov: dict[str, Any] = {
        "source": "fo-tune search",
        "mode": request.mode,
        "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        **{key: round(v, 5) if isinstance(v, float) else v for key, v in numbers.items()},
    }
    if schedule is None:
        return Schedule(
            collective=request.collective,
            dtype=request.dtype,
            world_size=request.world_size,
            problem=Problem(m=m, n=n, k=k),
            overlap=False,
            provenance=prov,
        )
    if trial is None:  # a copy-engine schedule: measured in the confirmation, not an Optuna trial
        return dataclasses.replace(schedule, provenance=prov)
    prov["trial"] = trial.number
    if "predicted_ms" in trial.user_attrs:
        prov["predicted_ms"] = round(float(trial.user_attrs["predicted_ms"]), 5)
    return dataclasses.replace(schedule, provenance=prov)


def _baseline(
    request: SearchRequest, shape: tuple[int, int, int], model: CostModel | None, measurer: Measurer | None
) -> BaselineResult:
    m, n, k = shape
    predicted = math.nan
    pred = None
    if model is not None:
        pred = model.sequential(request.collective, m, n, k, request.dtype)
        predicted = pred.sequential_ms
    if measurer is None or request.mode == "predict":
        assert pred is not None
        return BaselineResult(
            "predicted", pred.gemm_ms, pred.comm_ms, pred.sequential_ms, 0.0, 0.0, predicted
        )
    got = measurer.baseline(request.collective, shape, request.dtype)
    from .measure import GEMM_TOL

    if got["has_nan"] or not got["rel_err"] < GEMM_TOL[request.dtype]:
        raise FoTuneError(
            f"the sequential baseline of {m}x{n}x{k} failed its check (rel err {got['rel_err']:.2e}); "
            "the GPUs or the NCCL setup are broken"
        )
    seq: Timing = got["sequential"]
    return BaselineResult(
        "measured",
        got["gemm"].median_ms,
        got["comm"].median_ms,
        seq.median_ms,
        seq.spread_ms,
        seq.iqr_ms,
        predicted,
    )


def _encoding(
    request: SearchRequest,
    shape: tuple[int, int, int],
    space: SearchSpace,
    sm_count: int,
    cpu: bool,
    model: CostModel | None,
) -> Encoding:
    """The shape's encoding; predict and hybrid keep the tiles the calibration profiled."""
    tiles = None
    if request.mode in ("predict", "hybrid"):
        assert model is not None
        tiles = tuple(t for t in space.tile_candidates(cpu=cpu) if model.knows_tile(t))
        if not tiles:
            raise SearchError(
                "no tile of the search space is in the calibration's GEMM profile; calibrate with this "
                "space (`fo-tune calibrate --space ...`) or search in --mode measure"
            )
    enc = Encoding.from_space(
        space,
        collective=request.collective,
        dtype=request.dtype,
        world_size=request.world_size,
        shape=shape,
        sm_count=sm_count,
        cpu=cpu,
        tiles=tiles,
        with_dp=model is not None,
    )
    if (
        request.exhaustive
        and sum(1 for _ in itertools.islice(enc.enumerate(), EXHAUSTIVE_LIMIT + 1)) > EXHAUSTIVE_LIMIT
    ):
        m, n, k = shape
        raise SearchError(
            f"--exhaustive: the space has more than {EXHAUSTIVE_LIMIT} points for {m}x{n}x{k}; give a "
            "smaller one with --space (e.g. bench/h200_small_space.yaml) or search without --exhaustive"
        )
    return enc


def _search_shape(
    request: SearchRequest,
    shape: tuple[int, int, int],
    *,
    space: SearchSpace,
    sm_count: int,
    device_key: str,
    cpu: bool,
    model: CostModel | None,
    measurer: Measurer | None,
    storage: Any,
    table: ScheduleTable | None,
    budget_s: float | None,
    reporter: Reporter,
) -> ShapeResult:
    import optuna

    t0 = time.monotonic()
    m, n, k = shape
    label = f"{m}x{n}x{k}"
    enc = _encoding(request, shape, space, sm_count, cpu, model)
    calibration = f"{model.cal.fingerprint.device_key}@{model.cal.created}" if model is not None else "none"
    name = study_name(request, shape, enc, f"{device_key}|{calibration}")
    sampler = optuna.samplers.TPESampler(seed=request.seed)
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    stored = optuna.create_study(
        study_name=name, storage=storage, sampler=sampler, direction="minimize", load_if_exists=True
    )
    fresh = not stored.trials
    study, resumed = stored, 0
    if request.mode == "predict" and is_rdb(storage):
        # Predicted trials take microseconds; one SQLite transaction per Optuna call would take
        # ~50 ms a trial. They run in memory (seeded with the stored ones) and are stored at the end.
        # (A journal file is fast enough to share live between workers, and is used directly.)
        study = optuna.create_study(sampler=sampler, direction="minimize")
        study.add_trials(stored.get_trials(deepcopy=False, states=finished))
        resumed = len(study.trials)
    baseline = _baseline(request, shape, model, measurer)
    on_gpu = not cpu
    if fresh:
        _warm_start(
            study, enc, request, _heuristic(request, shape, sm_count, on_gpu), _nearest_row(table, shape)
        )
    value = "predicted" if request.mode == "predict" else "measured"
    stage = f"{label} {request.mode}"
    objective = Objective(
        enc, model, measurer, value, lambda detail, log: reporter.step(stage, detail, log=log)
    )
    measured_before = measurer.count if measurer is not None else 0
    if request.mode == "hybrid":
        assert model is not None
        ranked = _rank_by_model(enc, model, request.trial_count(), request.seed)
        done = {t.user_attrs.get("key") for t in study.get_trials(deepcopy=False, states=finished)}
        picks = [params for _, params, key in ranked if key not in done][: request.top_k]
        already = sum(1 for _, _, key in ranked[: request.top_k] if key in done)
        picks = picks[: max(0, request.top_k - already)]
        for params in picks:
            study.enqueue_trial(params, skip_if_exists=True)
        waiting = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))
        reporter.stage(stage, waiting)
        if waiting:
            study.optimize(objective, n_trials=waiting, timeout=budget_s)
    elif request.exhaustive:
        points = list(enc.enumerate())  # at most EXHAUSTIVE_LIMIT (_encoding checked)
        have = {_params_key(t.params) for t in study.get_trials(deepcopy=False)}
        for params in points:  # (enqueue_trial's own duplicate check scans every trial: quadratic)
            if _params_key(params) not in have:
                have.add(_params_key(params))
                study.enqueue_trial(params)
        waiting = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))
        reporter.stage(stage, waiting)
        if waiting:
            study.optimize(objective, n_trials=waiting, timeout=budget_s)
    else:
        target = request.trial_count()
        have = len(study.get_trials(deepcopy=False, states=finished))
        reporter.stage(stage, max(0, target - have))
        if have < target:
            stop = optuna.study.MaxTrialsCallback(target, states=finished)
            study.optimize(objective, n_trials=target - have, timeout=budget_s, callbacks=[stop])
    if study is not stored:
        stored.add_trials([t for t in study.get_trials(deepcopy=False, states=finished)[resumed:]])
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    best = min(complete, key=lambda t: t.value) if complete else None
    best_schedule = enc.build(best.params, model) if best is not None else None
    best_ms = float(best.value) if best is not None else math.nan
    confirmed: list[dict[str, Any]] = []
    numbers: dict[str, Any] = {"study": name, "baseline": baseline.source}
    chosen_schedule = None
    best_trial = best.number if best is not None else None
    extra = _copy_engine_candidates(request, space, shape, cpu) if measurer is not None else []
    if extra:
        assert measurer is not None
        why = measurer.copy_engine_unavailable()
        if why:
            reporter.step(stage, f"no copy-engine candidates: {why}", log=True)
            extra = []
    if best is None and not extra:
        overlap, speedup, decision = False, 1.0, "no feasible schedule completed"
    elif measurer is not None:
        picks: list[Any] = _distinct_best(complete, CONFIRM_TOP)
        schedules = [enc.build(t.params, model) for t in picks] + extra
        picks += [None] * len(extra)
        what = f"the best {len(picks) - len(extra)}" + (f" and {len(extra)} copy-engine" if extra else "")
        reporter.step(stage, f"re-timing {what} beside the baseline", log=True)
        got = measurer.confirm(schedules, shape)
        seq: Timing = got["sequential"]
        for t, sched, timing, err in zip(picks, schedules, got["timings"], got["rel_err"], strict=True):
            confirmed.append(
                dict(
                    trial=t.number if t is not None else None,
                    search_ms=float(t.value) if t is not None else math.nan,
                    schedule=sched.describe(),
                    rel_err=err,
                    confirmed_ms=timing.median_ms if timing else math.nan,
                    iqr_ms=timing.iqr_ms if timing else math.nan,
                )
            )
        ok = [(c["confirmed_ms"], i) for i, c in enumerate(confirmed) if not math.isnan(c["confirmed_ms"])]
        if not ok:
            overlap, speedup, decision = False, 1.0, "no schedule passed its check when re-timed"
        else:
            i = min(ok)[1]
            timing = got["timings"][i]
            # the row is decided against what it runs otherwise: the runtime's overlap: false
            # fallback (graphed on GPUs: faster than the eager GEMM then collective where the host
            # bounds a call, docs/design.md#fallback), or sequential if it was not timed
            fallback: Timing | None = got.get("fallback")
            base, base_name = (fallback, "the overlap: false fallback") if fallback else (seq, "sequential")
            overlap, speedup, decision = _decide(
                timing.median_ms, timing.iqr_ms, base.median_ms, base.iqr_ms, base_name
            )
            best_pick = picks[i]
            numbers.update(
                measured_ms=timing.median_ms,
                iqr_ms=timing.iqr_ms,
                sequential_ms=seq.median_ms,
                sequential_iqr_ms=seq.iqr_ms,
            )
            if fallback:
                numbers.update(fallback_ms=fallback.median_ms, fallback_iqr_ms=fallback.iqr_ms)
            if best_pick is not None:
                numbers["search_ms"] = float(best_pick.value)
            best_schedule, best_ms = schedules[i], timing.median_ms  # the re-timed fastest
            best_trial = best_pick.number if best_pick is not None else None
            if overlap:
                chosen_schedule, best = schedules[i], best_pick
    else:
        assert best is not None
        overlap, speedup, decision = _decide(float(best.value), 0.0, baseline.sequential_ms, 0.0)
        numbers.update(predicted_ms=float(best.value), sequential_ms=baseline.sequential_ms)
        if overlap:
            chosen_schedule = enc.build(best.params, model)
    numbers["decision"] = decision
    if overlap:
        numbers["speedup"] = speedup
    else:  # the row runs GEMM then collective: its latency is sequential_ms, not the rejected schedule's
        for key, renamed in (
            ("measured_ms", "rejected_measured_ms"),
            ("predicted_ms", "rejected_predicted_ms"),
        ):
            if key in numbers:
                numbers[renamed] = numbers.pop(key)
    row = _row(request, shape, chosen_schedule, best, numbers)
    records = _records(study, label, baseline.sequential_ms)
    mape, worst = model_error(records)
    return ShapeResult(
        shape=shape,
        study=name,
        mode=request.mode,
        baseline=baseline,
        row=row,
        best_ms=best_ms,
        best_schedule=best_schedule,
        confirmed=confirmed,
        best_trial=best_trial,
        speedup=speedup,
        decision=decision,
        trials=records,
        measured=(measurer.count - measured_before) if measurer is not None else 0,
        wall_s=time.monotonic() - t0,
        mape=mape,
        worst_ape=worst,
    )


def range_rows(request: SearchRequest, results: Sequence[ShapeResult], sm_count: int) -> list[Schedule]:
    """M-range rows from the tuned exact shapes of each (N, K): tuned M_i covers M from the
    geometric midpoint with its lower neighbour to the one with its upper neighbour. A row must
    plan for every M it covers that is checked (its ends, its tuned M); else the range says
    ``overlap: false``."""
    if request.m_range is None:
        return []
    lo, hi = request.m_range
    out: list[Schedule] = []
    by_nk: dict[tuple[int, int], list[ShapeResult]] = {}
    for r in results:
        by_nk.setdefault((r.shape[1], r.shape[2]), []).append(r)
    for (n, k), rs in by_nk.items():
        rs.sort(key=lambda r: r.shape[0])
        ms = [r.shape[0] for r in rs]
        bounds = [lo] + [math.isqrt(a * b) + 1 for a, b in itertools.pairwise(ms)] + [hi + 1]
        for r, start, stop in zip(rs, bounds, bounds[1:], strict=False):
            problem = Problem(m_min=start, m_max=stop - 1, n=n, k=k)
            prov = dict(r.row.provenance) | {"tuned_m": r.shape[0]}
            candidate = dataclasses.replace(r.row, problem=problem, provenance=prov)
            if candidate.overlap and not _plans_everywhere(
                candidate, (start, stop - 1, r.shape[0]), sm_count
            ):
                candidate = Schedule(
                    collective=r.row.collective,
                    dtype=r.row.dtype,
                    world_size=r.row.world_size,
                    problem=problem,
                    overlap=False,
                    provenance=prov | {"decision": "the tuned schedule does not plan across the range"},
                )
            out.append(candidate)
    return out


def _plans_everywhere(schedule: Schedule, ms: Sequence[int], sm_count: int) -> bool:
    p = schedule.problem
    world = schedule.world_size if schedule.collective == "reduce_scatter" else 1
    for m in ms:
        m = m - m % world if m % world else m
        if m < 1:
            continue
        try:
            check_fits(schedule, m, p.n, p.k, sm_count=sm_count)
        except (ScheduleError, ShapeError):
            return False
    return True


def run_search(request: SearchRequest, reporter: Reporter | None = None) -> SearchResult | None:
    """Search every shape of ``request`` (see the module docstring). Returns None on a serving
    torchrun rank. Writes the table rows when ``request.table_dir`` is set."""
    check_request(request)
    rep = reporter or SilentReporter()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.monotonic()
    shapes = expand_shapes(request)
    if request.mode == "predict":
        cal = request.calibration
        assert cal is not None
        return _run(request, shapes, cal.fingerprint, None, rep, t0)
    with fingerprinted_pool(request.world_size, backend=request.backend, purpose="search") as (pool, fp):
        if fp is None:
            return None
        if request.mode == "hybrid":
            cal = request.calibration
            assert cal is not None
            if cal.fingerprint.device_key != fp.device_key:
                raise SearchError(
                    f"the calibration is for {cal.fingerprint.device_key}, these ranks are {fp.device_key}; "
                    "calibrate this machine with `fo-tune calibrate` or pass its --calibration"
                )
        return _run(request, shapes, fp, Measurer(pool, request.reps, request.seed), rep, t0)


def _run(
    request: SearchRequest,
    shapes: list[tuple[int, int, int]],
    fp: Fingerprint,
    measurer: Measurer | None,
    rep: Reporter,
    t0: float,
) -> SearchResult:
    from .tables import merge_rows

    cpu = fp.compute_capability == "cpu"
    space = request.space or space_for(fp.compute_capability)
    cal = request.calibration
    model = None
    if cal is not None:
        if cal.fingerprint.device_key != fp.device_key and request.mode != "predict":
            cal = None  # a calibration of another machine cannot predict these ranks
        if cal is not None:
            model = CostModel(cal)
            if not model.knows_collective(request.collective):
                if request.mode != "measure":
                    raise SearchError(
                        f"the calibration has no bandwidth curve for {request.collective}; re-run "
                        f"`fo-tune calibrate --collectives {request.collective}`"
                    )
                model = None  # measure mode runs without predictions
    target = None
    table = None
    if request.table_dir is not None:
        target = table_path(
            request.table_dir, fp.device_key, request.collective, request.world_size, request.dtype
        )
        check_table_target(target, fp)
        with contextlib.suppress(TableNotFoundError):
            table = load_table(target)
    for shape in shapes:  # every shape's space is checked before anything is written
        _encoding(request, shape, space, fp.sm_count, cpu, model)
    storage = open_storage(request.storage)
    results: list[ShapeResult] = []
    for i, shape in enumerate(shapes):
        budget = None
        if request.time_budget_s is not None:
            left = request.time_budget_s - (time.monotonic() - t0)
            budget = max(1.0, left / (len(shapes) - i))
        results.append(
            _search_shape(
                request,
                shape,
                space=space,
                sm_count=fp.sm_count,
                device_key=fp.device_key,
                cpu=cpu,
                model=model,
                measurer=measurer,
                storage=storage,
                table=table,
                budget_s=budget,
                reporter=rep,
            )
        )
    ranges = range_rows(request, results, fp.sm_count)
    if target is not None:
        # An --m-range search writes its range rows only: its M values were tuned to place them,
        # and must not replace exact rows a search of that very shape wrote.
        merge_rows(
            target,
            fp,
            ranges if request.m_range is not None else [r.row for r in results],
            collective=request.collective,
            world_size=request.world_size,
            dtype=request.dtype,
        )
    return SearchResult(
        request=request,
        fingerprint=fp,
        shapes=results,
        range_rows=ranges,
        table=target,
        wall_s=time.monotonic() - t0,
        storage=request.storage or f"sqlite:///{DEFAULT_STORAGE_FILE}",
    )


__all__ = [
    "DEFAULT_TOP_K",
    "DEFAULT_TRIALS",
    "MIN_GAIN",
    "MODES",
    "BaselineResult",
    "SearchError",
    "SearchRequest",
    "SearchResult",
    "ShapeResult",
    "TrialRecord",
    "check_request",
    "expand_shapes",
    "m_values",
    "model_error",
    "open_storage",
    "range_rows",
    "run_search",
]
