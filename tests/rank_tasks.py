"""Tasks for the pool and timing tests (spawned ranks unpickle them by reference: they live in a module)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fo_tune.ranks.pool import RankContext
from fo_tune.ranks.timing import time_interleaved, time_region


@dataclass(frozen=True)
class RankAndSum:
    """(rank, world size, backend, the all_reduce of ones): proves every rank ran, in one group."""

    def run(self, ctx: RankContext) -> tuple[int, int, str, float]:
        ones = torch.ones(4, device=ctx.device)
        dist.all_reduce(ones)
        return (ctx.rank, ctx.world_size, ctx.backend, float(ones[0]))


@dataclass(frozen=True)
class CtrlC:
    """A terminal's Ctrl-C as a rank sees it (SIGINT to its own process), then this rank's number:
    the rank is alive to answer only where it leaves SIGINT to the driver."""

    def run(self, ctx: RankContext) -> int:
        import signal

        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # (a handler that raises does so here)
        return ctx.rank


@dataclass(frozen=True)
class Pid:
    """This rank's process id."""

    def run(self, ctx: RankContext) -> int:
        return os.getpid()


@dataclass(frozen=True)
class WhereAmI:
    """(working folder, the environment variable ``name``, whether ``sys.path`` holds ``entry``)."""

    name: str
    entry: str

    def run(self, ctx: RankContext) -> tuple[str, str | None, bool]:
        import sys

        return os.getcwd(), os.environ.get(self.name), self.entry in sys.path


@dataclass(frozen=True)
class SigintBlocked:
    """Whether SIGINT is blocked in the rank (a terminal's Ctrl-C to the process group must reach
    only the driver)."""

    def run(self, ctx: RankContext) -> bool:
        import signal

        return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


@dataclass(frozen=True)
class TimeSleep:
    """A ``time_region`` of a sleep that is longer on higher ranks."""

    ms_per_rank: float

    def run(self, ctx: RankContext):
        seconds = self.ms_per_rank * (ctx.rank + 1) / 1e3
        return time_region(lambda: time.sleep(seconds), ctx.device, warmup=1, reps=3)


@dataclass(frozen=True)
class FailOn:
    rank: int

    def run(self, ctx: RankContext) -> int:
        if ctx.rank == self.rank:
            raise ValueError(f"boom on rank {ctx.rank}")
        return ctx.rank


def fail_on(ctx: RankContext, rank: int) -> int:
    """``run_ranks``' form of ``FailOn``: a function and its payload."""
    return FailOn(rank).run(ctx)


@dataclass(frozen=True)
class ExitOn:
    rank: int
    code: int

    def run(self, ctx: RankContext) -> int:
        if ctx.rank == self.rank:
            os._exit(self.code)
        return ctx.rank


@dataclass(frozen=True)
class SleepOn:
    rank: int
    seconds: float

    def run(self, ctx: RankContext) -> int:
        if ctx.rank == self.rank:
            time.sleep(self.seconds)
        return ctx.rank


@dataclass(frozen=True)
class SkewedSamples:
    """Two interleaved variants: ``late`` sleeps ``late_ms`` on rank 1 only (no collective), and
    ``ar`` is an all_reduce, so in every round rank 0 starts ``ar``'s sample ``late_ms`` before rank 1.
    Returns ``ar``'s median per rank, samples not aligned then aligned."""

    late_ms: float

    def run(self, ctx: RankContext) -> tuple[float, float]:
        ones = torch.ones(4, device=ctx.device)
        delay = self.late_ms / 1e3 if ctx.rank == 1 else 0.0

        def ar() -> None:
            dist.all_reduce(ones)

        fns = {"late": lambda: time.sleep(delay), "ar": ar}
        got = []
        for align in (False, True):
            timings = time_interleaved(
                fns, ctx.device, warmup=1, rounds=3, agree=True, align=align, min_sample_ms=1e-3
            )
            got.append(timings["ar"].median_ms)
        return got[0], got[1]
