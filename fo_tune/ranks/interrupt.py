"""Ctrl-C in a command with rank processes: a terminal sends SIGINT to the whole foreground
process group, the driver and its ranks alike. Only the driver should take it (it closes the pool,
keeps what the command keeps and says ``error: interrupted``); a rank, or gloo's forkserver while
it imports torch, stopped by it prints a traceback and dies mid-task."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while it starts processes (the ranks and, on the first start,
    gloo's forkserver). They inherit the mask across fork and exec and keep it, so a Ctrl-C to the
    process group reaches only the driver. A Ctrl-C to the driver meanwhile stays pending and
    arrives when the block ends: nothing is lost."""
    if not hasattr(signal, "pthread_sigmask"):  # (Windows: no masks, no process groups to signal)
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # its first start unblocks SIGINT: not inside the block
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
