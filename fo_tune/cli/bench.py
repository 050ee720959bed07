"""``fo-tune bench``: GEMM + collective done every way, checked then timed (library: ``fo_tune.bench``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fo_kernels.errors import FoTuneError
from fo_tune.cli.common import (
    DTYPE_NAMES,
    RUNTIME_COLLECTIVE_NAMES,
    BackendOpt,
    ShapesOpt,
    WorldSizeOpt,
    check_dtype,
    console,
    err_console,
    expected_device_key,
    fmt,
    is_driver_process,
    nonempty_path,
    parse_collectives,
    parse_shape,
    resolve_backend,
    summary_table,
    triton_mode,
)
from fo_tune.cli.errors import finishing, handle_errors
from fo_tune.cli.progress import ProgressReporter, progress_bars
from fo_tune.cli.search_moe import MOE_COLLECTIVE

if TYPE_CHECKING:
    from fo_tune.bench import BenchRequest, BenchResult, BenchRow

HELP = "\n\n".join(
    [
        "Benchmark GEMM + collective every way it can run on this machine: each variant checked, "
        "then timed, in one pool of --world-size ranks (spawned, or torchrun's).",
        "Collectives: all_reduce and reduce_scatter of a @ b (the row-parallel direction), and "
        "all_gather, all_gather(a) @ b (the column-parallel direction). A shape MxNxK is the GEMM's "
        "for each: for all_gather M is the gathered M, each rank holding an M/w x K shard of A "
        "(rank r's at rows r*M/w).",
        "Variants per shape and collective: gemm (cuBLAS alone, the full M x N x K GEMM); "
        "collective (NCCL alone: the all_reduce or reduce_scatter of the M x N result, the "
        "all_gather of the M/w x K shard); sequential (GEMM, then the collective; all_gather: the "
        "gather, then the GEMM); chunked (M split into 2, 4 and 8 row chunks on a high-priority "
        "second stream: GEMM chunk j, an event, the collective of chunk j; for reduce_scatter and "
        "all_gather each chunk takes the same rows of every rank's shard, and all_gather gathers "
        "chunk j before its GEMM; the best count is the chunked row, each count is a chunked_c<C> "
        "row); async_tp (reduce_scatter: torch.ops.symm_mem.fused_matmul_reduce_scatter); "
        "torch_fused (all_gather: torch.ops.symm_mem.fused_all_gather_matmul); both need CUDA, "
        "NCCL and symmetric memory, are reported UNAVAILABLE with the reason where they cannot run "
        "and SKIP at world size 1; fo_tune (fo_kernels.gemm_all_reduce / gemm_reduce_scatter / "
        "all_gather_gemm with the schedule lookup_schedule returns: a table row, else overlap: "
        "false, recorded as schedule_source); ideal (max(gemm, collective): the physical bound, "
        "derived, not run).",
        "Checks: random operands (never zero, a seed per rank) against a float32 reference, "
        "a.float() @ b.float() then the collective (all_gather: the gathered float32 A @ "
        "b.float()); the buffers the bench makes for a variant start as NaN, and a variant passes "
        "when nothing is NaN and the relative error is below 1e-2 (bfloat16), 5e-3 (float16) or "
        "1e-4 (float32) on every rank. A failing variant is reported FAIL and not timed. Times: the "
        "median of --reps samples per rank (CUDA events around back-to-back calls spanning "
        "--sample-ms, the ranks agree on the calls per sample), the slowest rank's; speedup = "
        "sequential ms / variant ms, fraction of ideal = ideal ms / variant ms. reduce_scatter and "
        "all_gather need M divisible by the world size: such a shape gives them SKIP rows, and is "
        "refused when no collective asked for can run it.",
        "--dtype float8_e4m3fn: fp8 operands with rowwise scales and a bfloat16 output; gemm and "
        "sequential run torch._scaled_mm, the fused peers torch's fused_scaled_matmul_reduce_scatter "
        "and fused_all_gather_scaled_matmul, the references take the dequantized operands, the "
        "tolerance is 1e-2 (the output is bfloat16).",
        "Shapes: --shape (repeat), or --suite FILE (suites/h200_tp.yaml: name, dtype, shapes; "
        "odd_shapes too with --include-odd). Default: the shipped h200_tp suite on GPUs, 64x96x64 "
        "on the CPU.",
        "Writes bench.csv (one row per shape x collective x variant: device_key, world_size, dtype, "
        "m, n, k, collective, variant, detail, status, rel_err, median_ms, spread_ms, "
        "speedup_vs_sequential, fraction_of_ideal, schedule_source), bench.yaml (the same rows, the "
        "hardware fingerprint, the settings, the wall time) and bench.png (speedup over sequential "
        "per shape, one panel per collective) into --out (default "
        "results/bench/<device-key>/tp<N>/), all at once, then prints a summary. A Ctrl-C or a "
        "failing rank writes the cases finished before it there (bench.yaml's settings.stopped says "
        "after which case and why; they replace an earlier stopped run there, never a finished one: "
        "with a finished run in --out they go to the sibling folder <out>-stopped/; before the first "
        "case ends nothing is written), says where on stderr and exits 130 or 1; a "
        "Ctrl-C while the finished run's files are written stops once they are, every case kept.",
        "Without GPUs the ranks use gloo and fo_tune's GEMM runs in Triton's CPU interpreter; there "
        "is no second stream, so the chunks run one after the other: the pipeline is checked, the "
        "numbers describe the CPU.",
        "Exit code 0 when every checked variant passes, 1 when one fails (the files are still "
        "written) or a rank fails, 2 for bad options (nothing is run or written), 130 when interrupted.",
    ]
)

SuiteOpt = Annotated[
    Path | None,
    typer.Option(
        "--suite",
        parser=nonempty_path,
        metavar="FILE",
        help="Suite YAML (name, dtype, shapes: [[M, N, K], ...]); instead of --shape. "
        "Its dtype is the default for --dtype.",
    ),
]
IncludeOddOpt = Annotated[
    bool, typer.Option("--include-odd", help="Also run the suite's odd_shapes (needs --suite).")
]
CollectiveOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--collective",
        "--collectives",
        "-c",
        metavar="NAME[,NAME]",
        help=f"Collectives, repeated or comma-separated: {', '.join(RUNTIME_COLLECTIVE_NAMES)}. "
        "Default: all of them.",
    ),
]
BenchDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        "-d",
        help=f"Operand dtype: {', '.join(DTYPE_NAMES)}. Default: the suite's, else bfloat16 on GPUs "
        "and float32 on the CPU (the interpreter's bfloat16 dot is wrong).",
    ),
]
BenchRepsOpt = Annotated[
    int | None,
    typer.Option(
        "--reps",
        "-r",
        help="Timed samples per variant (median reported), after warm-up calls. Default: 30 on GPUs "
        "(variants in alternating rounds), 3 on the CPU.",
    ),
]
BenchSampleOpt = Annotated[
    float | None,
    typer.Option(
        "--sample-ms",
        metavar="MS",
        help="Shortest timed sample: each sample runs enough back-to-back calls to span this long "
        "(at most 64), and its first call's launch on an idle GPU is spread over them. Default: 16 "
        "on GPUs (4 ms samples added ~6% to a 0.15 ms op's time, docs/design.md#timing), 4 on "
        "the CPU.",
    ),
]
BenchOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        parser=nonempty_path,
        metavar="DIR",
        help="Folder to write (created, or replaced when it holds an earlier bench run). "
        "Default: results/bench/<device-key>/tp<N>.",
    ),
]
AllowSlowOpt = Annotated[
    bool,
    typer.Option(
        "--allow-slow",
        help="Run shapes above 1024x1024x1024 (M*N*K) without GPUs too: Triton's CPU interpreter "
        "takes hours for a GPU suite, so they are refused otherwise.",
    ),
]
BenchTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout", help="Seconds one shape x collective may take on all ranks before the run is stopped."
    ),
]


def _request(
    shapes: list[tuple[int, int, int]],
    suite: Path | None,
    include_odd: bool,
    dtype: str | None,
    backend: str,
    **rest: object,
) -> BenchRequest:
    """The request: --shape, else --suite, else the default for the device (fo_tune.bench)."""
    from fo_tune.bench import CPU_SHAPES, BenchRequest, load_suite, packaged_suite

    name = ""
    if not shapes:
        if suite is None and backend != "nccl":
            shapes = list(CPU_SHAPES)
        else:
            loaded = load_suite(suite or packaged_suite())
            shapes = [*loaded.shapes, *(loaded.odd_shapes if include_odd else ())]
            dtype, name = dtype or loaded.dtype, loaded.name
    return BenchRequest(shapes=tuple(shapes), dtype=dtype, backend=backend, suite=name, **rest)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- the summary
# The summary's column of each collective's fused torch op (all_reduce has none).
FUSED_COLUMNS = {"reduce_scatter": ("async_tp", "async-TP"), "all_gather": ("torch_fused", "torch fused")}


def _cell(row: BenchRow | None) -> str:
    """A variant's time, FAIL (red), n/a (unavailable) or - (skipped)."""
    if row is None:
        return "-"
    if row.status == "PASS":
        return fmt(row.median_ms)
    return {"FAIL": "[bold red]FAIL[/]", "UNAVAILABLE": "n/a"}.get(row.status, "-")


def _chunked_cell(row: BenchRow | None) -> str:
    """The best chunked time and its chunk count (the detail starts with ``chunks=C``)."""
    cell = _cell(row)
    if row is not None and row.status == "PASS":
        count = row.detail.split(",")[0].split(" ")[0].removeprefix("chunks=")
        cell += f" c{count}"
    return cell


def _times_faster(other: BenchRow | None, ours: BenchRow) -> str:
    """``other`` ms / fo-tune ms where both passed, else ``-``."""
    if other is None or other.status != "PASS" or ours.status != "PASS":
        return "-"
    return fmt(other.median_ms / ours.median_ms, ".2f") + "x"


def _case_table(result: BenchResult, collective: str) -> tuple[Table, list[str]]:
    """One collective's summary: per shape the times (ms), fo-tune's speedup, fraction of ideal and,
    beside a fused torch op, how many times faster than it fo-tune is."""
    from fo_tune.output import count

    where = "NCCL" if result.backend == "nccl" else "gloo on the CPU"
    fused = FUSED_COLUMNS.get(collective)  # (variant, column) of the collective's fused torch op
    columns = ["MxNxK", "seq", "chunked", *([fused[1]] if fused else []), "fo-tune", "ideal"]
    table = summary_table(
        f"{collective} (ms): {count(result.fingerprint.world_size, 'rank')}, {where}, "
        f"{result.settings['dtype']}, {result.fingerprint.device_key}",
        [*columns, "speedup", "of ideal", *([f"x {fused[1]}"] if fused else []), "ok"],
        1,
    )
    skipped = []
    for shape in dict.fromkeys(r.shape for r in result.rows if r.collective == collective):
        rows = [r for r in result.rows if (r.collective, r.shape) == (collective, shape)]
        by = {r.variant: r for r in rows}
        if all(r.status == "SKIP" for r in rows):
            skipped.append(f"{collective} {shape}: {rows[0].detail}")
            continue
        ours = by["fo_tune"]
        checked = [r for r in result.checked if (r.collective, r.shape) == (collective, shape)]
        passed = sum(r.status == "PASS" for r in checked)
        ok = f"{passed}/{len(checked)}"
        table.add_row(
            shape,
            _cell(by.get("sequential")),
            _chunked_cell(by.get("chunked")),
            *([_cell(by.get(fused[0]))] if fused else []),
            _cell(ours),
            _cell(by.get("ideal")),
            fmt(ours.speedup_vs_sequential, ".2f") + "x" if ours.status == "PASS" else "-",
            fmt(ours.fraction_of_ideal, ".2f") if ours.status == "PASS" else "-",
            *([_times_faster(by.get(fused[0]), ours)] if fused else []),
            ok if passed == len(checked) else f"[bold red]{ok}[/]",
        )
    return table, skipped


def _print_summary(result: BenchResult, written: list[Path]) -> None:
    skipped: list[str] = []
    for collective in dict.fromkeys(r.collective for r in result.rows):
        table, more = _case_table(result, collective)
        if result.backend != "nccl":
            table.caption = "CPU: Triton's interpreter, no second stream (not what overlap gains)"
        if table.row_count:
            console.print(table)
        skipped += more
    ours = [r for r in result.rows if r.variant == "fo_tune" and r.status != "SKIP"]
    if ours:
        what = "fo_tune schedules (a table row where one covers the shape, else overlap: false):"
        console.print(what, style="dim")
    for r in ours:
        what = r.detail.split(": ", 1)[-1]  # describe() starts with the collective, dtype and shape
        line = f"  {r.collective} {r.shape}: {r.schedule_source or 'no schedule'}: {what}"
        console.print(line, style="dim", markup=False, highlight=False)
    for line in skipped:
        console.print(f"[yellow]skipped[/] {escape(line)}", highlight=False)
    for line in dict.fromkeys(f"{r.variant}: {r.detail}" for r in result.rows if r.status == "UNAVAILABLE"):
        console.print(f"[yellow]unavailable[/] {escape(line)}", highlight=False)
    for r in result.failed:
        console.print(
            f"[bold red]FAIL[/] {escape(f'{r.collective} {r.shape} {r.variant}: {r.detail}')}",
            highlight=False,
        )
    console.print(
        f"[green]wrote[/] {len(written)} file{'s' * (len(written) != 1)} to {escape(str(written[0].parent))}:"
    )
    for path in written:
        console.print(f"  {path}", markup=False, highlight=False)


# ------------------------------------------------------------------------------------ the command
@handle_errors
def bench(
    shape: ShapesOpt = None,
    suite: SuiteOpt = None,
    include_odd: IncludeOddOpt = False,
    collective: CollectiveOpt = None,
    world_size: WorldSizeOpt = 2,
    dtype: BenchDtypeOpt = None,
    backend: BackendOpt = "auto",
    reps: BenchRepsOpt = None,
    sample_ms: BenchSampleOpt = None,
    out: BenchOutOpt = None,
    timeout: BenchTimeoutOpt = 600.0,
    allow_slow: AllowSlowOpt = False,
) -> None:
    """``fo-tune bench`` (its help: ``HELP``)."""
    from fo_tune.output import count

    shapes = [parse_shape(s) for s in shape or []]
    if shapes and suite is not None:
        raise typer.BadParameter("--shape and --suite: give one of them, not both")
    if include_odd and suite is None:
        raise typer.BadParameter("--include-odd needs --suite (the odd shapes come from the suite file)")
    if any(MOE_COLLECTIVE in value.split(",") for value in collective or []):
        raise typer.BadParameter(
            f"--collective {MOE_COLLECTIVE}: fo-tune bench times the dense ops; the expert-parallel "
            "FFN's bench is `python bench/moe_ep.py --out DIR` (its --help says more)"
        )
    names = parse_collectives(
        collective, valid=RUNTIME_COLLECTIVE_NAMES, default=RUNTIME_COLLECTIVE_NAMES, option="--collective"
    )
    if dtype is not None:
        check_dtype(dtype)
    if reps is not None and reps < 1:
        raise typer.BadParameter(f"--reps must be >= 1, got {reps}")
    if not timeout > 0:
        raise typer.BadParameter(f"--timeout must be > 0, got {timeout}")
    if sample_ms is not None and not sample_ms > 0:
        raise typer.BadParameter(f"--sample-ms must be > 0, got {sample_ms}")
    chosen = resolve_backend(world_size, backend)
    driver = is_driver_process()
    with triton_mode(chosen):  # before anything imports fo_kernels' kernels
        from fo_tune.bench import (
            check_bench_out,
            check_runnable,
            default_bench_dir,
            run_bench,
            write_bench_dir,
        )
        from fo_tune.tables.find import search_folders

        request = _request(
            shapes, suite, include_odd, dtype, chosen,
            collectives=names, world_size=world_size, reps=reps, timeout_s=timeout, sample_ms=sample_ms,
            allow_slow=allow_slow,
        )  # fmt: skip
        check_runnable(request, chosen)  # shapes too large here, the GPU suite on the CPU
        search_folders()  # the fo_tune variant's tables: a $FO_TUNE_TABLE_DIR naming a file is refused
        if driver:  # a bad --out costs nothing: checked before any rank starts
            check_bench_out(out or default_bench_dir(expected_device_key(chosen, world_size), world_size))
        with progress_bars(enabled=driver) as progress:
            where = "one GPU each, NCCL" if chosen == "nccl" else "gloo on the CPU"
            starting = f"start {count(world_size, 'rank')} ({where})"
            result = run_bench(request, ProgressReporter(progress, starting), keep=_keep(out, world_size))
        if result is None:  # a serving torchrun rank: rank 0 writes and reports
            return
        where = out or default_bench_dir(result.fingerprint.device_key, world_size)
        with finishing(f"kept every case in {where}"):
            written = write_bench_dir(result, where)
    _print_summary(result, written)
    failed = result.failed
    if failed:
        console.print(f"[bold red]FAILED[/]: {len(failed)} of {len(result.checked)} checked variants")
        raise typer.Exit(1)


def _keep(out: Path | None, world_size: int) -> Callable[[BenchResult], None]:
    """What a bench stopped by Ctrl-C or a failing rank does with the cases it finished: writes
    them (bench.yaml's settings.stopped says after which case and why) where a finished run is
    not replaced (``stopped_bench_dir``) and says where, on stderr; one that cannot be written
    there is said and the stop goes on."""

    def keep(result: BenchResult) -> None:
        from fo_tune.bench import default_bench_dir, stopped_bench_dir, write_bench_dir

        where = stopped_bench_dir(out or default_bench_dir(result.fingerprint.device_key, world_size))
        stopped = result.settings["stopped"]
        try:
            written = write_bench_dir(result, where)
        except FoTuneError as exc:
            err_console.print(f"the finished cases ({stopped}) were not kept: {exc}", markup=False)
            return
        err_console.print(f"kept the finished cases ({stopped}) in {written[0].parent}", markup=False)

    return keep


def register(app: typer.Typer) -> None:
    """Add ``bench`` to the root app."""
    app.command("bench", help=HELP)(bench)
