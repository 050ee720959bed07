"""The error mapping of every ``fo-tune`` command: an expected error as one line on stderr and an exit
code, for the commands' bodies and for click's own parsing.

Commands wrap their body in ``run_cli`` (or decorate it with ``handle_errors``), which turns an
expected error into one line on stderr and an exit code:

    bad input (a FoTuneError that is a ValueError or FileNotFoundError, an EnvironmentMismatchError,
    a typer.BadParameter raised by the command)                          -> "error: ...", exit 2
    a failure at run time (any other FoTuneError, e.g. LaunchError)      -> "error: ...", exit 1
    an unexpected exception (a bug)                                      -> "error: internal ...", exit 1
    Ctrl-C                                                               -> "error: interrupted", exit 130
    stdout's reader gone (``fo-tune table list --json | head -1``)       -> nothing more, exit 1

With ``FO_TUNE_DEBUG=1`` the traceback is printed instead of the one line (same exit code). The root
command's group (``OneLineErrorsGroup``) words click's usage errors the same way; ``finishing``
keeps a Ctrl-C from cutting the write of a finished run's files.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import typer
from typer.core import TyperGroup

from fo_tune.cli.common import err_console

T = TypeVar("T")

DEBUG_ENV = "FO_TUNE_DEBUG"
# Exit codes: 2 for input the user can fix (click's own usage errors use it too), 1 for a failure
# at run time, 130 (128 + SIGINT, the shells' convention) for a run Ctrl-C stopped.
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
# The class name of click's error for a group called without a command (its help is the output).
NO_ARGS_IS_HELP = "NoArgsIsHelpError"
# click's base of the errors it finds while parsing, from the click typer raises them with (recent
# typer ships its own copy of click; older ones use click itself).
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


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
    return one_line_text(exc.message if isinstance(exc, typer.BadParameter) else str(exc), type(exc).__name__)


def one_line_text(text: str, empty: str = "bad usage") -> str:
    """``text`` on one line, as ``one_line`` words an exception's message; ``empty`` when blank."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return empty
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


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reading end is closed (``head`` has read its
    lines): polling its write end reports an error then."""
    if not hasattr(select, "poll"):  # (Windows: no poll; such a pipe reads as another one's)
        return False
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # (no file descriptor: a test's buffer)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _stdout_to_devnull() -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's last flush of what stdout still
    buffers writes nowhere instead of raising a second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run_cli(fn: Callable[[], T]) -> T:
    """Call ``fn()``; map an error to one line on stderr and ``typer.Exit`` (see the module docstring)."""
    try:
        return fn()
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt as exc:
        _report(exc, "interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except BrokenPipeError as exc:
        if not _stdout_reader_gone():  # (another pipe, a rank's: a failure to report)
            _report_unexpected(exc)
        # the reader took what it wanted: stop as rich's console stops on a closed stdout (exit 1,
        # no message), the command's other output (a table, --help) included
        _stdout_to_devnull()
        raise typer.Exit(EXIT_FAILED) from None
    except Exception as exc:
        code = _exit_code_for(exc)
        if code is None:
            _report_unexpected(exc)
        _report(exc, one_line(exc))
        raise typer.Exit(code) from None


def _report_unexpected(exc: BaseException) -> NoReturn:
    """Report ``exc``, a bug, as an internal error and exit 1 (``typer.Exit``)."""
    _report(
        exc,
        f"internal error: {type(exc).__name__}: {one_line(exc)} "
        f"(set {DEBUG_ENV}=1 for the traceback; please report it)",
    )
    raise typer.Exit(EXIT_FAILED) from None


class OneLineErrorsGroup(TyperGroup):
    """The root command's group: a usage error click finds while parsing (an unknown option, a
    missing argument, a value of the wrong type) ends, as every other user error does, with one
    ``error: ...`` line on stderr naming the ``--help`` that explains, and exit 2, instead of
    typer's usage line, hint and framed panel. Parsing runs in click's non-standalone mode so the
    error reaches this method; the exit codes of the commands (``typer.Exit``) pass through."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except ClickException as exc:
            if type(exc).__name__ == NO_ARGS_IS_HELP:  # the help was printed as it was raised
                sys.exit(exc.exit_code)
            ctx = getattr(exc, "ctx", None)
            # (no context: an option missing its value, which click raises without one)
            given = kwargs.get("args", args[0] if args else None)
            path = ctx.command_path if ctx is not None else self._command_path(given)
            where = f" (`{path} --help` explains the options)"
            _report(exc, f"{one_line_text(exc.format_message())}{where}")
            sys.exit(exc.exit_code)
        except typer.Abort:
            _report(KeyboardInterrupt(), "interrupted")
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(code if isinstance(code, int) else 0)

    def _command_path(self, given: Sequence[str] | None) -> str:
        """The command the command line (``given``, else this process's) names, read off its
        leading words (``fo-tune table lookup``): the ``--help`` to name where click's error
        carries no context; ``fo-tune COMMAND`` where no command is named."""
        words = given if given is not None else sys.argv[1:]
        path, command = ["fo-tune"], self
        for word in words:
            command = getattr(command, "commands", {}).get(word)
            if command is None:
                break
            path.append(word)
        return " ".join(path) if len(path) > 1 else "fo-tune COMMAND"


@contextlib.contextmanager
def finishing(kept: str) -> Iterator[None]:
    """The write of what a finished run measured, out of a Ctrl-C's reach: a Ctrl-C meanwhile is
    held until the files are written, then stops the command (``error: interrupted``, exit 130)
    after the line ``kept`` (where they are) on stderr. Cut short, the write would leave nothing
    of a run that had finished (it writes all or nothing)."""
    from fo_tune.ranks.interrupt import sigint_deferred

    try:
        with sigint_deferred():
            yield
    except KeyboardInterrupt:
        err_console.print(kept, markup=False, highlight=False)
        raise


def handle_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator form of ``run_cli`` for a typer command function (keeps its signature)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return run_cli(lambda: fn(*args, **kwargs))

    return wrapper
