"""What every ``fo-tune`` command shares: the console, the option types, the checks made before any
rank starts (shape, dtype, backend, search space), the Triton mode of the ranks, the summary tables
and the JSON output. The error mapping is ``fo_tune.cli.errors``.

All output goes through ``console`` (stdout) and ``err_console`` (stderr). Written to a terminal
they wrap at its width; written to a file or a pipe (a log, CI) a line is never cut or wrapped, so
a table keeps every number whole (``FILE_WIDTH``). torch, the runtime and the tuner are imported
inside the functions that need them, so ``fo-tune --help`` stays light; that is also why the dtype,
collective and fp8 scaling names the help texts list are written here (a test checks them against
``fo_kernels.schedule`` and ``fo_tune.ranks.scaled``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import stat
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.rich_utils
from rich import box
from rich.console import Console, ConsoleDimensions
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    import torch

    from fo_tune.space import SearchSpace


# The line width of output that is not a terminal: wide enough that no table row is cut (Rich's
# default there is 80 columns, which cut numbers to "0.3…" in saved logs).
FILE_WIDTH = 1000


class _Console(Console):
    """A rich ``Console`` that takes ``FILE_WIDTH`` columns whenever its output is not a terminal
    (decided at every print: the CLI's tests swap stdout after import; ``COLUMNS`` is ignored
    there, since CI systems set it to 80)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(FILE_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


# emoji=False: Rich would print an echoed ":100:" (--m-range 100:100) or any ":name:" as an emoji
console = _Console(emoji=False)
err_console = _Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


# fo_kernels.schedule.DTYPES and COLLECTIVES, for the help texts (see the module docstring): the
# runtime's collectives are what `fo-tune bench` and `fo-tune demo` run.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float8_e4m3fn")
# fo_tune.ranks.scaled.SCALINGS, for the same reason: the fp8 scalings `fo-tune profile` measures,
# the tuner's (TUNE_SCALING) first.
SCALING_NAMES = ("rowwise", "tensorwise")
# fo_tune.bench.demo.TOL's keys: the dtypes `fo-tune demo` checks (fp8 with rowwise scales).
DEMO_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float8_e4m3fn")
RUNTIME_COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter", "all_gather")
# The collectives `fo-tune search` and `fo-tune table` take: every one the runtime runs.
COLLECTIVE_NAMES = RUNTIME_COLLECTIVE_NAMES
# Those whose M is split over the ranks (fo_kernels.schedule.SHARDED_COLLECTIVES; M divisible by
# the world size; all_gather's M is the gathered M).
SHARDED_COLLECTIVE_NAMES = ("reduce_scatter", "all_gather")
BACKEND_NAMES = ("auto", "gloo", "nccl")
# fo_tune.ranks.backend.MAX_CPU_WORLD_SIZE, for the help texts: the most ranks a run without GPUs
# starts (gloo processes, or the copy engine's thread-ranks).
CPU_WORLD_SIZE_LIMIT = 16

# ------------------------------------------------------------------------------ shared options
WorldSizeOpt = Annotated[
    int,
    typer.Option(
        "--world-size",
        "-w",
        help="Number of local processes (ranks); one GPU each with NCCL, at most "
        f"{CPU_WORLD_SIZE_LIMIT} on the CPU (gloo).",
    ),
]
ShapesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--shape",
        "-s",
        metavar="MxNxK",
        help="GEMM problem M x N x K (A is MxK per rank, B is KxN); repeat for several. "
        "Default: a small set on the CPU, benchmark-suite shapes on GPUs.",
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        "-d",
        help=f"Operand dtype: {', '.join(DEMO_DTYPE_NAMES)} (fp8: rowwise scales, a bfloat16 output; N "
        "and K multiples of 16). Default: float32 on the CPU, bfloat16 on GPUs.",
    ),
]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        "-b",
        help="Process-group backend: auto (nccl with one GPU per rank; gloo on the CPU when no GPU "
        "is visible), gloo or nccl.",
    ),
]
RepsOpt = Annotated[
    int, typer.Option("--reps", "-r", help="Timed calls per op (median reported), after 2 warm-ups.")
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds before a hung or slow run of rank processes is stopped (all ranks). --engine "
        "copy_engine starts no processes: its thread-ranks fail any wait of more than the CPU "
        "executor's bound (CpuOptions.timeout_s, 10 s), and its virtual ranks on one GPU run unbounded.",
    ),
]


def nonempty_path(text: str | Path) -> Path:
    """A path option's parser refusing an empty one (the working folder, which an unset ``--out
    "$DIR"`` would use) and a device, pipe or socket (/dev/zero read until killed; a pipe hangs)."""
    if not str(text).strip():
        raise typer.BadParameter("is empty; give a path (. for the working folder)")
    with contextlib.suppress(OSError):  # (a path that does not exist yet: the command says)
        if not stat.S_ISREG(mode := Path(text).stat().st_mode) and not stat.S_ISDIR(mode):
            raise typer.BadParameter(f"{text} is a device, a pipe or a socket; give a file or a folder")
    return Path(text)


SpaceOpt = Annotated[
    Path | None,
    typer.Option(
        "--space",
        metavar="FILE",
        parser=nonempty_path,
        help="Search space YAML. Default: the file of search_spaces/ for this GPU's compute "
        "capability (default.yaml's cpu section on the CPU).",
    ),
]

_SHAPE = re.compile(r"^\s*(\d+)\s*[xX*,]\s*(\d+)\s*[xX*,]\s*(\d+)\s*$", re.ASCII)  # (0-9, not "٤")


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"MxNxK"`` -> ``(M, N, K)``; raises ``typer.BadParameter`` unless all three are integers >= 1."""
    match = _SHAPE.match(text)
    if match is None:
        raise typer.BadParameter(
            f"--shape {text!r}: expected MxNxK with positive integers, e.g. 4096x8192x4096"
        )
    m, n, k = (int(g) for g in match.groups())
    if min(m, n, k) < 1:
        raise typer.BadParameter(f"--shape {text!r}: M, N and K must all be >= 1")
    return m, n, k


def parse_names(
    values: list[str] | None, *, valid: tuple[str, ...], option: str, what: str = "name"
) -> tuple[str, ...] | None:
    """Names given to ``option``, repeated or comma-separated, in order, each once (None when none
    is given); a name not in ``valid``, or only separators, raises ``typer.BadParameter``."""
    if not values:
        return None
    names = [part.strip() for value in values for part in value.split(",") if part.strip()]
    for name in names:
        if name not in valid:
            raise typer.BadParameter(f"{option} {name!r} is not one of {', '.join(valid)}")
    if not names:
        raise typer.BadParameter(f"{option}: no {what} given; choose from {', '.join(valid)}")
    return tuple(dict.fromkeys(names))


def parse_collectives(
    values: list[str] | None, *, valid: tuple[str, ...], default: tuple[str, ...], option: str
) -> tuple[str, ...]:
    """Collective names given to ``option`` (``parse_names``), ``default`` when none is given."""
    return parse_names(values, valid=valid, option=option) or default


def check_dtype(dtype: str) -> str:
    """``dtype`` when it is one of ``DTYPE_NAMES``, else ``typer.BadParameter`` naming --dtype."""
    if dtype not in DTYPE_NAMES:
        raise typer.BadParameter(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    return dtype


# ------------------------------------------------------------------------------ before the ranks
def resolve_backend(world_size: int, backend: str) -> str:
    """``nccl`` or ``gloo`` for ``world_size`` ranks, checked before anything is spawned: the option
    values here, then ``fo_tune.ranks.backend.choose_backend`` (``auto``: gloo without GPUs, NCCL with
    one GPU per rank, too few GPUs an error). Under torchrun the world size must match its ranks.
    """
    if backend not in BACKEND_NAMES:
        raise typer.BadParameter(f"--backend {backend!r} is not one of {', '.join(BACKEND_NAMES)}")
    if world_size < 1:
        raise typer.BadParameter(f"--world-size must be >= 1, got {world_size}")
    from fo_tune.ranks.backend import choose_backend, in_torchrun

    if in_torchrun() and int(os.environ["WORLD_SIZE"]) != world_size:
        ranks = os.environ["WORLD_SIZE"]
        raise typer.BadParameter(
            f"--world-size {world_size}, but torchrun started {ranks} ranks; pass {ranks}"
        )
    return choose_backend(world_size, backend)


def is_driver_process() -> bool:
    """False on a torchrun rank other than 0 (it serves rank 0's tasks and prints nothing)."""
    from fo_tune.ranks.backend import in_torchrun

    return not in_torchrun() or os.environ.get("RANK") == "0"


@contextlib.contextmanager
def triton_mode(backend: str) -> Iterator[None]:
    """TRITON_INTERPRET for the ranks: 1 on gloo, 0 on NCCL; restored afterwards.

    Spawned ranks inherit it; under torchrun this process is a rank, so enter this before anything
    defines ``fo_kernels``' kernels (Triton builds them for the interpreter or not then; importing
    ``fo_kernels`` or its error types defines none).
    """
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0" if backend == "nccl" else "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def local_device(backend: str) -> torch.device:
    """The device rank 0 will measure on (for the space and the default output path)."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def resolve_space(path: Path | None, backend: str) -> SearchSpace:
    """``--space`` loaded and validated, else the packaged space for this device."""
    from fo_tune.space import load_space, space_for

    if path is not None:
        return load_space(path)
    device = local_device(backend)
    if device.type != "cuda":
        return space_for("cpu")
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return space_for(f"{major}.{minor}")


def expected_device_key(backend: str, world_size: int) -> str:
    """The device key the ranks will report (the same probe, run here)."""
    from fo_kernels.fingerprint import current_fingerprint

    return current_fingerprint(local_device(backend), world_size).device_key


# ------------------------------------------------------------------------------ summary tables
def fmt(x: float, spec: str = ".3g") -> str:
    """``x`` formatted with ``spec``; ``-`` for NaN. A ``g`` spec keeps its trailing zeros (0.500,
    1.00, 2.60: a column's numbers all show their significant digits, not 0.5 beside 0.657) but no
    bare trailing point (292, not 292.)."""
    if math.isnan(x):
        return "-"
    if spec.endswith("g") and "#" not in spec:
        text = format(x, "#" + spec)
        return text[:-1] if text.endswith(".") else text
    return format(x, spec)


class _SummaryTable(Table):
    """A ``Table`` whose title and caption, printed to a file or a pipe, stay whole on one line
    each: rich wraps them at the table's width, a narrow table's title word by word or letter by
    letter, which breaks the promise above that such output is never wrapped. On a terminal they
    wrap as rich wraps them."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("title", "caption") and isinstance(value, str) and not console.is_terminal:
            text = Text.from_markup(value, style=f"table.{name}")
            text.no_wrap, text.overflow = True, "ignore"
            value = text
        super().__setattr__(name, value)


def summary_table(title: str, columns: list[str], right_from: int, *, text: Collection[str] = ()) -> Table:
    """A borderless table with ``columns``: the ones from ``right_from`` on (numbers) right-aligned,
    the others and those named in ``text`` (text among the numbers: a folder, a tile) left-aligned."""
    table = _SummaryTable(
        title=title,
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )
    for i, name in enumerate(columns):
        right = i >= right_from and name not in text
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    return table


# ------------------------------------------------------------------------------ JSON output
def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as null (JSON has no NaN) and tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def json_text(data: Any) -> str:
    """``data`` as the JSON a command's ``--json`` prints (strict JSON: NaN as null)."""
    import json

    return json.dumps(_json_safe(data), indent=2, allow_nan=False, default=str)


def _folding(make_text: Callable[..., Any]) -> Callable[..., Any]:
    """typer's maker of an option's help text, its words longer than the help column folded onto
    the next line: cut to the column with "…" (rich's table default), a default path in --help
    at 80 columns lost its end (results/calibration/<device-key>/t…), where the output goes."""

    @functools.wraps(make_text)
    def make(*args: Any, **kwargs: Any) -> Any:
        text = make_text(*args, **kwargs)
        if isinstance(text, Text):
            text.overflow = "fold"
        return text

    return make


if hasattr(typer.rich_utils, "_make_rich_text"):  # (a private name: a typer without it keeps its own)
    typer.rich_utils._make_rich_text = _folding(typer.rich_utils._make_rich_text)
