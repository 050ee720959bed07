"""Progress of the long commands (calibrate, search, bench): rich progress bars on a terminal, one
timestamped line per step otherwise; ``ProgressReporter`` is the ``fo_tune.output.Reporter``
the library calls report to; ``status`` a step without a count (profile's)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from fo_tune.cli.common import err_console


def progress_bars(enabled: bool = True, to: Console = err_console) -> Progress:
    """The bars of one command (``enabled=False`` on a serving torchrun rank), on ``to``: stderr,
    so that stdout carries the command's results alone (its tables, its JSON) when piped."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=to,
        disable=not enabled,
    )


class ProgressReporter:
    """``fo_tune.output.Reporter`` over rich progress bars: one bar per stage.

    A first bar (no total) covers starting the ranks; it completes when the first stage begins.
    ``step`` advances its stage's bar and shows what was just measured. When the console is not a
    terminal (a log file, CI), where bars appear only at the end, each step is also printed as a line.
    """

    def __init__(self, progress: Progress, starting: str) -> None:
        self._progress = progress
        self._tasks: dict[str, TaskID] = {}
        self._left: dict[str, int] = {}
        self._log = not progress.disable and not progress.console.is_terminal
        self._t0 = time.monotonic()
        self._starting: TaskID | None = progress.add_task(starting, total=None)
        self._line(starting)

    def _line(self, text: str) -> None:
        if self._log:
            self._progress.console.print(
                f"[{time.monotonic() - self._t0:6.1f} s] {text}", markup=False, highlight=False
            )

    def stage(self, name: str, total: int) -> None:
        if self._starting is not None:
            self._progress.update(self._starting, total=1, completed=1)
            self._starting = None
        self._tasks[name] = self._progress.add_task(name, total=total)
        self._left[name] = total
        self._line(f"{name}: {total} step{'' if total == 1 else 's'}")

    def step(self, name: str, detail: str = "", *, log: bool = True) -> None:
        """Advance ``name``'s bar; ``log=False`` keeps the step out of the non-terminal log."""
        if name not in self._tasks:
            self.stage(name, 0)
        self._left[name] -= 1
        done = self._left[name] <= 0  # a finished bar just names its stage
        text = f"{name}: {detail}" if detail and not done else name
        self._progress.update(self._tasks[name], advance=1, description=text)
        if log:
            self._line(f"{name}: {detail or 'step'} done")


@contextlib.contextmanager
def status(what: str) -> Iterator[None]:
    """One long step without a count: a spinner on a terminal; elsewhere (a log file, CI) ``what``
    as one stderr line, where a spinner shows nothing for the minutes the step may take."""
    if err_console.is_terminal:
        with err_console.status(what, spinner="dots"):
            yield
    else:
        err_console.print(what, markup=False, highlight=False)
        yield
