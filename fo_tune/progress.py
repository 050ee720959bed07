"""The progress sink the long library calls report to (calibrate, search, bench).

    run_bench(request, reporter)      # reporter.stage("bench", 10); reporter.step("bench", "...")

The CLI passes ``fo_tune.cli.progress.ProgressReporter`` (rich progress bars, or log lines when the
output is not a terminal); library callers may pass nothing (``SilentReporter``).
"""

from __future__ import annotations

from typing import Protocol


class Reporter(Protocol):
    """``stage`` starts a named stage of ``total`` steps, ``step`` advances it; ``log=False``
    keeps a step out of a non-terminal log (the search's many trials)."""

    def stage(self, name: str, total: int) -> None: ...

    def step(self, name: str, detail: str = "", *, log: bool = True) -> None: ...


class SilentReporter:
    """A ``Reporter`` that shows nothing."""

    def stage(self, name: str, total: int) -> None:
        pass

    def step(self, name: str, detail: str = "", *, log: bool = True) -> None:
        pass
