"""``fo-tune demo``: check and time the overlapped ops on local ranks (library: ``fo_tune.bench.demo``)."""

import math
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from fo_tune.cli.common import (
    BACKEND_NAMES,
    CPU_WORLD_SIZE_LIMIT,
    DEMO_DTYPE_NAMES,
    BackendOpt,
    DtypeOpt,
    RepsOpt,
    ShapesOpt,
    TimeoutOpt,
    console,
    parse_shape,
    summary_table,
)
from fo_tune.cli.errors import handle_errors

if TYPE_CHECKING:
    from fo_tune.bench.demo import DemoRow

HELP = "\n\n".join(
    [
        "Check the overlapped ops against matmul + collective on local processes, and time them.",
        "Spawns --world-size ranks and, for every shape, runs gemm_all_reduce, gemm_reduce_scatter and "
        "all_gather_gemm (the latter two when M is divisible by the world size, as the default shapes' M "
        "is made; for all_gather_gemm M is "
        "the gathered M, each rank holding M/w rows of A) with the schedule the runtime would pick: a "
        "tuned table row, else overlap: false (GEMM then the collective). Each result is compared on "
        "the ranks with a float64 matmul of the same operands and the same collective in "
        "torch.distributed (for all_gather_gemm the gather comes first); a row passes when the relative "
        "error is within the dtype's tolerance (1e-5 float32, 5e-3 float16, 1e-2 bfloat16) and nothing "
        "is NaN. With --dtype float8_e4m3fn the operands come with rowwise scales (scale_a, scale_b, "
        "as torch._scaled_mm's), the reference is that of the dequantized operands and the bfloat16 "
        "output passes within 2e-2; the sequential baseline is torch._scaled_mm then the collective. "
        "Both the overlapped op and the sequential baseline (GEMM, then the collective; the "
        "gather, then the GEMM) are timed.",
        "On GPUs the ranks use NCCL, one GPU each; without --world-size the demo starts 2 ranks, or one "
        "per GPU where there are fewer (world size 1 on a one-GPU machine). Without GPUs, or with "
        "--backend gloo, they use gloo and an overlapped call's GEMM runs in Triton's CPU interpreter: "
        "the check is real, the timings are not (they measure the interpreter). The first line says "
        "which. A call without a table row runs GEMM then the collective, as the baseline does: its "
        "speedup is shown as -.",
        "--engine copy_engine runs the copy engine's protocol instead, on --world-size ranks (default "
        "2) with no process group: where a GPU is visible, as virtual ranks on one GPU (every rank in "
        "this process, its operation lists issued through the CUDA driver as on N GPUs, eagerly), "
        "else on thread-ranks of its CPU executor: "
        "all_reduce, reduce_scatter and all_gather per shape, --reps calls on the same buffers, "
        "checked against float64. The times are all ranks' work on one GPU, or the executor's.",
        "Without GPUs a shape above 1024x1024x1024 (M*N*K) is refused (hours in the interpreter) "
        "unless --allow-slow.",
        "It writes no file: Ctrl-C stops the ranks (processes or threads) and prints nothing of "
        "the rows checked so far.",
        "Exit code 0 when every row passes, 1 when one fails, 2 for bad options, 130 when interrupted.",
    ]
)
ENGINES = ("auto", "copy_engine")
EngineOpt = Annotated[
    str,
    typer.Option(
        "--engine",
        "-e",
        help="auto: the schedule the runtime would pick; copy_engine: the copy engine's protocol on "
        "virtual ranks of one GPU, or on thread-ranks of its CPU executor without a GPU.",
    ),
]
AllowSlowOpt = Annotated[
    bool,
    typer.Option(
        "--allow-slow",
        help="Without GPUs, run shapes above 1024x1024x1024 (M*N*K) anyway: every op runs in Triton's "
        "CPU interpreter, hours for a GPU-sized shape, so they are refused otherwise (not read by "
        "--engine copy_engine, whose CPU executor runs torch's matmul).",
    ),
]


DemoWorldSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        "-w",
        help="Number of local processes (ranks); one GPU each with NCCL, at most "
        f"{CPU_WORLD_SIZE_LIMIT} on the CPU (gloo processes or the copy engine's thread-ranks). "
        "Default: 2, or the number of GPUs where there are fewer.",
    ),
]


def _fmt(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def _ms(x: float) -> str:
    return _fmt(x, ".3f" if x < 100 else ".1f")


def _schedule_line(row: "DemoRow") -> str:
    where = f"{row.collective} {row.shape}"
    if row.skipped:
        return f"{where}: skipped, {row.reason}"
    return f"{where}: {row.schedule_source}: {row.schedule.split(': ', 1)[-1]}"


def _table(rows: "list[DemoRow]", world_size: int, backend: str) -> Table:
    from fo_tune.output import count

    where = {
        "nccl": "NCCL, one GPU per rank",
        "cpu-threads": "the copy engine's CPU executor, thread-ranks",
        "virtual-ranks": "the copy engine's virtual ranks on one GPU",
    }.get(backend, "gloo on the CPU (Triton kernels in its interpreter)")
    dtypes = ", ".join(sorted({r.dtype for r in rows}))
    table = summary_table(
        f"fo-tune demo: {count(world_size, 'rank')}, {where}, {dtypes}",
        ["status", "collective", "MxNxK", "rel err", "overlap ms", "seq ms", "speedup"],
        3,
    )
    styles = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}
    for row in rows:
        table.add_row(
            f"[{styles[row.status]}]{row.status}[/]",
            row.collective,
            row.shape,
            "NaN" if row.has_nan else _fmt(row.rel_err, ".1e"),
            _ms(row.overlapped_ms),
            _ms(row.sequential_ms),
            "-" if row.skipped or math.isnan(row.speedup) else _fmt(row.speedup, ".2f") + "x",
        )
    return table


@handle_errors
def demo(
    world_size: DemoWorldSizeOpt = None,
    shape: ShapesOpt = None,
    dtype: DtypeOpt = None,
    backend: BackendOpt = "auto",
    reps: RepsOpt = 5,
    timeout: TimeoutOpt = 600.0,
    engine: EngineOpt = "auto",
    allow_slow: AllowSlowOpt = False,
) -> None:
    """``fo-tune demo`` (its help: ``HELP``)."""
    from fo_tune.output import count

    shapes = [parse_shape(s) for s in shape or []]
    if dtype is not None and dtype not in DEMO_DTYPE_NAMES:
        raise typer.BadParameter(f"--dtype {dtype!r} is not one of {', '.join(DEMO_DTYPE_NAMES)}")
    if backend not in BACKEND_NAMES:
        raise typer.BadParameter(f"--backend {backend!r} is not one of {', '.join(BACKEND_NAMES)}")
    if world_size is not None and world_size < 1:
        raise typer.BadParameter(f"--world-size must be >= 1, got {world_size}")
    if reps < 1:
        raise typer.BadParameter(f"--reps must be >= 1, got {reps}")
    if not timeout > 0:
        raise typer.BadParameter(f"--timeout must be > 0, got {timeout}")
    if engine not in ENGINES:
        raise typer.BadParameter(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "copy_engine" and ((world_size is not None and world_size < 2) or backend != "auto"):
        raise typer.BadParameter(
            "--engine copy_engine runs 2 or more ranks in this process (virtual ranks on one GPU, or "
            "thread-ranks of its CPU executor): give --world-size >= 2 and leave --backend out"
        )
    if engine == "copy_engine" and allow_slow:
        raise typer.BadParameter(
            "--allow-slow is for the Triton ops in the CPU interpreter; --engine copy_engine runs any "
            "shape without it: drop --allow-slow"
        )

    from fo_tune.bench.demo import (
        VIRTUAL_BACKEND,
        copy_engine_demo_inputs,
        demo_inputs,
        plan_demo,
        run_copy_engine_demo,
        run_demo,
    )
    from fo_tune.cli.progress import ProgressReporter, progress_bars, status
    from fo_tune.ranks.backend import visible_gpus
    from fo_tune.tables.find import search_folders

    # every check runs before the first line is printed
    if engine == "copy_engine":
        ranks = world_size or 2
        where = copy_engine_demo_inputs(ranks, shapes or None, dtype, reps, None)[0]
        how = (
            f"{ranks} virtual ranks on one GPU (one process, no process group)"
            if where == VIRTUAL_BACKEND
            else f"{ranks} thread-ranks of its CPU executor (no GPU, no process group)"
        )
        console.print(f"fo-tune demo: the copy engine's protocol on {how}", markup=False, highlight=False)
        with progress_bars() as progress:  # a GPU-sized shape takes minutes on the CPU executor
            reporter = ProgressReporter(progress, f"start {count(ranks, 'rank')}")
            rows = run_copy_engine_demo(ranks, shapes or None, dtype, reps, backend=where, reporter=reporter)
        console.print(_table(rows, ranks, where))
        console.print("schedules (the copy engine's operation lists, as on GPUs):", style="dim")
    else:
        plan = plan_demo(world_size, backend, visible_gpus())
        demo_inputs(plan, shapes or None, dtype, reps, timeout, allow_slow=allow_slow)
        search_folders()  # the runtime's tables: a $FO_TUNE_TABLE_DIR naming a file is refused
        console.print(f"fo-tune demo: {plan.note}", markup=False, highlight=False)
        with status(f"running {count(plan.world_size, 'rank')} ..."):
            rows = run_demo(
                plan.world_size, shapes or None, dtype, plan.backend, reps, timeout, allow_slow=allow_slow
            )
        console.print(_table(rows, plan.world_size, plan.backend))
        # gloo ranks' rows come from measuring them: without --mode the search plans an H200
        search = "fo-tune search --mode measure" if plan.backend == "gloo" else "fo-tune search"
        console.print(
            "schedules (the table rows the runtime found; without one it runs GEMM then the "
            + (
                f"collective: tune the shape with `{search}`):"
                if plan.world_size > 1
                else "identity collective of one rank, the GEMM alone: nothing to tune):"
            ),
            style="dim",
        )
    for row in rows:
        console.print(f"  {_schedule_line(row)}", style="dim", markup=False, highlight=False)
    failed = [r for r in rows if r.status == "FAIL"]
    skipped = sum(r.skipped for r in rows)
    checked = len(rows) - skipped
    extra = f", {skipped} skipped" if skipped else ""
    if failed:
        console.print(f"[bold red]FAILED[/]: {len(failed)} of {checked} checked rows{extra}")
        raise typer.Exit(1)
    console.print(f"[green]passed[/]: {checked} of {checked} checked rows{extra}")


def register(app: typer.Typer) -> None:
    """Add ``demo`` to the root app."""
    app.command("demo", help=HELP)(demo)
