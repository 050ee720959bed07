"""``fo-tune calibrate``: measure this machine (library: ``fo_tune.calibrate.run``; files:
``fo_tune.calibrate.files``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fo_tune.cli.common import (
    DTYPE_NAMES,
    BackendOpt,
    SpaceOpt,
    WorldSizeOpt,
    check_dtype,
    console,
    expected_device_key,
    fmt,
    is_driver_process,
    local_device,
    nonempty_path,
    parse_collectives,
    parse_names,
    resolve_backend,
    resolve_space,
    summary_table,
    triton_mode,
)
from fo_tune.cli.errors import finishing, handle_errors
from fo_tune.cli.progress import ProgressReporter, progress_bars

if TYPE_CHECKING:
    from fo_tune.calibrate.calibration import Calibration, GemmPoint

# fo_tune.calibrate.calibration.CALIBRATED_COLLECTIVES and fo_tune.calibrate.run.PARTS, for the help
# text (importing them pulls in torch, which --help does not need; a test checks they match).
CALIBRATED_NAMES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
PART_NAMES = ("bandwidth", "interference", "gemm", "copy_engine", "copy_engine_n", "moe_host")

HELP = "\n\n".join(
    [
        "Measure this machine: NCCL bandwidth curves, compute/communication interference and GEMM "
        "tile profiles; the model and the search read the result.",
        "Spawns --world-size ranks (or joins torchrun's) and measures, in one pool of processes: "
        "(1) bandwidth: each collective over message sizes for every NCCL CTA cap of the search space "
        "(nccl-tests columns: size, time, algbw, busbw); (2) interference: a collective while the "
        "signalled GEMM runs on SMs - r, for each r of the space: the collective's and the GEMM's "
        "slowdown, and whether the collective ran during the GEMM at all; (3) GEMM profiles: time per "
        "tile config per grid size for the space's shape set, next to cuBLAS; (4) fits of "
        "time = latency + bytes / bandwidth; (5) the copy engine's section (see --only); (6) the "
        "expert-parallel FFN's host times on rank 0 (moe_host), which the MoE model reads.",
        "Writes bandwidth.csv, interference.csv, gemm_profile.csv, fits.csv, calibration.yaml "
        "(fingerprint, schema version, everything) and bandwidth.png / interference.png into --out "
        "(default results/calibration/<device-key>/tp<N>/), all at once: a folder there from an "
        "earlier calibration is replaced only when everything was written. A run of some parts "
        "(--only, --world-size 1) writes their files; an earlier calibration of this machine there "
        "that holds more than the run measures keeps it: its other files stay, and its "
        "calibration.yaml is merged with what was measured (in another --dtype it is refused).",
        "--quick measures fewer sizes, tiles and grids (a few minutes on 2 GPUs). Without GPUs the "
        "ranks use gloo, the GEMM runs in Triton's CPU interpreter and the search space's cpu section "
        "gives tiny sizes: the pipeline is exercised, the numbers describe the CPU.",
        "--from-profiles DIR --into FILE --only gemm --dtype D merges the GEMM profile in D (fp8) "
        "from `fo-tune profile` CSVs instead of measuring: no GPU needed.",
        "Ctrl-C stops the ranks and writes nothing: --out (or --into) is left as it was. One while "
        "the files of a finished run are written stops once they are, the folder named on stderr.",
        "Exit code 0 when the files are written, 1 when a measurement fails, 2 for bad options, 130 "
        "when interrupted.",
    ]
)

CollectivesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--collectives",
        "-c",
        metavar="NAME[,NAME]",
        help=f"Collectives to measure, repeated or comma-separated: {', '.join(CALIBRATED_NAMES)}. "
        "Default: all four.",
    ),
]
QuickOpt = Annotated[
    bool, typer.Option("--quick", help="Fewer sizes, tiles and grids: minutes, not an hour.")
]
OutDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        parser=nonempty_path,
        metavar="DIR",
        help="Folder to write (created, or replaced when it holds an earlier calibration of this "
        "machine's device key; another machine's is refused). "
        "Default: results/calibration/<device-key>/tp<N>.",
    ),
]
OnlyOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--only",
        metavar="PART[,PART]",
        help="Measure only these parts: bandwidth, interference, gemm, copy_engine (the copy engine's "
        "section: library GEMM chunks and the sustained clock on one GPU; peer copies, flags and host "
        "times on two), copy_engine_n (the copy engine at N peers on one GPU: host times at N = 2..8 "
        "with virtual ranks, chunk GEMMs at TP=4/8 layer shapes; merge it with --into), moe_host (the "
        "expert-parallel FFN's host times on one rank: a piece's two phases and a whole call, "
        "medians over a few public experts' shapes; the MoE model reads them instead of its "
        "constants of one H100 host). Default: every part but copy_engine_n; with --world-size 1, "
        "gemm, copy_engine and moe_host.",
    ),
]
IntoOpt = Annotated[
    Path | None,
    typer.Option(
        "--into",
        parser=nonempty_path,
        metavar="FILE",
        help="Merge what this run measures into an existing calibration.yaml (of the same GPU model, "
        "or of the same die with --into-sibling; e.g. one GPU's copy-engine measurements into the "
        "TP=2 calibration; bandwidth and interference only at the calibration's world size) "
        "instead of writing a folder.",
    ),
]
IntoSiblingOpt = Annotated[
    bool,
    typer.Option(
        "--into-sibling",
        help="With --into and --only copy_engine_n and/or moe_host, or --only gemm in another dtype "
        "than the calibration's (fp8): merge although this GPU (or --from-profiles' GPU) is another model "
        "than the calibration's, where the two share the die (the same compute capability and SM "
        "count, e.g. an H100 into an H200's calibration); each point merged records that GPU's "
        "device key (measured_on), and the plans resting on it name it in their basis.",
    ),
]
FromProfilesOpt = Annotated[
    Path | None,
    typer.Option(
        "--from-profiles",
        parser=nonempty_path,
        metavar="DIR",
        help="With --into, --only gemm and --dtype D (another dtype than the calibration's, e.g. "
        "float8_e4m3fn): measure nothing, read the GEMM profile from DIR's <M>x<N>x<K>-<D>.csv "
        "files (`fo-tune profile`, e.g. results/profiles/<device-key>/) and merge it as a measured "
        "one is merged; their device_key column must be the calibration's GPU, or a sibling of the "
        "same die with --into-sibling. Needs no GPU.",
    ),
]
CalDtypeOpt = Annotated[
    str, typer.Option("--dtype", "-d", help=f"GEMM and message dtype: {', '.join(DTYPE_NAMES)}.")
]


# ----------------------------------------------------------------------------------- the summary
def _not_measured(part: str, parts: tuple[str, ...], world_size: int) -> str | None:
    """Why ``part`` was not measured (world size 1, or left out of --only), None when it was."""
    if part in parts:
        return None
    why = "world size 1 has no collective" if world_size == 1 else "not in --only"
    return f"{part}: not measured ({why})"


def _print_summary(cal: Calibration, written: list[Path], parts: tuple[str, ...]) -> None:
    """The bandwidth, interference and GEMM tables of the parts measured (``parts``), a line for
    each collective part not measured, then the files written."""
    from fo_tune.calibrate.files import bandwidth_summary, interference_summary

    skipped = [_not_measured(part, parts, cal.world_size) for part in ("bandwidth", "interference")]
    for line in filter(None, skipped):
        console.print(line, style="dim", markup=False, highlight=False)
    if skipped[0] is None:
        _print_bandwidth(cal, bandwidth_summary(cal))
    if skipped[1] is None:
        _print_interference(cal, interference_summary(cal))
    if "gemm" in parts:
        console.print(gemm_table(cal.gemm, "GEMM: best tile per shape"))
    _print_moe_host(cal, parts)
    folder = escape(str(written[0].parent)) if written else "-"
    console.print(f"[green]wrote[/] {len(written)} file{'s' * (len(written) != 1)} to {folder}:")
    for path in written:
        console.print(f"  {path}", markup=False, highlight=False)
    kept = sorted(p.name for p in written[0].parent.iterdir() if p not in written) if written else []
    if kept:  # an earlier calibration's files of the parts not measured
        console.print(f"kept the earlier calibration's {', '.join(kept)} (not measured)", markup=False)


def _print_moe_host(cal: Calibration, parts: tuple[str, ...]) -> None:
    """The MoE host times measured (``parts`` holds moe_host), in a line."""
    from fo_tune.output import count

    record = cal.moe_host
    if "moe_host" not in parts or record is None:
        return
    console.print(
        f"MoE host times on one rank: phase 1 {fmt(record.phase1_ms)} ms, phase 2 "
        f"{fmt(record.phase2_ms)} ms, a call {fmt(record.call_ms)} ms (medians over "
        f"{count(len(record.shapes.split('; ')), 'shape')}, {record.reps} calls each)",
        markup=False,
        highlight=False,
    )


def _print_bandwidth(cal: Calibration, summary: list) -> None:
    from fo_tune.output import count, size_label

    where = "NCCL" if cal.fingerprint.interconnect != "gloo" else "gloo on the CPU"
    bw = summary_table(
        f"bandwidth: {count(cal.world_size, 'rank')}, {where}, {cal.fingerprint.device_key}",
        ["collective", "CTA cap", "largest size", "busbw GB/s", "fit latency us", "fit bw GB/s"],
        2,
    )
    for r in summary:
        cap = "default" if r.nccl_max_ctas == 0 else str(r.nccl_max_ctas)
        bw.add_row(
            r.collective,
            cap,
            size_label(r.size_bytes),
            fmt(r.busbw_gbs),
            fmt(r.latency_ms * 1e3),
            fmt(r.bandwidth_gbs),
        )
    console.print(bw)


def _print_interference(cal: Calibration, rows: list) -> None:
    from fo_tune.output import size_label

    if not rows:
        console.print("interference: nothing measured (no sms_free > 0 in the search space)", style="dim")
    inter = summary_table(
        f"interference: the {'x'.join(map(str, _gemm_shape(cal)))} GEMM on SMs - r beside the collective",
        ["collective", "size", "r", "CTA cap", "comm slowdown", "GEMM slowdown", "during GEMM"],
        2,
        text=["during GEMM"],
    )
    for r in rows:
        cap = "default" if r.nccl_max_ctas == 0 else str(r.nccl_max_ctas)
        during = "yes" if r.comm_during_gemm else "no"
        inter.add_row(
            r.collective,
            size_label(r.size_bytes),
            str(r.sms_free),
            cap,
            fmt(r.comm_slowdown, ".2f") + "x",
            fmt(r.gemm_slowdown, ".2f") + "x",
            during,
        )
    if rows and not all(r.concurrent for r in rows):
        inter.caption = "on the CPU the two run one after the other: these slowdowns are timing noise"
    if rows:
        console.print(inter)


def _gemm_shape(cal: Calibration) -> tuple[int, int, int]:
    p = cal.interference[0] if cal.interference else None
    return (p.gemm_m, p.gemm_n, p.gemm_k) if p else (0, 0, 0)


def gemm_table(points: Iterable[GemmPoint], title: str) -> Table:
    """Per shape: the fastest measured tile config and grid, next to cuBLAS."""
    from fo_tune.calibrate.files import gemm_summary

    table = summary_table(
        title, ["MxNxK", "best tile", "r", "grid", "ms", "cuBLAS ms", "cuBLAS/ours", "measured"], 2
    )
    for s in gemm_summary(points):
        shape = "x".join(map(str, s.shape))
        measured = f"{s.measured}/{s.total}"
        if s.best is None:
            table.add_row(
                shape, "[yellow]every config skipped[/]", "-", "-", "-", fmt(s.cublas_ms), "-", measured
            )
            continue
        b = s.best
        ratio = s.cublas_ms / b.time_ms if b.time_ms > 0 else math.nan
        table.add_row(
            shape,
            b.tile,
            str(b.sms_free),
            str(b.grid),
            fmt(b.time_ms),
            fmt(s.cublas_ms),
            fmt(ratio, ".3g"),
            measured,
        )
    return table


# ------------------------------------------------------------------------------------ the command
@handle_errors
def calibrate(
    world_size: WorldSizeOpt = 2,
    collectives: CollectivesOpt = None,
    quick: QuickOpt = False,
    out: OutDirOpt = None,
    space: SpaceOpt = None,
    dtype: CalDtypeOpt = "bfloat16",
    backend: BackendOpt = "auto",
    only: OnlyOpt = None,
    into: IntoOpt = None,
    into_sibling: IntoSiblingOpt = False,
    from_profiles: FromProfilesOpt = None,
) -> None:
    """``fo-tune calibrate`` (its help: ``HELP``)."""
    from fo_tune.output import count

    if into_sibling and into is None:
        raise typer.BadParameter(
            "--into-sibling merges into an existing calibration: pass --into CALIBRATION.yaml with "
            "it, or drop it"
        )
    if into is not None and not into.is_file():  # the loader's hint names --calibration, not --into
        what = "a folder, not a calibration file" if into.is_dir() else "no such calibration file"
        raise typer.BadParameter(
            f"--into {into}: {what} to merge into; give an existing calibration.yaml (`fo-tune "
            "calibrate --out DIR` writes one)"
        )
    names = parse_collectives(
        collectives, valid=CALIBRATED_NAMES, default=CALIBRATED_NAMES, option="--collectives"
    )
    check_dtype(dtype)
    parts = parse_names(only, valid=PART_NAMES, option="--only", what="part")
    _refuse_unread(
        out=out, into=into, from_profiles=from_profiles, collectives=collectives, quick=quick,
        space=space, backend=backend, parts=parts, world_size=world_size,
    )  # fmt: skip
    if from_profiles is not None:
        _merge_profiles(from_profiles, into, parts, dtype, into_sibling)
        return
    chosen = resolve_backend(world_size, backend)
    driver = is_driver_process()
    with triton_mode(chosen):  # before anything imports fo_kernels
        search_space = resolve_space(space, chosen)
        from fo_tune.calibrate.calibration import load_calibration
        from fo_tune.calibrate.files import (
            DEFAULT_ROOT,
            check_calibration_out,
            default_out_dir,
            earlier_calibration,
            write_calibration_dir,
        )
        from fo_tune.calibrate.run import CalibrationRequest, run_calibration

        request = CalibrationRequest(
            world_size=world_size,
            collectives=names,
            quick=quick,
            dtype=dtype,
            backend=chosen,
            space=search_space,
            parts=parts,
        )
        target = load_calibration(into) if into is not None else None  # checked before any rank starts
        if target is not None:
            from fo_kernels.fingerprint import current_fingerprint
            from fo_tune.calibrate.run import check_mergeable

            here = current_fingerprint(local_device(chosen), world_size)
            check_mergeable(target, here, dtype, request.selected(), sibling=into_sibling)
        earlier = None  # the calibration in --out that the parts measured are merged into
        if driver and into is None:  # a bad --out costs nothing: checked before any rank starts
            key = expected_device_key(chosen, world_size)
            out = out or DEFAULT_ROOT / key / f"tp{world_size}"
            check_calibration_out(out, key)
            earlier = earlier_calibration(out, key, dtype, request.selected())
        with progress_bars(enabled=driver) as progress:
            where = "one GPU each, NCCL" if chosen == "nccl" else "gloo on the CPU"
            starting = f"start {count(world_size, 'rank')} ({where})"
            cal = run_calibration(request, ProgressReporter(progress, starting))
        if cal is None:  # a serving torchrun rank: rank 0 writes and reports
            return
        if target is not None:
            from fo_tune.calibrate.calibration import save_calibration
            from fo_tune.calibrate.run import merge_into

            assert into is not None
            with finishing(f"kept the measurements, merged into {into}"):
                save_calibration(merge_into(target, cal, request.selected(), sibling=into_sibling), into)
            _print_moe_host(cal, request.selected())
            console.print(
                f"[green]merged[/] {', '.join(request.selected())} into {escape(str(into))}", highlight=False
            )
            return
        if earlier is not None:  # the parts not measured keep their numbers and files
            from fo_tune.calibrate.run import merge_into

            cal = merge_into(earlier, cal, request.selected())
        where = out or default_out_dir(cal)
        with finishing(f"kept the calibration in {where}"):
            written = write_calibration_dir(cal, where, request.selected())
    _print_summary(cal, written, request.selected())


def _refuse_unread(
    *,
    out: Path | None,
    into: Path | None,
    from_profiles: Path | None,
    collectives: list[str] | None,
    quick: bool,
    space: Path | None,
    backend: str,
    parts: tuple[str, ...] | None,
    world_size: int,
) -> None:
    """Refuse (``typer.BadParameter``) an option this run would not read, before any rank starts: a
    mistyped run must not look like the one asked for."""
    if from_profiles is not None:
        given = {"--out": out, "--quick": quick, "--collectives": collectives, "--space": space}
        unread = [name for name, value in given.items() if value] + (
            ["--backend"] if backend != "auto" else []
        )
        if unread:
            raise typer.BadParameter(
                f"--from-profiles measures nothing and writes --into: drop {', '.join(unread)}"
            )
    if into is not None and out is not None:
        raise typer.BadParameter(
            f"--into merges into {into} and writes no folder, so --out is not read: drop one of them"
        )
    collective_parts = {"bandwidth", "interference"}  # the parts that measure --collectives
    measured = set(parts) if parts is not None else (set() if world_size == 1 else collective_parts)
    if collectives and not measured & collective_parts:
        what = f"--only {','.join(parts)}" if parts is not None else "--world-size 1"
        fix = "add those parts to --only" if world_size > 1 else "give --world-size 2 or more"
        raise typer.BadParameter(
            f"--collectives is read by the bandwidth and interference parts, and {what} measures "
            f"neither: drop --collectives, or {fix}"
        )


def _merge_profiles(
    folder: Path, into: Path | None, parts: tuple[str, ...] | None, dtype: str, sibling: bool
) -> None:
    """--from-profiles: ``folder``'s GEMM profiles in ``dtype`` merged into ``into``, nothing
    measured (``fo_tune.calibrate.from_profiles``)."""
    if into is None:
        raise typer.BadParameter(
            "--from-profiles merges into an existing calibration: pass --into CALIBRATION.yaml with it"
        )
    if tuple(parts or ()) != ("gemm",):  # fo_tune.calibrate.run.OTHER_DTYPE_PARTS
        raise typer.BadParameter("--from-profiles reads GEMM profiles only: pass --only gemm with it")
    from fo_tune.calibrate.calibration import load_calibration, save_calibration
    from fo_tune.calibrate.from_profiles import merge_profiles

    merged = merge_profiles(load_calibration(into), folder, dtype, sibling=sibling)
    save_calibration(merged, into)
    points = merged.gemm_dtypes[dtype]
    on = sorted({p.measured_on for p in points if p.measured_on})
    console.print(gemm_table(points, f"{dtype} GEMM from {escape(folder.name)}: best tile per shape"))
    where = f" (measured on {', '.join(on)}, a sibling GPU)" if on else ""
    console.print(
        f"[green]merged[/] {len(points)} {dtype} GEMM points{escape(where)} into {escape(str(into))}",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    """Add ``calibrate`` to the root app."""
    app.command("calibrate", help=HELP)(calibrate)
