"""Where the search's Optuna studies live: the ``--storage`` URL checked, resolved and opened.

- ``""``: SQLite at ``default_storage_file()`` (``<fo-tune data folder>/studies/fo-tune.db``);
- ``journal:PATH`` (or a path ending in ``.log`` / ``.jsonl``): Optuna's journal file, which
  several workers on one machine can share;
- ``sqlite:///FILE``: one file, many studies, one machine;
- ``postgresql://USER@HOST:PORT/DB``: the server a fleet of workers on many hosts shares (Debian's
  ``postgresql`` package; the driver is psycopg, the ``postgres`` extra: a plain ``postgresql://``
  URL takes psycopg 3 where psycopg2 is not installed); any other SQLAlchemy URL works the same.

``open_storage`` checks, before a search does any work, everything a study needs: the URL's form,
its driver, that the server answers (within ``CONNECT_TIMEOUT_S``), that a SQLite or journal URL
names a file (not a folder, not SQLite's in-memory database, which the study would not outlive),
that the folder of an explicit one exists (an explicit path's folder is never created: a typo would
start an empty storage beside the real one; the default's folder is), that a journal file holds
Optuna's records and that a SQLite file to read holds Optuna's tables (it is left unchanged).
Every failure is one ``StorageError`` line with the password left out. RDB storages get
heartbeats, so a trial whose process was killed is failed after ``GRACE_S`` instead of staying
RUNNING forever.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fo_kernels.errors import FoTuneError, install_hint
from fo_tune.output import data_dir

# Seconds between heartbeats of a running trial in an RDB storage, and after how long without one
# it counts as dead (failed) so a resumed search does not wait for it (Optuna's heartbeat).
HEARTBEAT_S = 10
GRACE_S = 60
# Seconds a PostgreSQL connection attempt may take before the server counts as not answering
# (libpq's connect_timeout): a LAN server answers in milliseconds, a dropped packet never does.
CONNECT_TIMEOUT_S = 10
# Attempts at opening a new RDB storage: workers starting together on an empty database race to
# create Optuna's tables, and the losers' CREATE fails once (they then find the tables made).
OPEN_ATTEMPTS = 3
# Seconds between those attempts.
OPEN_RETRY_S = 0.5
# Bytes read from the end of a journal file to check its last record (a record is one line of
# a few hundred bytes; a longer last line is left to Optuna's reader).
JOURNAL_TAIL_BYTES = 1 << 16
SQLITE = "sqlite:///"
JOURNAL = "journal:"
POSTGRES_SCHEMES = ("postgresql", "postgres")
# The database of a SQLite URL that is no file (``sqlite://``, ``sqlite:///:memory:``): SQLite keeps
# it in memory, so the studies, and the rows recorded in them, are gone when the process ends.
IN_MEMORY = ("", ":memory:")
NO_FILE = "names no file (an in-memory database would lose the study); give sqlite:///FILE"
# The table every Optuna RDB storage has (its studies), which a SQLite file to read must hold.
OPTUNA_STUDIES_TABLE = "studies"
# What to install for a PostgreSQL storage (pyproject's extra).
POSTGRES_EXTRA = "install " + install_hint("postgres")


class StorageError(FoTuneError, ValueError):
    """A ``--storage`` that cannot be opened; the message says what to do."""


def default_storage_file() -> Path:
    """The study storage without ``--storage``: ``<fo-tune data folder>/studies/fo-tune.db``."""
    return data_dir() / "studies" / "fo-tune.db"


def storage_url(url: str) -> str:
    """``url``, or for ``""`` the default storage's SQLite URL."""
    return url or f"{SQLITE}{default_storage_file()}"


def journal_path(url: str) -> str | None:
    """The file of a journal storage URL, else None."""
    if url.startswith(JOURNAL):
        return url[len(JOURNAL) :]
    if url.endswith((".log", ".jsonl")) and "://" not in url:
        return url
    return None


def sqlite_path(url: str) -> str | None:
    """The file of a ``sqlite:///FILE`` storage URL (its query left out), else None."""
    return url[len(SQLITE) :].split("?")[0] if url.startswith(SQLITE) else None


def shown(url: str) -> str:
    """``url`` as errors and reports show it: the password left out."""
    if "://" not in url or url.startswith(SQLITE):
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # a URL SQLAlchemy cannot parse has no password it could find either
        return url


def _resolve_driver(url: str) -> str:
    """A plain ``postgresql://`` URL with the driver that is installed: psycopg2 (SQLAlchemy's
    default), else psycopg 3; ``StorageError`` when neither is."""
    scheme, sep, rest = url.partition("://")
    if scheme not in POSTGRES_SCHEMES:
        return url
    if importlib.util.find_spec("psycopg2") is not None:
        return url
    if importlib.util.find_spec("psycopg") is not None:
        return f"postgresql+psycopg{sep}{rest}"
    raise StorageError(f"--storage {shown(url)}: no PostgreSQL driver is installed; {POSTGRES_EXTRA}")


def check_storage_url(url: str) -> None:
    """Refuse, without opening anything, a ``--storage`` whose form ``open_storage`` cannot take."""
    if not url:
        return
    journal = journal_path(url)
    if journal is not None:
        if not journal.strip():
            raise StorageError(f"--storage {url!r} names no file; give journal:FILE")
        return
    if "://" not in url:
        raise StorageError(
            f"--storage {url!r}: expected an Optuna URL (sqlite:///FILE, postgresql://...) or journal:FILE"
        )
    sqlite = sqlite_path(url)
    if sqlite is not None:
        if sqlite.strip() in IN_MEMORY:
            raise StorageError(f"--storage {url!r} {NO_FILE}")
        return  # a file path: nothing for SQLAlchemy to parse (and its import takes ~0.5 s)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StorageError(f"--storage {url!r}: {str(exc).splitlines()[0]}") from None
    if parsed.get_backend_name() == "sqlite" and (parsed.database or "").strip() in IN_MEMORY:
        raise StorageError(f"--storage {url!r} {NO_FILE}")  # (a SQLite URL has no password)


def _check_folder(path: str, url: str, *, create_folder: bool, must_exist: bool) -> None:
    file = Path(path).expanduser()
    if file.is_dir():
        raise StorageError(f"--storage {url}: {file} is a folder; give the storage's file")
    if must_exist and not file.is_file():
        raise StorageError(f"--storage {url}: {file} does not exist; give the storage the workers used")
    if create_folder:
        file.parent.mkdir(parents=True, exist_ok=True)
    elif not file.parent.is_dir():
        raise StorageError(
            f"--storage {url}: the folder {file.parent} does not exist; create it, or fix the path"
        )


def _check_sqlite_storage(path: str, url: str) -> None:
    """A SQLite file to read (``must_exist``) holds Optuna's tables, looked at read-only: opening
    one without them would create them in it, in an empty file or another program's database.
    (Optuna creates its tables whenever it opens a file, so a file without them held no study.)"""
    import sqlite3

    file = Path(path).expanduser().resolve()
    try:
        with contextlib.closing(sqlite3.connect(f"{file.as_uri()}?mode=ro", uri=True)) as db:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        raise StorageError(
            f"--storage {url}: {file} is not a SQLite database ({exc}); give the storage the workers used"
        ) from None
    if OPTUNA_STUDIES_TABLE not in tables:
        what = (
            "an empty file"
            if not tables
            else f"a SQLite database without Optuna's tables ({len(tables)} others)"
        )
        raise StorageError(
            f"--storage {url}: {file} is {what}, no study storage; give the storage the workers used"
        )


def _rdb(url: str) -> Any:
    """An ``RDBStorage`` for ``url`` with heartbeats (and a connect timeout for PostgreSQL),
    retried while workers race to create its tables (``OPEN_ATTEMPTS``)."""
    import optuna
    from optuna.storages import RDBStorage
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    kwargs: dict[str, Any] = {}
    if url.split("://")[0].split("+")[0] in POSTGRES_SCHEMES:
        kwargs["engine_kwargs"] = {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    for attempt in range(OPEN_ATTEMPTS):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 4-5
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, **kwargs)
        except (IntegrityError, ProgrammingError, OperationalError) as exc:
            racing = isinstance(exc, (IntegrityError, ProgrammingError)) or "already exists" in str(exc)
            if not racing or attempt == OPEN_ATTEMPTS - 1:
                raise
            time.sleep(OPEN_RETRY_S)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _check_journal_tail(file: Path) -> None:
    """The last whole line of the journal ``file`` (one ending in a newline) is a JSON object, as
    Optuna writes its records. Optuna's own reader refuses a bad line followed by others (the
    storage's replay raises as it opens) but passes a bad last line, taken for a record another
    worker is still writing; a search would then append its records after it, into a file that is
    not a journal. A last line without its newline is such a record in progress, and passes."""
    if not file.is_file():
        return
    with file.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - JOURNAL_TAIL_BYTES))
        tail = f.read()
    whole = tail.split(b"\n")[:-1]  # (the last part ends no line)
    if size > JOURNAL_TAIL_BYTES:
        whole = whole[1:]  # the first part may be the end of a longer line
    if not whole:
        return
    try:
        record = json.loads(whole[-1])
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"its last line: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"its last line is a JSON {type(record).__name__}, not a record")


def _journal(path: str, url: str) -> Any:
    """The ``JournalStorage`` of the file at ``path``; ``StorageError`` when the file holds
    something other than Optuna's journal (its last record is checked, and the storage replays
    every record as it opens)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    file = Path(path).expanduser()
    try:
        _check_journal_tail(file)
        return JournalStorage(JournalFileBackend(str(file)))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # a record not Optuna's
        raise StorageError(
            f"--storage {url}: not an Optuna journal file ({type(exc).__name__}: {exc}); give the "
            "journal the workers wrote, or a new file"
        ) from None
    except OSError as exc:  # a file that cannot be read or created (permissions, a read-only folder)
        raise StorageError(
            f"--storage {url}: cannot open it ({exc.strerror or exc}); give another file"
        ) from None


def open_storage(url: str, *, create_folder: bool = False, must_exist: bool = False) -> Any:
    """The Optuna storage of ``url`` (see the module docstring), checked by opening it.
    ``create_folder``: make a SQLite or journal file's missing folders (the default storage's);
    ``must_exist``: refuse a SQLite or journal file that is not there (a storage to read)."""
    import optuna

    url = storage_url(url)
    check_storage_url(url)
    journal = journal_path(url)
    try:
        if journal is not None:
            _check_folder(journal, url, create_folder=create_folder, must_exist=must_exist)
            return _journal(journal, url)
        sqlite = sqlite_path(url)
        if sqlite is not None:
            _check_folder(sqlite, url, create_folder=create_folder, must_exist=must_exist)
            if must_exist:
                _check_sqlite_storage(sqlite, url)
        return _rdb(_resolve_driver(url))
    except StorageError:
        raise
    except ImportError as exc:
        raise StorageError(_no_driver(url, exc)) from None
    except optuna.exceptions.StorageInternalError as exc:
        raise StorageError(f"--storage {shown(url)}: cannot open it ({exc})") from None
    except Exception as exc:  # SQLAlchemy's ArgumentError / OperationalError: a bad URL, no server
        if type(exc).__module__.startswith("sqlalchemy"):
            why = " ".join(str(exc).split("\n")[0].split())
            fix = (
                "give a SQLite file Optuna wrote, or a new one"
                if sqlite_path(url)
                else "check that the server runs and the URL"
            )
            raise StorageError(f"--storage {shown(url)}: cannot open it ({why}); {fix}") from None
        raise


def _no_driver(url: str, exc: ImportError) -> str:
    """The one line for a driver that does not import: Optuna's own message hides the driver's
    reason (psycopg installed without libpq: "no pq wrapper available"), its cause holds it; a
    PostgreSQL URL names the extra that brings a working driver."""
    scheme = url.split(":", 1)[0]
    why = _first_line(exc.__cause__ or exc)
    if scheme.split("+")[0] in POSTGRES_SCHEMES:
        return f"--storage {shown(url)}: the PostgreSQL driver does not import ({why}); {POSTGRES_EXTRA}"
    return (
        f"--storage {shown(url)}: no driver for {scheme} is installed ({why}); "
        "install it, or use postgresql://..., sqlite:///FILE or journal:FILE"
    )


def _first_line(exc: BaseException) -> str:
    """``exc``'s message as a clause of one of our lines: its first line, spaces collapsed, no
    closing full stop (no ".;" before ours)."""
    return " ".join(str(exc).split("\n")[0].split()).rstrip(". ")


# What a search that lost its storage says to do (``storage_lost``).
RESUME_SEARCH = "the trials stored before are kept: once it answers again, run the same command to resume"
# The driver errors of a connection that failed (SQLAlchemy's and psycopg's classes of these names).
CONNECTION_ERRORS = ("OperationalError", "InterfaceError")


def _connection_lost(exc: BaseException) -> bool:
    """``exc`` is a SQLAlchemy or psycopg error of a connection that failed (a server that
    stopped, a dropped connection), not one of a statement."""
    return any(
        cls.__name__ in CONNECTION_ERRORS and cls.__module__.startswith(("sqlalchemy", "psycopg"))
        for cls in type(exc).__mro__
    )


@contextlib.contextmanager
def storage_lost(
    url: str,
    *,
    during: str = "the search",
    then: str = RESUME_SEARCH,
    lost_on: tuple[type[BaseException], ...] = (),
) -> Iterator[None]:
    """Turn a storage that stops answering inside the block (its server stopped, the connection
    dropped) into one ``StorageError`` line: the storage failed ``during`` what, and ``then`` what
    to do. Optuna raises its ``StorageInternalError`` (or, from inside a trial, an
    ``UnboundLocalError`` of its own whose context is that error), a read may raise the driver's
    connection error itself; none of them says what happened. ``lost_on``: more exceptions that
    mean the storage failed, for a block that does nothing else (a journal file's ``OSError``)."""
    import optuna

    try:
        yield
    except FoTuneError:
        raise
    except Exception as exc:
        chain, seen = [], exc
        while seen is not None and len(chain) < 8:
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        lost = [
            e
            for e in chain
            if isinstance(e, (optuna.exceptions.StorageInternalError, *lost_on)) or _connection_lost(e)
        ]
        if not lost:
            raise
        driver = [e for e in chain if type(e).__module__.startswith(("sqlalchemy", "psycopg"))]
        why = _first_line((driver or lost)[0])
        raise StorageError(
            f"--storage {shown(storage_url(url))}: the storage failed during {during} ({why}); {then}"
        ) from None


def close_storage(storage: Any) -> None:
    """Release an opened storage's connections (RDB); nothing for a journal file."""
    engine = getattr(storage, "engine", None)
    if engine is not None:
        engine.dispose()


def check_storage(url: str, *, create_folder: bool = False, must_exist: bool = False) -> None:
    """Open ``url`` as ``open_storage`` does and close it again: every ``StorageError`` a search
    or a pull would meet, before it does any work."""
    close_storage(open_storage(url, create_folder=create_folder, must_exist=must_exist))


def is_rdb(storage: Any) -> bool:
    """Whether ``storage`` is an Optuna RDB (SQL) storage."""
    from optuna.storages import RDBStorage

    return isinstance(storage, RDBStorage)
