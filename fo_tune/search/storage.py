"""Where the search's Optuna studies live: opening a storage from the ``--storage`` URL.

``""`` is SQLite at ``DEFAULT_STORAGE_FILE`` (one file, many studies); ``journal:PATH`` (or a path
ending in ``.log`` / ``.jsonl``) is Optuna's journal file, which several local workers can share;
any other URL (``sqlite:///...``, ``postgresql://...``) is an RDB storage. RDB storages get
heartbeats, so a trial whose process was killed is failed after ``GRACE_S`` instead of staying
RUNNING forever.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from fo_kernels.errors import FoTuneError

# Seconds between heartbeats of a running trial in an RDB storage, and after how long without one
# it counts as dead (failed) so a resumed search does not wait for it (Optuna's heartbeat).
HEARTBEAT_S = 10
GRACE_S = 60
DEFAULT_STORAGE_FILE = Path("results/studies/fo-tune.db")


class StorageError(FoTuneError, ValueError):
    """A ``--storage`` that cannot be opened; the message says what to do."""


def open_storage(url: str, default_file: Path = DEFAULT_STORAGE_FILE) -> Any:
    """An Optuna storage: ``""`` -> SQLite at ``default_file``; ``journal:PATH`` or a path ending in
    ``.log``/``.jsonl`` -> a journal file (safe for several local workers); any other URL
    (``sqlite:///...``, ``postgresql://...``) -> an RDB storage with heartbeats."""
    import optuna
    from optuna.storages import JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend

    if not url:
        default_file.parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{default_file}"
    journal = url[len("journal:") :] if url.startswith("journal:") else None
    if journal is None and url.endswith((".log", ".jsonl")) and "://" not in url:
        journal = url
    try:
        if journal is not None:
            Path(journal).parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(journal))
        if "://" not in url:
            raise StorageError(
                f"--storage {url!r}: expected an Optuna URL (sqlite:///FILE, postgresql://...) or "
                "journal:FILE"
            )
        if url.startswith("sqlite:///"):
            Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna 4-5
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    except (ImportError, ModuleNotFoundError) as exc:
        raise StorageError(f"--storage {url!r}: {exc}; install the database driver") from None
    except optuna.exceptions.StorageInternalError as exc:
        raise StorageError(f"--storage {url!r}: cannot open it ({exc})") from None
    except Exception as exc:  # sqlalchemy's ArgumentError / OperationalError on a bad URL
        if type(exc).__module__.startswith("sqlalchemy"):
            raise StorageError(f"--storage {url!r}: {str(exc).splitlines()[0]}") from None
        raise


def check_storage_url(url: str) -> None:
    """Refuse, without opening anything, a ``--storage`` that ``open_storage`` cannot take."""
    if not url or url.startswith("journal:") or (url.endswith((".log", ".jsonl")) and "://" not in url):
        return
    if "://" not in url:
        raise StorageError(
            f"--storage {url!r}: expected an Optuna URL (sqlite:///FILE, postgresql://...) or journal:FILE"
        )
    if url.startswith("sqlite:///") and not url[len("sqlite:///") :].strip():
        raise StorageError("--storage sqlite:/// names no file (an in-memory database would lose the study)")
    if url.startswith("sqlite:///"):
        return  # a file path: nothing for SQLAlchemy to parse (and its import takes ~0.5 s)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except ArgumentError as exc:
        raise StorageError(f"--storage {url!r}: {str(exc).splitlines()[0]}") from None


def is_rdb(storage: Any) -> bool:
    from optuna.storages import RDBStorage

    return isinstance(storage, RDBStorage)
