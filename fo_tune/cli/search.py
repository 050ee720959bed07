"""``fo-tune search``: tune schedules and write them into the tables the runtime reads.

Library: ``fo_tune.search.run_search`` (the studies), ``fo_tune.tables.merge.merge_rows`` (the table),
``fo_tune.search.report.write_report`` (trials CSV, summary YAML, plots), ``fo_tune.search.setup`` (the
options' files and folders), ``fo_tune.calibrate.find`` (the calibration).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from fo_tune.cli.common import (
    COLLECTIVE_NAMES,
    BackendOpt,
    SpaceOpt,
    WorldSizeOpt,
    check_dtype,
    console,
    err_console,
    fmt,
    is_driver_process,
    json_text,
    local_device,
    parse_collectives,
    parse_names,
    parse_shape,
    resolve_backend,
    resolve_space,
    summary_table,
    triton_mode,
)
from fo_tune.cli.errors import finishing, handle_errors
from fo_tune.cli.progress import ProgressReporter, progress_bars
from fo_tune.cli.search_options import (
    HELP,
    MODE_NAMES,
    MODE_OPTIONS,
    AllowSlowOpt,
    BudgetOpt,
    CalibrationOpt,
    CollectiveOpt,
    ConfirmRoundsOpt,
    EngineOpt,
    ExhaustiveOpt,
    ExpertsOpt,
    JsonOpt,
    ModeOpt,
    MRangeOpt,
    OutOpt,
    RepsOpt,
    SearchDtypeOpt,
    SeedOpt,
    ShapesFileOpt,
    ShapesOpt,
    StorageOpt,
    TableDirOpt,
    TokensOpt,
    TopKOpt,
    TrialsOpt,
    unread_option,
)
from fo_tune.ranks import CONFIRM_ROUNDS

if TYPE_CHECKING:
    import torch

    from fo_kernels.schedule import Schedule
    from fo_tune.calibrate.calibration import Calibration
    from fo_tune.search import SearchRequest, SearchResult


_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$", re.ASCII)  # (0-9 only, as a shape's)

# The dense search's options an MoE plan has no use for (parameter name -> flag): -c moe refuses
# them when given rather than leaving them out silently (a --shape or --m-range would otherwise
# write a table without the shape the user asked for).
DENSE_ONLY_OPTIONS = {
    "shape": "--shape",
    "m_range": "--m-range",
    "trials": "--trials",
    "top_k": "--top-k",
    "time_budget": "--time-budget",
    "exhaustive": "--exhaustive",
    "backend": "--backend",
    "reps": "--reps",
    "confirm_rounds": "--confirm-rounds",
    "seed": "--seed",
    "allow_slow": "--allow-slow",
}

# click's parameter sources of an option the user did not give.
UNSET_SOURCES = ("DEFAULT", "DEFAULT_MAP")


def given_options(ctx: typer.Context, names: dict[str, str]) -> list[str]:
    """The flags of ``names`` (parameter name -> flag) the command line or the environment set.
    Sources are compared by name: typer ships its own copy of click's ``ParameterSource``."""
    sources = {name: ctx.get_parameter_source(name) for name in names}
    return [
        flag
        for name, flag in names.items()
        if sources[name] is not None and sources[name].name not in UNSET_SOURCES
    ]


def _refuse_unread(ctx: typer.Context, mode: str, mode_given: bool, exhaustive: bool) -> None:
    """``typer.BadParameter`` (exit 2, before any work) for an option given on the command line
    that a search of ``mode`` would drop silently (``search_options.unread_option``)."""
    unread = unread_option(given_options(ctx, MODE_OPTIONS), mode, mode_given, exhaustive)
    if unread is not None:
        raise typer.BadParameter(unread)


def parse_m_range(text: str | None) -> tuple[int, int] | None:
    """``--m-range LO:HI`` as ``(LO, HI)`` (None when not given); ``typer.BadParameter`` otherwise."""
    if text is None:
        return None
    match = _RANGE.match(text)
    if match is None:
        raise typer.BadParameter(f"--m-range {text!r}: expected LO:HI with integers, e.g. 512:16384")
    lo, hi = int(match.group(1)), int(match.group(2))
    if not 1 <= lo <= hi:
        raise typer.BadParameter(f"--m-range {text!r}: needs 1 <= LO <= HI")
    return lo, hi


def short_schedule(row: Schedule) -> str:
    """``triton 128x256x64s3ws r28 cap24 u256 g1-1-1-1 row_band``, ``copy_engine ring 1-1-1-1``
    (or ``no overlap``)."""
    from fo_kernels.engines.copy_engine.settings import CopyEngineSettings
    from fo_kernels.engines.triton.settings import TritonSettings

    st = row.settings
    if st is None:
        return "no overlap"
    if isinstance(st, CopyEngineSettings):
        t = st.tile
        how = f" {t.block_m}x{t.block_n}x{t.block_k}" if t is not None else ""
        return f"copy_engine {st.mode} {'-'.join(map(str, st.weights))}{how}"
    if isinstance(st, TritonSettings):
        t = st.tile
        ws = ("ws" if t.warp_specialize else "") + ("pp" if t.pingpong else "")
        wait = " spin" if st.wait_mode == "spin" else ""
        groups = "-".join(map(str, st.groups))
        return (
            f"triton {t.block_m}x{t.block_n}x{t.block_k}s{t.num_stages}{ws} r{st.sms_free} "
            f"cap{st.nccl_max_ctas} u{st.signal_tiles} g{groups} {st.layout}{wait}"
        )
    return f"{row.engine} {st.describe()}"


def _print_summary(result: SearchResult, written: list[Path]) -> None:
    r = result.request
    table = summary_table(
        f"{r.collective} {r.dtype} w{r.world_size}, {r.mode}, {result.fingerprint.device_key}",
        ["shape", "baseline ms", "best ms", "speedup", "trials", "timed", "MAPE"],
        1,
    )
    for s in result.shapes:
        prov = s.row.provenance
        seq = prov.get("fallback_ms", prov.get("sequential_ms", s.baseline.sequential_ms))
        best = prov.get("measured_ms", prov.get("predicted_ms", s.best_ms))
        table.add_row(
            "x".join(map(str, s.shape)),
            f"{fmt(seq)} {s.baseline.source[:4]}",
            # an overlap slower than the baseline is the best tried, not what the row runs
            fmt(best) if s.row.overlap else f"{fmt(best)} (not kept)",
            fmt(s.speedup, ".3f") + "x",
            str(len(s.trials)),
            str(s.measured),
            "-" if math.isnan(s.mape) else f"{s.mape:.0%}",
        )
    table.caption = (
        "baseline: the overlap: false fallback where a measured search re-timed it beside its best "
        "3 (these numbers), else cuBLAS then the collective"
    )
    console.print(table)
    console.print(
        f"rows (engines searched: {', '.join(result.shapes[0].engines) if result.shapes else '-'}; triton: "
        "tile, r = SMs free, NCCL CTA cap, u = tiles per signal unit, g = group sizes in units; "
        "copy_engine: mode and chunk weights; written only when the gain is > max(2%, spread)):"
    )
    for s in result.shapes:
        console.print(
            f"  {'x'.join(map(str, s.shape))}: {short_schedule(s.row)}", markup=False, highlight=False
        )
    if result.range_rows:
        console.print(
            f"M-range rows: {len(result.range_rows)} "
            f"({', '.join(x.problem.describe() for x in result.range_rows)})"
        )
    for row in result.kept:
        console.print(
            f"  kept the measured row {row.problem.describe()} (a predicted row never replaces one)",
            markup=False,
            highlight=False,
        )
    from fo_tune.calibrate.extrapolate import basis_for

    basis = r.calibration.basis if r.calibration is not None and r.mode == "predict" else ""
    basis = basis_for(basis, r.collective)
    if basis:
        note = f"basis: {basis} (predicted rows; no measured error yet)"
        console.print(note, markup=False, highlight=False)
    if result.table is not None:
        console.print(f"[green]table[/] {escape(str(result.table))}", highlight=False)
    console.print(
        f"[green]report[/] {escape(str(written[0].parent)) if written else '-'} ({result.wall_s:.1f} s)",
        highlight=False,
    )


@handle_errors
def search(
    ctx: typer.Context,
    shape: ShapesOpt = None,
    shapes: ShapesFileOpt = None,
    collective: CollectiveOpt = None,
    world_size: WorldSizeOpt = 2,
    dtype: SearchDtypeOpt = None,
    mode: ModeOpt = None,
    calibration: CalibrationOpt = None,
    trials: TrialsOpt = None,
    top_k: TopKOpt = 8,
    time_budget: BudgetOpt = None,
    m_range: MRangeOpt = None,
    storage: StorageOpt = None,
    exhaustive: ExhaustiveOpt = False,
    space: SpaceOpt = None,
    table_dir: TableDirOpt = None,
    out: OutOpt = None,
    backend: BackendOpt = "auto",
    reps: RepsOpt = 10,
    confirm_rounds: ConfirmRoundsOpt = CONFIRM_ROUNDS,
    seed: SeedOpt = 0,
    engine: EngineOpt = None,
    json_out: JsonOpt = False,
    experts: ExpertsOpt = None,
    tokens: TokensOpt = None,
    allow_slow: AllowSlowOpt = False,
) -> None:
    """``fo-tune search`` (its help: ``fo_tune.cli.search_options.HELP``)."""
    from fo_tune.cli.search_moe import MOE_COLLECTIVE, run_moe_search

    picked = parse_collectives(
        collective, valid=(*COLLECTIVE_NAMES, MOE_COLLECTIVE), default=("all_reduce",), option="--collective"
    )
    # (both searches': an MoE plan divides by the world size too)
    if world_size < 1:
        raise typer.BadParameter(f"--world-size must be >= 1, got {world_size}")
    if mode is not None and mode not in MODE_NAMES:
        raise typer.BadParameter(f"--mode {mode!r} is not one of {', '.join(MODE_NAMES)}")
    if storage is not None and not storage.strip():  # (an unset shell variable, not the default)
        raise typer.BadParameter(
            "--storage '': no URL given; give sqlite:///FILE, journal:FILE or postgresql://..., or "
            "leave --storage out for the default"
        )
    if dtype is None:  # a suite's dtype, as `fo-tune bench --suite` takes it
        from fo_tune.search.setup import shapes_file_dtype

        dtype = (shapes_file_dtype(shapes) if shapes is not None else None) or "bfloat16"
    if MOE_COLLECTIVE in picked:
        if len(picked) > 1:
            others = ",".join(c for c in picked if c != MOE_COLLECTIVE)
            raise typer.BadParameter(
                f"-c {MOE_COLLECTIVE} is searched alone, not with {others}: run two searches, "
                f"`fo-tune search -c {MOE_COLLECTIVE} ...` and `fo-tune search -c {others} ...`"
            )
        dense = given_options(ctx, DENSE_ONLY_OPTIONS)
        if dense:
            raise typer.BadParameter(
                f"{', '.join(dense)}: for the dense collectives, not -c {MOE_COLLECTIVE}, which plans "
                "from --experts H,I,E_LOCAL,K (or --shapes MOE_SUITE) and --tokens T,...; leave them out"
            )
        check_dtype(dtype)
        if storage is not None:  # an offline plan: no trials, so no study to keep in a storage
            raise typer.BadParameter(
                f"--storage: -c {MOE_COLLECTIVE} plans its table offline and records no study; leave "
                "--storage out (copy the moe-w<W>-<dtype>.yaml table file to share it)"
            )
        return run_moe_search(
            experts=experts, suite=shapes, tokens=tokens, world_size=world_size, dtype=dtype,
            mode=mode, calibration=calibration, space=space, engine=engine, table_dir=table_dir, out=out,
            json_out=json_out,
        )  # fmt: skip
    if experts or tokens:
        raise typer.BadParameter("--experts and --tokens are for -c moe")
    collectives = parse_collectives(
        collective, valid=COLLECTIVE_NAMES, default=("all_reduce",), option="--collective"
    )
    from fo_tune.engines import engine_names

    engines = parse_names(engine, valid=engine_names(), option="--engine")
    check_dtype(dtype)
    if mode is not None:  # (a defaulted mode is checked once chosen, below)
        _refuse_unread(ctx, mode, True, exhaustive)
    rng = parse_m_range(m_range)
    wanted = [parse_shape(s) for s in shape or []]
    if shapes is not None:
        from fo_tune.search.setup import read_shapes_file  # (reads YAML; defines no kernel)

        wanted += read_shapes_file(shapes)
    if not wanted:
        raise typer.BadParameter("no shape to search: give --shape MxNxK (repeatable) or --shapes FILE")
    if reps < 1:
        raise typer.BadParameter(f"--reps must be >= 1, got {reps}")
    from fo_tune.ranks.backend import in_torchrun, visible_gpus
    from fo_tune.search.setup import check_cpu_sized, check_measuring_machine, default_mode

    gpus, torchrun = visible_gpus(), in_torchrun()
    given_mode = mode is not None
    mode = mode or default_mode(gpus, world_size, torchrun)
    check_measuring_machine(mode, world_size, backend, gpus, torchrun)
    chosen = "gloo" if mode == "predict" else resolve_backend(world_size, backend)
    driver = is_driver_process()
    with triton_mode(chosen):  # before anything imports fo_kernels
        from fo_tune.calibrate.find import choose_calibration
        from fo_tune.search import SearchInterrupted, SearchRequest, check_request, run_search
        from fo_tune.search.report import write_report
        from fo_tune.search.setup import output_places, report_dirs

        device = local_device(chosen)
        cal, mode = choose_calibration(calibration, mode, world_size, chosen, device, dtype)
        if not given_mode:
            _refuse_unread(ctx, mode, False, exhaustive)
        search_space = None
        if space is not None:
            search_space = resolve_space(space, chosen)
        elif mode == "predict" and cal is not None:
            from fo_tune.space import space_for

            search_space = space_for(cal.fingerprint.compute_capability)
        tables_root, storage_url = output_places(out, table_dir, storage)
        requests = [
            SearchRequest(
                shapes=tuple(wanted),
                collective=name,
                world_size=world_size,
                dtype=dtype,
                mode=mode,
                trials=trials,
                top_k=top_k,
                time_budget_s=time_budget,
                m_range=rng,
                storage=storage_url,
                make_storage_folder=storage is None,
                calibration=cal,
                space=search_space,
                backend=chosen,
                exhaustive=exhaustive,
                engines=engines,
                seed=seed,
                reps=reps,
                confirm_rounds=confirm_rounds,
                table_dir=tables_root,
            )
            for name in collectives
        ]
        # first: on gloo ranks a GPU-sized shape cannot be measured, whatever calibration is given
        check_cpu_sized(mode, chosen, wanted, rng, allow_slow)
        for request in requests:  # every bad input is reported before anything runs or is written
            check_request(request)
        # on the CPU the ranks' fingerprint is this process's (gloo), so an --engine it blocks (the
        # copy engine: no peers) is refused before they start; GPU ranks answer themselves
        engines_here = mode == "measure" and engines is not None and device.type == "cpu"
        here = None  # this process's fingerprint, read once for the checks below that need it
        if engines_here or exhaustive:
            from fo_kernels.fingerprint import current_fingerprint

            here = current_fingerprint(device, world_size)
        if engines_here:
            from fo_tune.search.request import select_engines

            for request in requests:
                select_engines(request, here, request.space)
        if exhaustive:  # a space too large is refused before the ranks start or progress shows
            from fo_tune.search import check_exhaustive_size

            target = cal.fingerprint if mode == "predict" and cal is not None else None
            target = target or here
            for request in requests:
                check_exhaustive_size(request, target)
        folders = report_dirs(requests, cal, device, out, tables_root, storage_url)
        _read_tables(requests, mode, cal, device, world_size)  # (writable first: report_dirs)
        if storage is not None:  # its driver, its server, its folder (the default's is made later)
            from fo_tune.search.storage import check_storage

            check_storage(storage_url)
        results, stop = [], None
        with progress_bars(enabled=driver) as progress:
            reporter = ProgressReporter(progress, f"search ({mode})")
            for i, (request, report_dir) in enumerate(zip(requests, folders, strict=True)):
                try:
                    result = run_search(request, reporter)
                except SearchInterrupted as exc:  # (reported once the progress bars are gone)
                    stop = (exc, report_dir, [r.collective for r in requests[i + 1 :]])
                    break
                if result is None:  # a serving torchrun rank
                    return
                # a Ctrl-C is held until the report is written (its rows are in the table already)
                with finishing(
                    f"{request.collective}: kept its rows in the table and their report in {report_dir}"
                ):
                    results.append((result, write_report(result, report_dir)))
        if stop is not None:
            if driver:
                for result, written in [] if json_out else results:  # the collectives it finished
                    _print_summary(result, written)
                kept = _keep_interrupted(stop[0].result, stop[1], stop[2])
                if json_out:  # a script reads what finished and where the stopped run is kept
                    _echo_json([*((r, w[0].parent) for r, w in results), (stop[0].result, kept)])
            raise stop[0]
    if json_out:
        _echo_json([(result, written[0].parent) for result, written in results])
        return
    for result, written in results:
        _print_summary(result, written)


def _echo_json(runs: list[tuple[SearchResult, Path | None]]) -> None:
    """``--json``'s output: each run's summary and the folder of its report (null: none written,
    a run a Ctrl-C stopped before it decided a shape; its ``stopped`` and ``not_done`` say so)."""
    from fo_tune.search.report import summary

    data = [{**summary(result), "report": str(folder) if folder else None} for result, folder in runs]
    typer.echo(json_text({"kind": "fo-tune-search-summary", "runs": data}))


def _keep_interrupted(result: SearchResult, report_dir: Path, not_started: list[str]) -> Path | None:
    """What a search stopped by Ctrl-C does before ``error: interrupted``: writes the report of the
    shapes it decided, if any (their rows are already in the table; summary.yaml's ``stopped`` and
    ``not_done`` say which were not searched), says on stderr where, and how to resume, and returns
    the report's folder (None: no shape decided, no report)."""
    from fo_tune.search.report import stopped, write_report

    left = ", ".join("x".join(map(str, shape)) for shape in result.not_done)
    later = f"; {', '.join(not_started)} not started" if not_started else ""
    kept, folder = "no shape decided", None
    if result.shapes:
        folder = write_report(result, report_dir)[0].parent
        kept = f"kept the decided shapes in {folder}"
    err_console.print(
        f"{result.request.collective}: {kept} ({stopped(result)}; not searched: {left}{later}); run the "
        f"same command again to search the rest (the study storage {result.storage or '-'} keeps the "
        "trials recorded so far)",
        markup=False,
        highlight=False,
    )
    return folder


def _read_tables(
    requests: list[SearchRequest], mode: str, cal: Calibration | None, device: torch.device, world_size: int
) -> None:
    """Read every collective's table before the first search starts: a malformed one (a
    duplicate row, not YAML) is exit 2 before any work, not after the collectives before it ran.
    Planning offline, the calibration's machine is the target and its tables are checked whole;
    measuring, the ranks' fingerprint comes when they start, so this machine's key finds the file
    and the search checks its machine then."""
    from fo_kernels.fingerprint import current_fingerprint
    from fo_tune.search.driver import read_target

    predict = mode == "predict" and cal is not None
    fp = cal.fingerprint if predict else current_fingerprint(device, world_size)
    for request in requests:
        read_target(request, fp, check_machine=predict)


def register(app: typer.Typer) -> None:
    """Add ``search`` to the root app."""
    app.command("search", help=HELP)(search)
