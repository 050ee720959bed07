"""A throwaway PostgreSQL server for the fleet tests: a cluster made by ``initdb`` in a temporary
folder, started by ``pg_ctl`` on a free port of 127.0.0.1, stopped and removed afterwards.

The server binaries are Debian's (``postgresql`` package, ``/usr/lib/postgresql/<version>/bin``;
scripts/test.sh installs it) or any on PATH. PostgreSQL refuses to run as root, so under root the
cluster is made and run as the package's ``postgres`` user. ``server_blocker`` says why no server
can start here (the tests skip with that reason); each pytest-xdist worker makes its own cluster on
its own port.
"""

from __future__ import annotations

import contextlib
import getpass
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ports import free_port

# The OS user the server runs as when the tests run as root (Debian's package creates it).
SERVER_USER = "postgres"
# Seconds pg_ctl waits for the server to accept connections, and initdb may take (2 cores, shared).
START_TIMEOUT_S = 60
INITDB_TIMEOUT_S = 120
# The database the tests use (made by initdb).
DATABASE = "postgres"


def server_bin() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: the newest Debian one, else PATH's; None without."""
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if versions:
        return Path(versions[-1]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def server_blocker() -> str | None:
    """Why no PostgreSQL server can start here (a skip reason), else None."""
    if server_bin() is None:
        return (
            "no PostgreSQL server binary (initdb) on this machine; scripts/test.sh installs Debian's "
            "postgresql package (apt-get install postgresql)"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root and there is no {SERVER_USER!r} user to run the PostgreSQL server as"
    return None


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a throwaway server; yields its URL, ``postgresql://USER@127.0.0.1:PORT/postgres``."""
    bindir = server_bin()
    assert bindir is not None, server_blocker()
    as_root = os.geteuid() == 0
    user = SERVER_USER if as_root else getpass.getuser()
    run_as = {"user": SERVER_USER} if as_root else {}
    root = Path(tempfile.mkdtemp(prefix="fo-tune-pg-"))
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    if as_root:  # the server's user owns its folder (tmp folders are root's, mode 700)
        entry = pwd.getpwnam(SERVER_USER)
        for path in (root, sockets):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    env = {**os.environ, "LC_ALL": "C"}
    started = False
    try:
        subprocess.run(
            [bindir / "initdb", "-D", data, "-U", user, "-A", "trust", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True, timeout=INITDB_TIMEOUT_S, env=env, **run_as,
        )  # fmt: skip
        for _attempt in range(3):  # a port taken between the probe and the start: another one
            port = free_port()
            options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
            done = subprocess.run(
                [bindir / "pg_ctl", "-D", data, "-o", options, "-l", root / "server.log", "-w",
                 "-t", str(START_TIMEOUT_S), "start"],
                capture_output=True, timeout=START_TIMEOUT_S + 10, env=env, **run_as,
            )  # fmt: skip
            if done.returncode == 0:
                started = True
                break
        if not started:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {done.stderr.decode()} {log}")
        yield f"postgresql://{user}@127.0.0.1:{port}/{DATABASE}"
    finally:
        if started:
            subprocess.run(
                [bindir / "pg_ctl", "-D", data, "-m", "immediate", "stop"],
                capture_output=True, timeout=START_TIMEOUT_S, env=env, **run_as,
            )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
