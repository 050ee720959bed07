"""What every ``fo-tune`` command shares: the console, the option types and the error mapping.

All output goes through ``console`` (stdout) and ``err_console`` (stderr). Commands wrap their body in
``run_cli`` (or decorate it with ``handle_errors``), which turns an expected error into one line on
stderr and an exit code:

    bad input (a FoTuneError that is a ValueError or FileNotFoundError, an EnvironmentMismatchError,
    a typer.BadParameter raised by the command)                          -> "error: ...", exit 2
    a failure at run time (any other FoTuneError, e.g. LaunchError)      -> "error: ...", exit 1
    an unexpected exception (a bug)                                      -> "error: internal ...", exit 1
    Ctrl-C                                                               -> "error: interrupted", exit 130

With ``FO_TUNE_DEBUG=1`` the traceback is printed instead of the one line (same exit code). The
runtime's error classes are imported only when an error is mapped, so ``fo-tune --help`` stays light.
"""

import functools
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

T = TypeVar("T")

console = Console()
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

DEBUG_ENV = "FO_TUNE_DEBUG"
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

DTYPE_NAMES = ("float32", "float16", "bfloat16")
BACKEND_NAMES = ("auto", "gloo", "nccl")

# ------------------------------------------------------------------------------ shared options
WorldSizeOpt = Annotated[
    int, typer.Option("--world-size", "-w", help="Number of local processes (ranks); one GPU each with NCCL.")
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
        help=f"Operand dtype: {', '.join(DTYPE_NAMES)}. Default: float32 on the CPU, bfloat16 on GPUs.",
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
    float, typer.Option("--timeout", help="Seconds before a hung or slow run is stopped (all ranks).")
]

_SHAPE = re.compile(r"^\s*(\d+)\s*[xX*,]\s*(\d+)\s*[xX*,]\s*(\d+)\s*$")


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


def parse_collectives(
    values: list[str] | None, *, valid: tuple[str, ...], default: tuple[str, ...], option: str
) -> tuple[str, ...]:
    """Names given to ``option``, repeated or comma-separated, in order, each once (``default`` when
    none is given); a name not in ``valid``, or only separators, raises ``typer.BadParameter``."""
    if not values:
        return default
    names = [part.strip() for value in values for part in value.split(",") if part.strip()]
    for name in names:
        if name not in valid:
            raise typer.BadParameter(f"{option}: unknown collective {name!r}; choose from {', '.join(valid)}")
    if not names:
        raise typer.BadParameter(f"{option}: no name given; choose from {', '.join(valid)}")
    return tuple(dict.fromkeys(names))


# ------------------------------------------------------------------------------ error mapping
def _exit_code_for(exc: BaseException) -> int | None:
    """The one map from exception type to exit code; None for an unexpected exception."""
    if isinstance(exc, typer.BadParameter):
        return EXIT_BAD_INPUT
    from fo_kernels.errors import EnvironmentMismatchError, FoTuneError

    if not isinstance(exc, FoTuneError):
        return None
    if isinstance(exc, (ValueError, FileNotFoundError, EnvironmentMismatchError)):
        return EXIT_BAD_INPUT
    return EXIT_FAILED


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line: its first line, and the last line of a multi-line message
    (a rank's traceback ends with the exception that failed it)."""
    text = exc.message if isinstance(exc, typer.BadParameter) else str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) == 1:
        return lines[0]
    return f"{lines[0].rstrip(':')}: {lines[-1]} (set {DEBUG_ENV}=1 for the full message)"


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _report(exc: BaseException, message: str) -> None:
    if _debug():
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    else:
        err_console.print(f"error: {message}", markup=False)


def run_cli(fn: Callable[[], T]) -> T:
    """Call ``fn()``; map an error to one line on stderr and ``typer.Exit`` (see the module docstring)."""
    try:
        return fn()
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt as exc:
        _report(exc, "interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as exc:
        code = _exit_code_for(exc)
        if code is None:
            _report(
                exc,
                f"internal error: {type(exc).__name__}: {one_line(exc)} "
                f"(set {DEBUG_ENV}=1 for the traceback; please report it)",
            )
            raise typer.Exit(EXIT_FAILED) from None
        _report(exc, one_line(exc))
        raise typer.Exit(code) from None


def handle_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator form of ``run_cli`` for a typer command function (keeps its signature)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return run_cli(lambda: fn(*args, **kwargs))

    return wrapper
