"""``fo-tune profile``: every tile config of the search space for one GEMM shape, next to cuBLAS.

Library: ``fo_tune.calibrate.profile.profile_shape`` (measures), ``fo_tune.calibrate.files.write_profile_csv``
(writes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fo_tune.cli.common import (
    DTYPE_NAMES,
    SCALING_NAMES,
    BackendOpt,
    SpaceOpt,
    WorldSizeOpt,
    check_dtype,
    console,
    err_console,
    expected_device_key,
    fmt,
    is_driver_process,
    nonempty_path,
    parse_shape,
    resolve_backend,
    resolve_space,
    summary_table,
    triton_mode,
)
from fo_tune.cli.errors import finishing, handle_errors
from fo_tune.cli.progress import status

HELP = "\n\n".join(
    [
        "Time every feasible GEMM tile config of the search space for one shape, next to cuBLAS.",
        "Runs the signalled persistent GEMM with each tile config of the search space at each grid "
        "size SMs - r (r = 0 and every sms_free of the space), checks each result against a float32 "
        "matmul, then times it in alternation with cuBLAS, both back to back (median over "
        "repetitions, max over ranks; each row's cuBLAS time is its own). A config that fails to "
        "compile, launch or check is skipped with its reason.",
        "Writes a CSV sorted by time (skipped configs last; columns as gemm_profile.csv of "
        "`fo-tune calibrate`, with cublas_ms on every row, and timing) to --out, default "
        "results/profiles/<device-key>/<M>x<N>x<K>-<dtype>.csv (fp8 with --scaling tensorwise: "
        "<M>x<N>x<K>-float8_e4m3fn-tensorwise.csv), and prints the ranking.",
        "Then the three fastest configs of each grid are timed again, all of them and cuBLAS side by "
        "side in one run, and each grid keeps the fastest of its own there, so that a reduced grid's "
        "cost over its share of SMs (its time over the full grid's best, divided by grid_0 / grid) is "
        "read off one clock: printed, and written next to the profile as "
        "<M>x<N>x<K>-<dtype>-grids.csv, or -tensorwise-grids.csv (its candidates column: how many "
        "configs of the grid ran); the grids CSV of a profile this one replaces is removed first. "
        "Ratios across the ranking's rows compare different runs and move with the card's drift.",
        "--timing graphs (the default on GPUs) captures each sample's calls into one CUDA graph and "
        "replays it, for cuBLAS and the GEMM alike: the GPU's own time, where a call's host time "
        "(Triton's launch path: ~0.08 ms a call on an H200's host) would otherwise bound a short "
        "GEMM's samples. --timing eager has the host issue every call. Both CSVs say which in "
        "their timing column. Every output is poisoned before its timed calls and checked after them.",
        "--dtype float8_e4m3fn: fp8 operands and a bfloat16 output, the signalled GEMM timed beside "
        "torch._scaled_mm, both given the same scales (--scaling): rowwise, the default, (M, 1) and "
        "(1, N), the scaling the tables and `fo-tune calibrate` are tuned for; or tensorwise, one "
        "0-dim scale each, the other scaling torch._scaled_mm serves. Checked against the float32 "
        "product of the dequantized operands. fp8 tries the space's fp8 tiles where it lists its own "
        "(dtype_tiles: 128-deep K blocks in search_spaces/hopper.yaml).",
        "Without GPUs the GEMM runs in Triton's CPU interpreter with the space's cpu tiles, timed "
        "eager: use tiny shapes (e.g. 32x48x40); a shape above 1024x1024x1024 (M*N*K) is refused "
        "there (hours in the interpreter) unless --allow-slow.",
        "Ctrl-C while the configs are timed writes nothing (a profile at --out and its grids CSV "
        "are left as they were); once the profile is written (and a grids CSV beside it removed), "
        "it is kept without grids, said on stderr.",
        "Exit code 0 when the CSV is written, 1 when a measurement fails, 2 for bad options, 130 "
        "when interrupted.",
    ]
)

AllowSlowOpt = Annotated[
    bool,
    typer.Option(
        "--allow-slow",
        help="Without GPUs, profile a shape above 1024x1024x1024 (M*N*K) anyway: Triton's CPU "
        "interpreter takes hours for a GPU-sized shape, so it is refused otherwise.",
    ),
]
ShapeOpt = Annotated[
    str,
    typer.Option(
        "--shape",
        "-s",
        metavar="MxNxK",
        help="GEMM problem M x N x K (A is MxK, B is KxN), e.g. 4096x8192x4096.",
    ),
]
OutFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        parser=nonempty_path,
        metavar="FILE",
        help="CSV to write (a profile there is replaced atomically; any other file is refused). "
        "Default: results/profiles/<device-key>/<M>x<N>x<K>-<dtype>.csv, "
        "<M>x<N>x<K>-float8_e4m3fn-tensorwise.csv with --scaling tensorwise.",
    ),
]
ProfileDtypeOpt = Annotated[
    str, typer.Option("--dtype", "-d", help=f"Operand dtype: {', '.join(DTYPE_NAMES)}.")
]
ScalingOpt = Annotated[
    str,
    typer.Option(
        "--scaling",
        help="fp8 only (--dtype float8_e4m3fn): the operands' scales, given to the GEMM and "
        "torch._scaled_mm alike: rowwise ((M, 1) and (1, N)) or tensorwise (0-dim each). The tables "
        "and `fo-tune calibrate` are tuned rowwise; tensorwise profiles measure the other scaling "
        "torch._scaled_mm serves.",
    ),
]
# The dtype whose operands take scales (fo_kernels.scaling.FP8_DTYPE's name).
FP8_NAME = "float8_e4m3fn"
TIMINGS = ("auto", "graphs", "eager")
TimingOpt = Annotated[
    str,
    typer.Option(
        "--timing",
        help="How a sample runs its calls: graphs (one CUDA graph replay: the GPU's time; GPUs only), "
        "eager (the host issues each call), or auto (graphs on GPUs, eager on the CPU).",
    ),
]


def resolve_timing(timing: str, backend: str) -> bool:
    """Whether the samples replay CUDA graphs: ``--timing`` checked against the backend (NCCL ranks
    run on GPUs, gloo ranks on the CPU, where no graphs exist)."""
    if timing not in TIMINGS:
        raise typer.BadParameter(f"--timing {timing!r} is not one of {', '.join(TIMINGS)}")
    on_gpus = backend == "nccl"
    if timing == "graphs" and not on_gpus:
        raise typer.BadParameter("--timing graphs needs GPUs (CUDA graphs); on the CPU use --timing eager")
    return timing == "graphs" or (timing == "auto" and on_gpus)


def check_scaling(scaling: str, dtype: str) -> str:
    """``scaling`` when it is one of ``SCALING_NAMES`` and ``dtype`` takes it (any but the default
    needs fp8 operands: no other dtype has scales), else ``typer.BadParameter`` naming --scaling."""
    if scaling not in SCALING_NAMES:
        raise typer.BadParameter(f"--scaling {scaling!r} is not one of {', '.join(SCALING_NAMES)}")
    if scaling != SCALING_NAMES[0] and dtype != FP8_NAME:
        raise typer.BadParameter(
            f"--scaling {scaling} is for --dtype {FP8_NAME}; {dtype} operands have no scales"
        )
    return scaling


def _print_ranking(points, shape: str, device_key: str, path: Path) -> None:
    ok = [p for p in points if p.status == "ok" and not math.isnan(p.time_ms)]
    skipped = [p for p in points if p not in ok]
    cublas = points[0].cublas_ms if points else math.nan
    table = summary_table(
        f"{shape}: {len(ok)} of {len(points)} configs measured, cuBLAS {fmt(cublas)} ms, {device_key}",
        ["#", "tile", "r", "grid", "ms", "spread ms", "cuBLAS ms", "cuBLAS/ours", "rel err"],
        2,
    )
    for i, p in enumerate(sorted(ok, key=lambda p: p.time_ms), 1):
        ratio = p.cublas_ms / p.time_ms if p.time_ms > 0 else math.nan
        table.add_row(
            str(i),
            p.tile,
            str(p.sms_free),
            str(p.grid),
            fmt(p.time_ms),
            fmt(p.spread_ms, ".2g"),
            fmt(p.cublas_ms),
            fmt(ratio, ".3g"),
            fmt(p.rel_err, ".1e"),
        )
    console.print(table)
    if skipped:
        console.print(f"[yellow]skipped[/] {len(skipped)}:")
        for p in skipped:
            console.print(f"  {p.tile} r={p.sms_free}: {p.status}", markup=False, highlight=False)
    console.print(f"[green]wrote[/] {escape(str(path))}")


def _print_grids(rows, shape: str, path: Path) -> None:
    table = summary_table(
        f"{shape}: each grid's fastest of its best profiled configs, timed side by side in one run",
        ["r", "grid", "tile", "ms", "cuBLAS/ours", "over SM share"],
        0,
        text=["tile"],
    )
    for g in rows:
        table.add_row(
            str(g.sms_free),
            str(g.grid),
            g.tile,
            fmt(g.time_ms),
            fmt(g.cublas_ms / g.time_ms if g.time_ms > 0 else math.nan, ".3g"),
            fmt(g.over_share, ".3f"),
        )
    console.print(table)
    console.print(f"[green]wrote[/] {escape(str(path))}")


@handle_errors
def profile(
    shape: ShapeOpt,
    space: SpaceOpt = None,
    dtype: ProfileDtypeOpt = "bfloat16",
    world_size: WorldSizeOpt = 1,
    backend: BackendOpt = "auto",
    out: OutFileOpt = None,
    timing: TimingOpt = "auto",
    scaling: ScalingOpt = SCALING_NAMES[0],
    allow_slow: AllowSlowOpt = False,
) -> None:
    """``fo-tune profile`` (its help: ``HELP``)."""
    m, n, k = parse_shape(shape)
    check_dtype(dtype)
    check_scaling(scaling, dtype)
    problem = f"{m}x{n}x{k} {dtype}" + (f" {scaling}" if dtype == FP8_NAME else "")
    chosen = resolve_backend(world_size, backend)
    graphs = resolve_timing(timing, chosen)
    driver = is_driver_process()
    with triton_mode(chosen):  # before anything imports fo_kernels
        search_space = resolve_space(space, chosen)
        from fo_tune.calibrate.files import check_profile_out, default_profile_path, grids_path

        if driver:
            key = expected_device_key(chosen, world_size)
            check_profile_out(out or default_profile_path(key, (m, n, k), dtype, scaling=scaling))
        from fo_tune.calibrate.profile import profile_shape
        from fo_tune.ranks.launch import fingerprinted_pool
        from fo_tune.ranks.limits import (
            CPU_MAX_SIDE,
            check_problem_size,
            largest_for_the_interpreter,
            local_target,
        )

        check_problem_size([(m, n, k)], dtype, local_target(chosen, world_size))
        if chosen != "nccl" and not allow_slow and largest_for_the_interpreter([(m, n, k)]) is not None:
            side = CPU_MAX_SIDE
            raise typer.BadParameter(
                f"--shape {m}x{n}x{k} without GPUs runs every config in Triton's CPU interpreter, hours "
                f"for a GPU-sized shape: profile it on the GPU, give a shape up to {side}x{side}x{side}, "
                "or pass --allow-slow to run it anyway"
            )

        with fingerprinted_pool(world_size, backend=chosen, purpose="profile") as (pool, fp):
            if fp is None:  # a serving torchrun rank: rank 0 writes and reports
                return
            cpu = pool.backend != "nccl"
            tiles = tuple(search_space.tile_candidates(dtype=dtype, quick=False, cpu=cpu))
            frees = tuple(sorted({0, *search_space.sms_free_candidates(cpu=cpu)}))
            what = f"profiling {m}x{n}x{k}: {len(tiles)} tiles x {len(frees)} grids on {world_size} rank(s)"
            with status(what):
                device_key = fp.device_key
                points = profile_shape(pool, m, n, k, tiles, frees, dtype, graphs=graphs, scaling=scaling)
            from fo_tune.calibrate.calibration import timing_name
            from fo_tune.calibrate.files import write_grids_csv, write_profile_csv

            target = out or default_profile_path(device_key, (m, n, k), dtype, scaling=scaling)
            with finishing(f"kept the profile in {target}; its grids were not timed"):
                path = write_profile_csv(points, target, device_key, timing_name(graphs))
            # A grids CSV beside it belongs to the profile just replaced: removed before this one's
            # grids are timed, so a failure or a profile without grids leaves no mismatched pair.
            stale = grids_path(path).exists()
            grids_path(path).unlink(missing_ok=True)
            _print_ranking(points, f"{problem}, {timing_name(graphs)}", device_key, path)
            from fo_tune.calibrate.profile import confirm_grids

            side_by_side = f"timing the best of each grid side by side ({m}x{n}x{k})"
            try:
                with status(side_by_side):
                    grids = confirm_grids(pool, points, dtype, graphs=graphs, scaling=scaling)
            except KeyboardInterrupt:  # the profile is whole: say so before "error: interrupted"
                err_console.print(f"kept the profile in {path}; its grids were not timed", markup=False)
                raise
            if grids:
                grids_file = write_grids_csv(grids, grids_path(path), device_key)
                _print_grids(grids, f"{problem}, {timing_name(graphs)}", grids_file)
            elif stale:
                console.print(
                    f"removed {grids_path(path)}: the replaced profile's; this one has no grid to "
                    "compare beside the full one",
                    markup=False,
                    highlight=False,
                )


def register(app: typer.Typer) -> None:
    """Add ``profile`` to the root app."""
    app.command("profile", help=HELP)(profile)
