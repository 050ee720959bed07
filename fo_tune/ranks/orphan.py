"""A spawned rank whose driver died without closing the pool (SIGKILL, the kernel's out-of-memory
killer): how the rank tells, and what it removes on its way out.

The parent process id alone does not tell: gloo's ranks are children of multiprocessing's
forkserver, and the forkserver outlives the driver for as long as any rank holds the pipe it
watches for the driver's exit, which every rank does. So a rank also watches the driver's own
process id. On its way out a rank removes what the driver would have removed: the pool's folder
(its rendezvous file) and the forkserver's socket folder (``pymp-*``), once no rank needs them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# The states /proc/<pid>/stat gives a process that has exited and not been reaped yet (zombie,
# dead): its id still answers a signal, but nothing runs there.
EXITED_STATES = ("Z", "X")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (an unreaped one counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: it exists)
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # (no /proc: the signal's answer stands)
        return True
    return state not in EXITED_STATES


def orphaned(driver_pid: int, parent_pid: int) -> bool:
    """Whether this rank lost its driver: its parent changed (a spawned rank's parent is the
    driver) or the driver exited (a forked rank's parent is the forkserver, see above)."""
    return os.getppid() != parent_pid or not process_alive(driver_pid)


def remove_pool_files(pool_dir: Path) -> None:
    """Remove the pool's folder and, in a rank forked by multiprocessing's forkserver, the
    forkserver's socket folder; the other ranks may be doing the same (errors are ignored)."""
    shutil.rmtree(pool_dir, ignore_errors=True)
    from multiprocessing import forkserver

    address = getattr(forkserver._forkserver, "_forkserver_address", None)
    if isinstance(address, str) and address:
        folder = Path(address).parent
        if folder.name.startswith("pymp-"):
            shutil.rmtree(folder, ignore_errors=True)
