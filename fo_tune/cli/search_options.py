"""``fo-tune search``'s help text and options (the command itself: ``fo_tune.cli.search``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fo_tune.cli.common import COLLECTIVE_NAMES, nonempty_path

MODE_NAMES = ("measure", "predict", "hybrid")

# Typer renders the help with Rich markup: a literal "[" is written "\\[" (else "[binary]"
# reads as a style tag and vanishes from the help).
HELP = "\n\n".join(
    [
        "Search schedules for GEMM + AllReduce / ReduceScatter and AllGather + GEMM shapes and write "
        "the best one per shape into the schedule table the runtime reads. A shape is the GEMM's "
        "M x N x K; for all_gather M is the gathered M (each rank holds an M/w x K shard of A), "
        "which, as for reduce_scatter, must be divisible by the world size.",
        "One search per shape over the union of the engines that can run on the machine "
        "(--engine to choose; each engine's plug-in says whether it can: the copy engine needs "
        "world size >= 2 and peer access between the GPUs): triton (the signalled Triton GEMM "
        "and NCCL per group: tile, SMs left to communication, NCCL CTA cap, signal granularity, "
        "grouping by the cost model's dynamic program or any composition, layout, wait mode; for "
        "all_gather NCCL gathers bands of A rows while the chunk GEMMs run: row_band, band units, "
        "no wait mode) and copy_engine (library GEMM chunks and copy-engine pulls between peers: "
        "the ring mode's chunk weightings, the tiled mode's chunks and tiles; all_gather: the ring "
        "mode only), as the search space's engines sections list them. No all_gather was measured "
        "on GPUs yet: its cost-model terms are unvalidated, and a predicted all_gather search needs "
        "a calibration with an all_gather bandwidth curve (the packaged H200 one has none: at "
        "--world-size 2 the error names the command that measures it; at 3-8 its extrapolation "
        "takes reduce_scatter's curve and its basis says so).",
        "-c moe plans the expert-parallel MoE FFN's table (its dispatch and combine All-to-All around "
        "the grouped GEMMs) for --experts H,I,E_local,k and/or --shapes suites/moe/experts.yaml, and "
        "--tokens buckets, from a calibration's model only (--mode predict; the measured modes need two"
        " or more GPUs and are not built for it). It records no study, so it takes no --storage, and "
        "the dense search's options (--shape, --m-range, --trials, --top-k, --time-budget, "
        "--exhaustive, --backend, --reps, --seed, --allow-slow) are refused with it: the table goes to "
        "<table dir>/<device key>/moe-w<W>-<dtype>.yaml, which every `fo-tune table` command reads, and"
        " the run's summary.yaml (what --json prints) to its own report folder, <report "
        "root>/moe-w<W>-<dtype>-predict/<run>/ as below; a Ctrl-C while they are written stops once "
        "both are.",
        "Modes: predict (the cost model of a calibration prices every enumerated point, "
        "bounded, no GPU: the default without GPUs, with the packaged calibration for "
        "--world-size, at 3-8 the packaged TP=2 one extrapolated to that many GPUs of one NVSwitch "
        "board, every row and the report stating that basis; with --trials N a TPE study of N "
        "predictions instead), measure (a TPE "
        "study over the union, every trial checked against matmul + collective on the ranks, "
        "then timed back to back; the max over ranks), hybrid (the model ranks the space, the "
        "--top-k best and every engine's best are measured; the default with GPUs when this "
        "machine has a calibration). --exhaustive enumerates every point (measure, predict). An "
        "option the search would not read is refused (exit 2): --top-k but with hybrid, --trials "
        "with hybrid or --exhaustive, --time-budget with predict unless --trials, and --reps, "
        "--confirm-rounds, --backend, --allow-slow with predict.",
        "A row overlaps only when its best schedule beats the overlap: false fallback (GEMM then "
        "the collective as the runtime runs it, replayed from its own CUDA graphs on GPUs) by more "
        "than the spread and at least 2%: measured searches re-time their best three and every "
        "engine's best beside the fallback in alternating rounds; a predict search compares the "
        "predicted best with the predicted fallback. Otherwise the row says overlap: false. "
        "M-range rows (--m-range LO:HI) cover every M of the range for the shapes' (N, K).",
        "Studies live in --storage (default SQLite at ~/.local/share/fo-tune/studies/fo-tune.db, "
        "under $XDG_DATA_HOME when set): running the same command again resumes them. Every "
        "mode records each decided row in its study there, so the workers of a fleet share one "
        "storage: journal:FILE or sqlite:///FILE on one machine, postgresql://USER@HOST:PORT/DB "
        "across hosts (fo-tune's postgres extra: pip install 'psycopg\\[binary]'), and `fo-tune "
        "table pull --storage URL` writes the tables from every study in it. The storage is opened "
        "before any work: a missing driver, a server that does not answer or the folder of an "
        "explicit SQLite or journal file that does not exist is exit 2.",
        "Tables go to --table-dir (default $FO_TUNE_TABLE_DIR, else $XDG_DATA_HOME/fo-tune/tables, "
        "by default ~/.local/share/fo-tune/tables), "
        "merged under a file lock; a predicted row never replaces a measured one (the runtime "
        "prefers measured rows in any folder anyway). The report (trials.csv, summary.yaml; "
        "measured searches also history.png, predicted_vs_measured.png) goes to a new folder for "
        "every run, ~/.local/share/fo-tune/search/<device-key>/<collective>-w<W>-<dtype>-<mode>/"
        "<UTC time>-<host>-<pid>/ (under $XDG_DATA_HOME when set; no run's report replaces "
        "another's). --out DIR puts all three "
        "under DIR (DIR/tables, DIR/studies/fo-tune.db, DIR/report/.../<run>/). --json prints the "
        "summary as JSON on stdout (progress on stderr).",
        "Ctrl-C keeps the rows of the shapes decided before it (each is merged as soon as decided; "
        "an --m-range search places its rows at its end) "
        "and writes their report, whose summary.yaml names the shapes not searched (stopped, "
        "not_done); the same command searches the rest. A Ctrl-C while a finished collective's "
        "report is written stops once it is.",
        "Exit code 0 when the rows are written, 1 when a measurement fails, 2 for bad input, 130 "
        "when interrupted.",
    ]
)

ShapesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--shape", "-s", metavar="MxNxK", help="GEMM problem M x N x K per rank; repeat for several."
    ),
]
ShapesFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--shapes",
        parser=nonempty_path,
        metavar="FILE",
        help="YAML with a `shapes:` list of [M, N, K] (e.g. suites/h200_tp.yaml); -c moe: an MoE suite's "
        "`models:` (suites/moe/experts.yaml), E / world size local experts each. Its dtype is the "
        "default for --dtype. Searched together with any --shape (-c moe: --experts) given.",
    ),
]
CollectiveOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--collective",
        "-c",
        metavar="NAME[,NAME]",
        help=f"{', '.join(COLLECTIVE_NAMES)}; repeat or comma-separate to tune several. Default: all_reduce. "
        "moe (alone): the expert-parallel MoE FFN, its dispatch and combine All-to-All around the grouped "
        "GEMMs, planned from a calibration (--mode predict) for --experts and --tokens.",
    ),
]
ExpertsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--experts",
        metavar="H,I,E_LOCAL,K",
        help="-c moe: the experts' shape (hidden, intermediate, local experts per rank, top_k); repeatable.",
    ),
]
TokensOpt = Annotated[
    str | None,
    typer.Option(
        "--tokens",
        metavar="T[,T...]",
        help="-c moe: the M buckets, ascending tokens per rank (a row covers the tokens above the bucket "
        "before it). Default: the MoE search space's tokens_per_rank.",
    ),
]
SearchDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        "-d",
        help="Operand dtype: bfloat16, float16, float32, float8_e4m3fn. Default: the --shapes file's "
        "dtype where it has one (a suite's), else bfloat16.",
    ),
]
ModeOpt = Annotated[
    str | None,
    typer.Option(
        "--mode",
        "-m",
        help="measure, predict or hybrid. Default: predict without GPUs; with GPUs hybrid when this "
        "machine has a calibration, else measure.",
    ),
]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        parser=nonempty_path,
        metavar="FILE",
        help="calibration.yaml of `fo-tune calibrate` for the model. Default: results/calibration/"
        "<device-key>/tp<N>/calibration.yaml here, else the packaged one (predict: the packaged H200 "
        "calibration for --world-size, at 3-8 the TP=2 one extrapolated; one of a smaller world size "
        "given here is extrapolated too).",
    ),
]
TrialsOpt = Annotated[
    int | None,
    typer.Option(
        "--trials",
        "-n",
        help="Trials per shape (a study's total, counting resumed ones): default 40 measure; "
        "predict: a TPE study of N predictions instead of pricing the enumerated space (not with "
        "hybrid or --exhaustive).",
    ),
]
TopKOpt = Annotated[
    int, typer.Option("--top-k", "-k", help="hybrid (only): the model's best schedules measured per shape.")
]
BudgetOpt = Annotated[
    float | None,
    typer.Option(
        "--time-budget",
        metavar="SECONDS",
        help="Stop searching after this long (all shapes; predict: with --trials).",
    ),
]
MRangeOpt = Annotated[
    str | None,
    typer.Option(
        "--m-range",
        metavar="LO:HI",
        help="Tune M = LO, the powers of two between and HI for each shape's (N, K), and write M-range "
        "rows covering LO..HI (only those: exact rows come from searching the exact shape); for "
        "reduce_scatter and all_gather each power of two rounded to a multiple of the world size.",
    ),
]
StorageOpt = Annotated[
    str | None,
    typer.Option(
        "--storage",
        metavar="URL",
        help="Optuna storage: sqlite:///FILE, journal:FILE (workers on one machine) or "
        "postgresql://USER@HOST:PORT/DB (workers on many hosts). Default: SQLite at "
        "~/.local/share/fo-tune/studies/fo-tune.db (DIR/studies/fo-tune.db with --out).",
    ),
]
ExhaustiveOpt = Annotated[bool, typer.Option("--exhaustive", help="Enumerate the space (measure, predict).")]
TableDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--table-dir",
        parser=nonempty_path,
        metavar="DIR",
        help="Root of the tables to merge rows into (see above for the default).",
    ),
]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "-o",
        parser=nonempty_path,
        metavar="DIR",
        help="Put tables (DIR/tables), studies and the report (DIR/report) here.",
    ),
]
AllowSlowOpt = Annotated[
    bool,
    typer.Option(
        "--allow-slow",
        help="measure / hybrid without GPUs: run shapes above 1024x1024x1024 (M*N*K) too: Triton's CPU "
        "interpreter takes hours for a GPU-sized shape, so they are refused otherwise.",
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print the summary as JSON on stdout (progress goes to stderr); stopped by Ctrl-C, "
        "the runs it finished and the stopped one (its stopped, not_done and report folder).",
    ),
]
RepsOpt = Annotated[int, typer.Option("--reps", "-r", help="Timed samples per measured trial (median).")]
ConfirmRoundsOpt = Annotated[
    int,
    typer.Option(
        "--confirm-rounds",
        help="measure / hybrid: rounds of the side-by-side re-timing that decides each row (its best "
        "schedules, the fallback and the sequential baseline, each timed once per round).",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Sampler and input seed.")]
EngineOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--engine",
        "-e",
        metavar="NAME[,NAME]",
        help="Engines to search (repeat or comma-separate): triton, copy_engine. Default: every "
        "engine that can run on the machine and has a section in the search space.",
    ),
]

# The dense search's options that some searches do not read (parameter name -> flag): given with
# such a search they are refused (``unread_option``) rather than dropped silently.
MODE_OPTIONS = {
    "top_k": "--top-k",
    "trials": "--trials",
    "time_budget": "--time-budget",
    "reps": "--reps",
    "confirm_rounds": "--confirm-rounds",
    "backend": "--backend",
    "allow_slow": "--allow-slow",
}


def unread_option(given: list[str], mode: str, mode_given: bool, exhaustive: bool) -> str | None:
    """The one-line error for the first of ``given`` (flags of ``MODE_OPTIONS`` the command line
    set) that a search of ``mode`` (``mode_given``: by --mode, else the default here) and
    ``exhaustive`` would not read, saying what to do; None when it reads them all.

    hybrid times the model's --top-k best (no TPE study: no --trials); measure, and predict with
    --trials, run TPE studies of --trials trials that --time-budget stops; --exhaustive runs every
    point (no --trials), and predict without --trials or with --exhaustive prices its points with
    no study (no --time-budget); predict times nothing on no ranks (no --reps, --confirm-rounds,
    --backend, --allow-slow)."""
    this = f"this search is --mode {mode}" + ("" if mode_given else " (the default here)")
    enumerated = mode == "predict" and (exhaustive or "--trials" not in given)
    for flag in given:
        if flag == "--top-k" and mode != "hybrid":
            return (
                f"--top-k applies to --mode hybrid (the model's best it times per shape); {this}: "
                "leave --top-k out, or pass --mode hybrid"
            )
        if flag == "--trials" and exhaustive:
            return "--trials sizes a TPE study, --exhaustive runs every point instead; give one of them"
        if flag == "--trials" and mode == "hybrid":
            return (
                f"--trials sizes the TPE studies of --mode measure and predict; {this}, which times the "
                "model's --top-k best: leave --trials out (--top-k K sets how many)"
            )
        if flag == "--time-budget" and enumerated:
            how = "--exhaustive" if exhaustive else "without --trials"
            return (
                f"--time-budget stops a study's trials; --mode predict {how} prices the space's points "
                "with no study, in seconds a shape: leave --time-budget out"
                + ("" if exhaustive else ", or give --trials N for a TPE study it stops")
            )
        if flag in ("--reps", "--confirm-rounds", "--backend", "--allow-slow") and mode == "predict":
            return (
                f"{flag} applies to the searches that time on ranks (--mode measure, hybrid); {this}, "
                f"which times nothing: leave {flag} out"
            )
    return None
