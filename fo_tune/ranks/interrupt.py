"""Ctrl-C in a command with rank processes: a terminal sends SIGINT to the whole foreground
process group, the driver and its ranks alike. Only the driver should take it (it closes the pool,
keeps what the command keeps and says ``error: interrupted``); a rank, or gloo's forkserver while
it imports torch, stopped by it prints a traceback and dies mid-task. The same hold keeps a
finished run's files whole while they are written (``fo_tune.cli.errors.finishing``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Run the body out of SIGINT's reach: the start of processes (the ranks and, on the first
    start, gloo's forkserver), or a write that must not stop halfway (``cli.errors.finishing``).

    SIGINT is blocked in this thread: the processes inherit the mask across fork and exec and keep
    it, so a Ctrl-C to the process group reaches only the driver. In the driver a Ctrl-C during
    the body (another of its threads takes it) is held and raised as ``KeyboardInterrupt`` when
    the body is done, so no process is left half started (one whose queues vanish as it unpickles
    them prints a traceback) and the caller closes every one it started."""
    if not hasattr(signal, "pthread_sigmask"):  # (Windows: no masks, no process groups to signal)
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # its first start unblocks SIGINT: not inside the block
    caught: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    hold = callable(previous) and threading.current_thread() is threading.main_thread()
    if hold:
        signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # (one pending now runs the holding handler)
        if hold:
            signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
