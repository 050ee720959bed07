"""What a search is asked to do, and every check that can run before a rank starts or a file is
written: the request, its validation, the shapes it tunes and the engines it may search."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fo_kernels.errors import FoTuneError
from fo_kernels.schedule import COLLECTIVES, DTYPES, SHARDED_COLLECTIVES
from fo_tune.engines import engine_names, get_tuner
from fo_tune.ranks import CONFIRM_ROUNDS
from fo_tune.ranks.limits import (
    ProblemSizeError,
    Target,
    check_fp8_shapes,
    check_problem_size,
    fingerprint_target,
    local_target,
)
from fo_tune.search.storage import check_storage_url

if TYPE_CHECKING:
    from fo_kernels.fingerprint import Fingerprint
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.space import SearchSpace

MODES = ("measure", "predict", "hybrid")
# Trials per shape when --trials is not given. predict: without --trials the model prices the
# enumerated space (fo_tune.search.strategies.predict); a TPE study of this many predictions is
# used only for a space too large to enumerate. measure: a measured trial takes ~0.1-1 s on H200
# x2 (check + back-to-back timing). hybrid: the points the model ranks when it samples.
DEFAULT_TRIALS = {"predict": 200, "measure": 40, "hybrid": 300}
# Schedules a hybrid search measures per shape.
DEFAULT_TOP_K = 8
# The largest --seed: Optuna's samplers seed numpy, which takes 0 .. 2**32 - 1.
MAX_SEED = 2**32 - 1


class SearchError(FoTuneError, ValueError):
    """Bad search input (shapes, mode, engines, calibration, storage); the message says what to do."""


@dataclass(frozen=True, kw_only=True)
class SearchRequest:
    shapes: tuple[tuple[int, int, int], ...]
    collective: str = "all_reduce"
    world_size: int = 2
    dtype: str = "bfloat16"
    mode: str = "predict"
    trials: int | None = None  # None: DEFAULT_TRIALS[mode] (predict: the enumeration)
    top_k: int = DEFAULT_TOP_K
    time_budget_s: float | None = None  # for the whole command, shared by the shapes left
    m_range: tuple[int, int] | None = None
    storage: str = ""  # an Optuna URL, "journal:PATH"; "" = sqlite at default_storage_file()
    make_storage_folder: bool = False  # create a SQLite or journal file's folder (the default's, --out's)
    calibration: Calibration | None = None
    space: SearchSpace | None = None
    backend: str | None = None  # measure / hybrid
    exhaustive: bool = False
    engines: tuple[str, ...] | None = None  # None: every registered engine that can run here
    seed: int = 0
    reps: int = 10
    confirm_rounds: int = CONFIRM_ROUNDS  # measure / hybrid: rounds of the re-timing that decides a row
    table_dir: Path | None = None  # None: no table written (the caller writes)

    def trial_count(self) -> int:
        """The trials a sampled study runs: ``trials``, or the mode's default."""
        return self.trials if self.trials is not None else DEFAULT_TRIALS[self.mode]

    def trials_asked(self) -> int | None:
        """The trial budget for the search's summary: None where the strategy reads none (hybrid
        times its ``top_k``, exhaustive the whole space); predict's is the budget of a sampled
        study, which it runs with ``--trials`` or for a space too large to enumerate."""
        if self.mode == "hybrid" or self.exhaustive:
            return None
        return self.trial_count()

    def pricing_calibration(self, device_key: str) -> Calibration | None:
        """The calibration whose model prices this search run on the machine of ``device_key``:
        ``calibration``, except another machine's in a measured search (it cannot predict these
        ranks; a predict search prices the calibration's own machine wherever it runs)."""
        cal = self.calibration
        if cal is None or (cal.fingerprint.device_key != device_key and self.mode != "predict"):
            return None
        return cal

    @property
    def strategy(self) -> str:
        """The strategy's name (``fo_tune.search.strategies``)."""
        return "exhaustive" if self.exhaustive else self.mode


def m_values(lo: int, hi: int, multiple: int = 1) -> list[int]:
    """M values an ``--m-range`` tunes: lo, every power of two strictly inside, and hi; with
    ``multiple`` (the world size of a sharded collective, whose M it must divide: lo and hi do),
    each power of two rounded to its nearest multiple, those left strictly inside and distinct (at
    world size 3 no power of two divides)."""
    out = [lo]
    p = 1 << lo.bit_length()
    while p < hi:
        q = multiple * max(1, round(p / multiple))
        if lo < q < hi and q != out[-1]:
            out.append(q)
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
    multiple = request.world_size if request.collective in SHARDED_COLLECTIVES else 1
    return [(m, n, k) for n, k in pairs for m in m_values(lo, hi, multiple)]


def _check_counts(request: SearchRequest) -> None:
    if request.world_size < 1:
        raise SearchError(f"--world-size must be >= 1, got {request.world_size}")
    if not request.shapes:
        raise SearchError("no shape to search: give --shape MxNxK (repeatable) or --shapes FILE")
    if request.trials is not None and request.trials < 1:
        raise SearchError(f"--trials must be >= 1, got {request.trials}")
    if request.confirm_rounds < 1:
        raise SearchError(f"--confirm-rounds must be >= 1, got {request.confirm_rounds}")
    if request.top_k < 1:
        raise SearchError(f"--top-k must be >= 1, got {request.top_k}")
    if request.time_budget_s is not None and not request.time_budget_s > 0:
        raise SearchError(f"--time-budget must be > 0 seconds, got {request.time_budget_s}")
    if not 0 <= request.seed <= MAX_SEED:  # the range Optuna's samplers (numpy) take
        raise SearchError(f"--seed must be between 0 and {MAX_SEED} (2**32 - 1), got {request.seed}")


def _check_shapes(request: SearchRequest) -> None:
    if request.m_range is not None:
        lo, hi = request.m_range
        if not 1 <= lo <= hi:
            raise SearchError(f"--m-range {lo}:{hi}: needs 1 <= LO <= HI")
        sharded = request.collective in SHARDED_COLLECTIVES
        if sharded and (lo % request.world_size or hi % request.world_size):
            raise SearchError(
                f"--m-range {lo}:{hi}: {request.collective} needs LO and HI divisible by the world size "
                f"{request.world_size}{_GATHERED.get(request.collective, '')}"
            )
    for m, n, k in expand_shapes(request):
        if min(m, n, k) < 1:
            raise SearchError(f"shape {m}x{n}x{k}: M, N and K must be >= 1")
        if request.collective in SHARDED_COLLECTIVES and m % request.world_size:
            raise SearchError(
                f"shape {m}x{n}x{k}: {request.collective} needs M divisible by the world size "
                f"{request.world_size}{_GATHERED.get(request.collective, '')}; choose another M"
            )
    check_fp8_shapes(expand_shapes(request), request.dtype)  # (the fp8 ops refuse such a call)


# What a sharded collective's M is, for its errors.
_GATHERED = {"all_gather": " (its M is the gathered M: the world size x a rank's shard rows)"}


def _check_calibration(request: SearchRequest) -> None:
    if request.mode not in ("predict", "hybrid"):
        return
    cal = request.calibration
    if cal is None:
        raise SearchError(
            f"--mode {request.mode} needs a calibration: pass --calibration FILE, or run `fo-tune calibrate "
            f"--world-size {request.world_size}` on this machine first (the search then finds it)"
        )
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
    from fo_tune.calibrate.missing import missing_curves

    gap = missing_curves(cal, [request.collective])
    if gap:  # the baseline every row is decided against is GEMM then this collective
        raise SearchError(f"--mode {request.mode} prices GEMM then {request.collective}, but {gap}")


def check_request(request: SearchRequest) -> None:
    """Everything checkable before a rank starts or anything is written (``SearchError``)."""
    if request.collective not in COLLECTIVES:
        raise SearchError(f"--collective {request.collective!r} is not one of {', '.join(COLLECTIVES)}")
    if request.dtype not in DTYPES:
        raise SearchError(f"--dtype {request.dtype!r} is not one of {', '.join(DTYPES)}")
    if request.mode not in MODES:
        raise SearchError(f"--mode {request.mode!r} is not one of {', '.join(MODES)}")
    for name in request.engines or ():
        if name not in engine_names():
            raise SearchError(f"--engine {name!r} is not one of {', '.join(engine_names())}")
    if request.engines is not None and not request.engines:
        raise SearchError(f"--engine: no engine given; choose from {', '.join(engine_names())}")
    _check_counts(request)
    check_storage_url(request.storage)
    if request.exhaustive and request.mode == "hybrid":
        raise SearchError("--exhaustive enumerates the space in --mode measure or predict, not hybrid")
    _check_shapes(request)
    _check_calibration(request)
    try:
        check_problem_size(expand_shapes(request), request.dtype, _target(request))
    except ProblemSizeError as exc:  # an M of --m-range's, not of a shape the user gave
        if request.m_range is None:
            raise
        lo, hi = request.m_range
        raise ProblemSizeError(f"{exc}, or with --m-range {lo}:{hi} a smaller HI (its M)") from None
    if request.mode in ("predict", "hybrid"):
        assert request.calibration is not None
        select_engines(request, request.calibration.fingerprint, request.space)


def _target(request: SearchRequest) -> Target:
    """Where the searched shapes run: the calibration's machine when planning offline, else the
    ranks this search starts here."""
    if request.mode == "predict":
        assert request.calibration is not None
        return fingerprint_target(request.calibration.fingerprint)
    from fo_tune.ranks.backend import visible_gpus

    backend = request.backend or ("nccl" if visible_gpus() else "gloo")
    return local_target(backend, request.world_size)


def select_engines(request: SearchRequest, fp: Fingerprint, space: SearchSpace | None) -> tuple[str, ...]:
    """The engines this request searches on the machine of ``fp``: the ones it names (each must
    run there, and be calibrated when the search predicts), else every registered engine that
    runs there, has a section in ``space`` and (predicting) a calibrated term. May be empty (world
    size 1: every row says overlap: false)."""
    explicit = request.engines is not None
    names = request.engines if explicit else engine_names()
    predicting = request.mode in ("predict", "hybrid") and request.calibration is not None
    out = []
    for name in names:
        tuner = get_tuner(name)
        why = tuner.blocker(fp, request.collective, request.dtype)
        if not why and space is not None and space.engine(name) is None:
            why = f"has no section engines.{name} in the search space {space.source or space.name}"
        if not why and predicting:
            assert request.calibration is not None
            why = tuner.calibration_gap(request.calibration, request.collective)
            if why and not explicit and request.calibration.fingerprint.device_key == fp.device_key:
                raise SearchError(f"engine {name} {why} (or leave it out with --engine)")
        if why:
            if explicit:
                raise SearchError(f"--engine {name}: engine {name} {why}")
            continue
        out.append(name)
    return tuple(out)


def study_name(request: SearchRequest, shape: tuple[int, int, int], choices: Any, context: str) -> str:
    """``<collective>-w<W>-<dtype>-<MxNxK>-<strategy>-<digest>``; the digest covers the space's
    choices and ``context`` (the device key, and the calibration the model reads), so a study is
    resumed only by the same search on the same machine with the same model."""
    m, n, k = shape
    what = json.dumps([choices, context], sort_keys=True, default=str)
    digest = hashlib.sha1(what.encode()).hexdigest()[:8]
    return f"{request.collective}-w{request.world_size}-{request.dtype}-{m}x{n}x{k}-{request.mode}-{digest}"
