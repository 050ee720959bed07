"""``fo-tune search`` as a library call: per shape one search over the union of engines, the best
schedule as a table row.

    run_search(SearchRequest(shapes=((4096, 8192, 4096),), collective="all_reduce", mode="predict"))

Per shape (an ``--m-range`` adds the range's M values for each (N, K)):

1. The engines that can run here (``select_engines``: each plug-in's feasibility rule on the
   fingerprint; a measured search also asks the ranks whether the runtime can run them) and the
   shape's ``UnionEncoding`` over them.
2. The baseline: cuBLAS then the collective, and the ``overlap: false`` fallback, measured on the
   ranks or predicted.
3. The strategy (``fo_tune.search.strategies``: measure, predict, hybrid or exhaustive, one
   signature) returns the distinct schedules it timed or priced.
4. The row (``fo_tune.search.decide``): a measured search confirms its best schedules beside the
   baselines; a predict search compares the predicted best with the predicted fallback; either
   way the row overlaps only when it beats the fallback by more than the no-gain margin.

The study storage is opened (and so checked: ``fo_tune.search.storage``) before any work. Each row
is recorded in its study as soon as it is decided (``fo_tune.tables.stored``: what ``fo-tune
table pull`` gathers from every worker of a fleet; an ``--m-range`` search records its range rows
once they are placed), then merged into the table (``fo_tune.tables.merge.merge_rows``, under a
file lock; a row takes only its own Ms, and a predicted row none of a measured one); the report
(``fo_tune.search.report``) lists every trial.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from fo_kernels.errors import TableError, TableNotFoundError
from fo_kernels.fingerprint import Fingerprint
from fo_kernels.schedule import Schedule
from fo_kernels.table import ScheduleTable, table_path
from fo_tune.engines import ShapeTask, cost_model, get_tuner
from fo_tune.model import CostModel
from fo_tune.output import Reporter, SilentReporter
from fo_tune.search.decide import Verdict, confirm, decide_predicted, make_row, measure_baseline, row_numbers
from fo_tune.search.encoding import UnionEncoding
from fo_tune.search.ranges import range_rows
from fo_tune.search.request import (
    SearchError,
    SearchRequest,
    check_request,
    expand_shapes,
    select_engines,
    study_name,
)
from fo_tune.search.results import SearchInterrupted, SearchResult, ShapeResult, model_error
from fo_tune.search.storage import open_storage, shown, storage_lost, storage_url
from fo_tune.search.strategies import ShapeJob, get_strategy
from fo_tune.space import SearchSpace, space_for
from fo_tune.tables.kinds import load_dense_table


def read_target(
    request: SearchRequest, fp: Fingerprint, *, check_machine: bool = True
) -> tuple[Any, ScheduleTable | None]:
    """(the table file ``request``'s rows merge into on the machine of ``fp``, its table where
    one is there). A malformed file (not YAML, a bad or duplicate row) raises its ``TableError``,
    and with ``check_machine`` one for other hardware too: ``fo-tune search`` reads every
    collective's table this way before the first search starts, so a bad one is refused before
    any work rather than after the collectives searched before it; so is a file holding another
    collective's, world size's or dtype's rows under this table's name."""
    if request.table_dir is None:
        return None, None
    target = table_path(
        request.table_dir, fp.device_key, request.collective, request.world_size, request.dtype
    )
    table = None
    with contextlib.suppress(TableNotFoundError):  # (a malformed file raises its TableError)
        table = load_dense_table(target)
    if table is not None:  # another table's rows under this one's name: refused before any work
        from fo_tune.tables.merge import check_header

        check_header(
            table,
            target,
            fp,
            collective=request.collective,
            world_size=request.world_size,
            dtype=request.dtype,
            then="search again",
        )
    if table is not None and check_machine:
        check_table_target(table, target, fp)
    return target, table


def check_table_target(table: ScheduleTable, path: Any, fingerprint: Fingerprint) -> None:
    """Refuse (before searching) a table file for other hardware."""
    theirs = table.fingerprint
    if (theirs.device_key, theirs.world_size) != (fingerprint.device_key, fingerprint.world_size):
        raise TableError(
            f"table {path} is for {theirs.device_key}, this search is for {fingerprint.device_key}; "
            "pass another --table-dir (or --out)"
        )


def run_search(request: SearchRequest, reporter: Reporter | None = None) -> SearchResult | None:
    """Search every shape of ``request`` (see the module docstring). Returns None on a serving
    torchrun rank. Writes the table rows when ``request.table_dir`` is set."""
    check_request(request)
    rep = reporter or SilentReporter()
    with storage_lost(request.storage):  # a server gone mid-search: one line, not Optuna's own error
        return _search(request, rep, time.monotonic())


def _search(request: SearchRequest, rep: Reporter, t0: float) -> SearchResult | None:
    # An explicit storage is opened (checked) before any work; one whose folder the search makes
    # (the default, --out's) once every other check has passed, so bad input writes nothing.
    owned = request.make_storage_folder or not request.storage
    storage = None if owned else open_storage(request.storage)
    if request.mode == "predict":
        cal = request.calibration
        assert cal is not None
        return _run(request, cal.fingerprint, None, rep, t0, storage)
    import optuna

    from fo_tune.ranks.launch import fingerprinted_pool
    from fo_tune.search.trials import Measurer

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with fingerprinted_pool(request.world_size, backend=request.backend, purpose="search") as (pool, fp):
        if fp is None:  # a serving torchrun rank
            return None
        if request.mode == "hybrid":
            cal = request.calibration
            assert cal is not None
            if cal.fingerprint.device_key != fp.device_key:
                raise SearchError(
                    f"the calibration is for {cal.fingerprint.device_key}, these ranks are {fp.device_key}; "
                    "calibrate this machine with `fo-tune calibrate` or pass its --calibration"
                )
        return _run(
            request, fp, Measurer(pool, request.reps, request.seed, request.confirm_rounds), rep, t0, storage
        )


def check_exhaustive_size(request: SearchRequest, fp: Fingerprint) -> None:
    """Refuse an ``exhaustive`` request whose space is too large for a shape
    (``fo_tune.search.strategies.exhaustive.check_size``) before any rank starts or any progress
    is shown, ``fp`` being the machine the search runs for (the calibration's when it predicts,
    else this machine's). A measured search counts only the engines whose availability needs no
    answer from the ranks (no probe task): a space refused here is refused by ``run_search``
    too, which checks again with the engines the ranks run."""
    if not request.exhaustive:
        return
    space = request.space or space_for(fp.compute_capability)
    model = _model(request, fp)
    engines = tuple(
        name
        for name in select_engines(request, fp, space)
        if request.mode == "predict" or get_tuner(name).probe_task() is None
    )
    cpu = fp.compute_capability == "cpu"
    shapes = expand_shapes(request)
    encodings = [_encoding(request, shape, space, fp, cpu, model, engines) for shape in shapes]
    _check_sizes(request, encodings, model, None, SilentReporter(), fp)


def _check_sizes(
    request: SearchRequest,
    encodings: list[UnionEncoding],
    model: CostModel | None,
    measurer: Any,
    rep: Reporter,
    fp: Fingerprint,
) -> None:
    from fo_tune.search.strategies.exhaustive import check_size

    for enc in encodings:
        check_size(_job(request, enc, model, measurer, None, None, rep, math.nan, fp))


def _model(request: SearchRequest, fp: Fingerprint) -> CostModel | None:
    cal = request.pricing_calibration(fp.device_key)
    if cal is None:
        return None
    model = cost_model(cal)
    if not model.knows_collective(request.collective):
        if request.mode != "measure":
            from fo_tune.calibrate.missing import missing_curves

            raise SearchError(missing_curves(cal, [request.collective]))
        return None  # measure mode runs without predictions
    return model


def _engines(
    request: SearchRequest, fp: Fingerprint, space: SearchSpace, measurer: Any, rep: Reporter
) -> tuple:
    """``select_engines``, less the ones the ranks cannot run (a measured search asks them)."""
    engines = select_engines(request, fp, space)
    if measurer is None:
        return engines
    out = []
    for name in engines:
        why = measurer.unavailable(name, get_tuner(name).probe_task())
        if why and request.engines is not None:
            raise SearchError(f"--engine {name}: {why}")
        if why:
            rep.step("engines", f"engine {name} left out: {why}", log=True)
            continue
        out.append(name)
    return tuple(out)


def _run(
    request: SearchRequest, fp: Fingerprint, measurer: Any, rep: Reporter, t0: float, storage: Any | None
) -> SearchResult:
    from fo_tune.tables.merge import kept_measured, merge_rows
    from fo_tune.tables.stored import record_rows

    cpu = fp.compute_capability == "cpu"
    space = request.space or space_for(fp.compute_capability)
    model = _model(request, fp)
    engines = _engines(request, fp, space, measurer, rep)
    target, table = read_target(request, fp)
    shapes = expand_shapes(request)
    encodings = [_encoding(request, shape, space, fp, cpu, model, engines) for shape in shapes]
    if request.exhaustive:  # every shape's space is checked before anything runs or is written
        _check_sizes(request, encodings, model, measurer, rep, fp)
    if storage is None:
        storage = open_storage(request.storage, create_folder=True)
    results: list[ShapeResult] = []
    kept: list[Schedule] = []

    def merge(rows: list[Schedule]) -> None:
        merged = merge_rows(
            target,
            fp,
            rows,
            collective=request.collective,
            world_size=request.world_size,
            dtype=request.dtype,
        )
        # (a predicted row takes no M from a measured one); each measured row once over the merges
        kept.extend(r for r in kept_measured(merged, rows) if r not in kept)

    def result_so_far(**more: Any) -> SearchResult:
        return SearchResult(
            request=request,
            fingerprint=fp,
            shapes=results,
            table=target,
            wall_s=time.monotonic() - t0,
            storage=shown(storage_url(request.storage)),
            kept=kept,
            **more,
        )

    try:
        for i, enc in enumerate(encodings):
            budget = None
            if request.time_budget_s is not None:
                left = request.time_budget_s - (time.monotonic() - t0)
                budget = max(1.0, left / (len(shapes) - i))
            result = _search_shape(request, enc, fp, model, measurer, storage, table, budget, rep)
            if request.m_range is None:  # (an --m-range search's exact rows never reach a table)
                record_rows(storage, result.study, fp, [result.row], trials=result.decided_from)
                if target is not None:  # merged as soon as decided: a Ctrl-C or a failing rank later keeps it
                    merge([result.row])
            results.append(result)  # (done once recorded and merged)
    except KeyboardInterrupt:  # the shapes done so far are in the table; say which are not
        raise SearchInterrupted(result_so_far(not_done=shapes[len(results) :])) from None
    ranges = range_rows(request.m_range, results, fp.sm_count)
    _record_ranges(storage, fp, results, ranges)
    if target is not None and request.m_range is not None:
        # An --m-range search writes its range rows only: its M values were tuned to place them,
        # and must not replace exact rows a search of that very shape wrote.
        merge(ranges)
    return result_so_far(range_rows=ranges)


def _record_ranges(storage: Any, fp: Fingerprint, results: list[ShapeResult], ranges: list[Schedule]) -> None:
    """Record an ``--m-range`` search's rows, each (N, K)'s in a study of their own
    (``fo_tune.tables.stored.range_study_name``), decided from the trials of that (N, K)'s shapes."""
    from fo_tune.tables.stored import range_study_name, record_rows

    by_nk: dict[tuple[int, int], list[Schedule]] = {}
    for row in ranges:
        by_nk.setdefault((row.problem.n, row.problem.k), []).append(row)
    for (n, k), rows in by_nk.items():
        shapes = [r for r in results if r.shape[1:] == (n, k)]
        lo, hi = rows[0].problem.m_min, rows[-1].problem.m_max
        study = range_study_name(shapes[0].study, f"[{lo},{hi}]x{n}x{k}")
        record_rows(storage, study, fp, rows, trials=sum(r.decided_from for r in shapes))


def _encoding(
    request: SearchRequest,
    shape: tuple[int, int, int],
    space: SearchSpace,
    fp: Fingerprint,
    cpu: bool,
    model: CostModel | None,
    engines: tuple[str, ...],
) -> UnionEncoding:
    m, n, k = shape
    task = ShapeTask(
        collective=request.collective,
        dtype=request.dtype,
        world_size=request.world_size,
        m=m,
        n=n,
        k=k,
        sm_count=fp.sm_count,
        cpu=cpu,
        space=space,
        model=model,
        predictable=request.mode in ("predict", "hybrid"),
    )
    return UnionEncoding(task, engines)


def _job(
    request: SearchRequest,
    enc: UnionEncoding,
    model: CostModel | None,
    measurer: Any,
    storage: Any,
    table: ScheduleTable | None,
    rep: Reporter,
    baseline_ms: float,
    fp: Fingerprint,
    budget_s: float | None = None,
) -> ShapeJob:
    calibration = f"{model.cal.fingerprint.device_key}@{model.cal.created}" if model is not None else "none"
    name = study_name(request, enc.task.shape, enc.fingerprint(), f"{fp.device_key}|{calibration}")
    return ShapeJob(
        request=request,
        enc=enc,
        model=model,
        measurer=measurer,
        study_name=name,
        storage=storage,
        table=table,
        budget_s=budget_s,
        reporter=rep,
        baseline_ms=baseline_ms,
    )


def _search_shape(
    request: SearchRequest,
    enc: UnionEncoding,
    fp: Fingerprint,
    model: CostModel | None,
    measurer: Any,
    storage: Any,
    table: ScheduleTable | None,
    budget_s: float | None,
    rep: Reporter,
) -> ShapeResult:
    t0 = time.monotonic()
    shape = enc.task.shape
    baseline = measure_baseline(request, shape, model, measurer)
    quote = baseline.fallback_ms if not math.isnan(baseline.fallback_ms) else baseline.sequential_ms
    job = _job(request, enc, model, measurer, storage, table, rep, quote, fp, budget_s)
    if not enc.engines:
        outcome = None
        verdict = Verdict(
            False, 1.0, "no engine can run here (see `fo-tune search --help`)", None, None, math.nan
        )
    else:
        outcome = get_strategy(request.strategy).run(job)
        if measurer is not None and outcome.candidates:
            # a stage of its own: the strategy's stage counts its trials only
            retime = f"{job.stage} re-time"
            rep.stage(retime, 1)
            verdict = confirm(outcome.candidates, shape, measurer, lambda detail: rep.step(retime, detail))
        elif measurer is not None:
            verdict = Verdict(False, 1.0, "no feasible schedule completed", None, None, math.nan)
        else:
            verdict = decide_predicted(outcome.candidates, baseline.fallback_ms, baseline.sequential_ms)
    extra: dict[str, Any] = {"study": job.study_name, "baseline": baseline.source}
    row = make_row(request, shape, verdict, row_numbers(verdict, extra))
    records = outcome.records if outcome is not None else []
    mape, worst = model_error(records)
    best = verdict.best
    return ShapeResult(
        shape=shape,
        study=job.study_name,
        mode=request.mode,
        baseline=baseline,
        row=row,
        best_ms=verdict.best_ms,
        best_trial=best.trial if best is not None else None,
        best_schedule=best.schedule if best is not None else None,
        confirmed=verdict.confirmed,
        speedup=verdict.speedup,
        decision=verdict.decision,
        trials=records,
        measured=outcome.measured if outcome is not None else 0,
        wall_s=time.monotonic() - t0,
        mape=mape,
        worst_ape=worst,
        engines=enc.engines,
    )
