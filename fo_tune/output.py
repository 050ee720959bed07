"""What the long library calls share for their output: the progress sink they report to
(calibrate, search, bench), and writing files and folders all or nothing.

    run_bench(request, reporter)      # reporter.stage("bench", 10); reporter.step("bench", "...")

The CLI passes ``fo_tune.cli.progress.ProgressReporter`` (rich progress bars, or log lines when the
output is not a terminal); library callers may pass nothing (``SilentReporter``). ``check_writable``
and ``check_writable_file`` are the checks a command runs before its work, so a bad ``--out`` costs
nothing, and ``refuse_foreign`` the one that keeps it from replacing another kind of file;
``replacing_folder`` builds a folder's new contents beside it and swaps them in whole;
``write_csv`` writes plain CSVs; ``whole`` keeps a whole setting whole in them and in YAML;
``figure`` and ``size_label`` serve every plot, ``count`` every "N ranks" a title says.
``data_dir`` is where a search writes what no option places (tables, studies, reports): the user
folder the runtime's tables live in, whatever the working folder.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from fo_kernels.errors import FoTuneError
from fo_kernels.table import user_table_dir


def data_dir() -> Path:
    """fo-tune's data folder, ``$XDG_DATA_HOME/fo-tune`` (``~/.local/share/fo-tune``): the user
    tables (``tables/``), the default study storage (``studies/``) and search reports
    (``search/``)."""
    return user_table_dir().parent


class OutputError(FoTuneError, ValueError):
    """An output path that cannot be written (or must not be replaced); the message says what to do."""


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_ancestor(path: Path, shown: Path) -> None:
    """The nearest existing folder above ``path`` must be a folder that takes new entries: its
    permissions allow it, and a probe folder made there (and removed at once) proves it, since
    root passes every permission check on file systems that refuse new entries (``/proc``, a
    read-only mount)."""
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise OutputError(f"cannot write {shown}: {base} is a file, not a folder; choose another path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {shown}: {base} is not writable; choose another path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fo-tune-probe-", dir=base))
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise OutputError(
            f"cannot write {shown}: {base} takes no new files ({why}); choose another path"
        ) from None


def check_writable(
    out_dir: str | Path,
    *,
    allowed: Sequence[str],
    what: str,
    writer: str = "fo-tune",
) -> None:
    """Raise ``OutputError`` unless an output folder can be created or replaced at ``out_dir``.

    ``out_dir`` may not exist yet (its nearest existing ancestor must be a writable folder); if it
    exists it must be a writable folder in a writable parent, holding only the ``allowed`` files
    ``writer`` writes there (so a mistyped ``--out`` never replaces someone's folder); ``what``
    names such a folder in the message.
    """
    shown = Path(out_dir)
    path = Path(os.path.abspath(out_dir))
    if Path.cwd() == path or path in Path.cwd().parents:
        raise OutputError(f"--out {shown} is the current folder or above it; give a folder below it")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise OutputError(f"--out {shown} is a file; give a folder (it is created if missing)")
        foreign = sorted(p.name for p in path.iterdir() if p.name not in allowed)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise OutputError(
                f"--out {shown} holds files {writer} did not write ({foreign[0]}{more}); "
                f"give a new or empty folder, or a previous {what} folder to replace"
            )
        for folder in (path.parent, path):
            if not os.access(folder, os.W_OK | os.X_OK):
                raise OutputError(f"cannot replace {shown}: {folder} is not writable; choose another --out")
    check_ancestor(path, shown)


def check_writable_file(path: str | Path, *, what: str = "--out") -> None:
    """Raise ``OutputError`` unless a file can be written (atomically) at ``path``; ``what`` names
    the file in the message (the option that gave it, or what it is)."""
    shown = Path(path)
    target = Path(os.path.abspath(path))
    if target.is_dir():
        raise OutputError(f"{what} {shown} is a folder; give a file name")
    check_ancestor(target, shown)


def refuse_foreign(path: Path, is_ours: Callable[[Path], bool], *, ours: str, named: str) -> None:
    """Raise ``OutputError`` where a file at ``path`` is not one the command writes (``is_ours``
    False: a table, a calibration, another command's CSV), which writing would destroy; ``ours``
    says what it would have to be, ``named`` shows the file ("--out PATH")."""
    if path.is_file() and not is_ours(path):
        raise OutputError(
            f"{named} exists and is not {ours}, so it is not replaced; give another file name, or "
            "move that file away"
        )


@contextlib.contextmanager
def made_parents(folder: Path) -> Iterator[None]:
    """Create ``folder`` and its missing ancestors; remove the ones created (if still empty) on error."""
    missing = []
    probe = Path(os.path.abspath(folder))
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for made in missing:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


@contextlib.contextmanager
def replacing_folder(out_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``out_dir`` (mode 755) to build its new contents in. Leaving the block
    normally swaps it in for ``out_dir`` as a whole (``swap_in``); on any error it is removed, and an
    existing ``out_dir`` and the parent folders are left as they were (``made_parents``)."""
    target = Path(os.path.abspath(out_dir))
    with made_parents(target.parent):
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)
            yield tmp
            swap_in(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def whole(value: float) -> float | int:
    """``value`` as an int where it is whole (``4.0`` -> ``4``): a setting a file records (YAML,
    CSV) reads 4, as the user gave it, not 4.0; any other value unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# -------------------------------------------------------------------------------------------- CSV
def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else format(value, ".6g")
    return value


def write_rows(f: Any, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """``header`` then ``rows`` as CSV lines to the open file ``f`` (floats in 6 significant digits,
    NaN as ``nan``, None empty)."""
    writer = csv.writer(f, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([_cell(v) for v in row] for row in rows)


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """``write_rows`` into a new file at ``path``."""
    with path.open("w", newline="", encoding="utf-8") as f:
        write_rows(f, header, rows)


# ------------------------------------------------------------------------------------------ plots
def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, the noun plural unless n is 1: "1 rank", "3 ranks", "2 GPUs"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def size_label(size: float, _pos: Any = None) -> str:
    """Bytes as ``4 KiB`` / ``256 MiB`` (also a matplotlib tick formatter)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            value = size / (1 << shift)
            return f"{value:g} {unit}"
    return f"{size:g} B"


def figure(nrows: int, ncols: int, width: float, height: float) -> tuple[Any, Any]:
    """A matplotlib figure (Agg, no display needed) and its ``nrows`` x ``ncols`` axes, each ``width`` x
    ``height`` inches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def swap_in(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out_dir``; an ``out_dir`` there is moved aside first, put back
    if the rename fails, and deleted after."""
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    aside = out_dir.parent / f".{out_dir.name}.old-{secrets.token_hex(4)}"
    os.rename(out_dir, aside)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(aside, out_dir)
        raise
    shutil.rmtree(aside, ignore_errors=True)


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
