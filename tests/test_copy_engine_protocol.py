"""The copy engine's protocol run on the CPU executor: the operation lists the GPUs run, on N
thread-ranks whose streams are FIFO workers, with random delays before every operation.

- Results: all three collectives for every N from 2 to 8 ranks, odd shapes (M not a multiple of the
  chunk count, N and K not multiples of 8), 1 to 6 chunks, ten calls on the same buffers with no
  barrier between them and the outputs poisoned before each, against a float64 reference.
- Shared hardware queues: the lists complete when a rank's streams share one FIFO, or random
  groups of them do (a wait for a peer's data is queued after the work the peer waits for).
- Failures end within the timeout instead of hanging: a lost flag, a deadlock, a missing reuse
  guard, a stream left unjoined, a wrong sum are each caught.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import threading
import time

import pytest
import torch

from fo_kernels.engines.copy_engine import (
    CpuCheck,
    CpuOptions,
    ProtocolError,
    ProtocolTimeout,
    check_on_threads,
    plan_call,
)
from fo_kernels.engines.copy_engine.buffers import region_bytes_for
from fo_kernels.engines.copy_engine.cpu import CpuRank, run_ranks
from fo_kernels.engines.copy_engine.layout import Cell
from fo_kernels.engines.copy_engine.ops import SIDE, STREAMS, Gemm, Signal, Wait
from fo_kernels.errors import ArgumentError, ScaleError, ScheduleError, ShapeError
from fo_kernels.tile import Tile

TOL = 1e-5  # float32 operands against the float64 reference
BF16_TOL = 2e-2  # an fp8 call's bfloat16 output against the float64 reference
CALLS = 10
FAST = CpuOptions(timeout_s=10.0, delay_s=2e-4, seed=1)
TILE = Tile(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1)

# (world, chunks): every chunk count from 1 to 6 at two ranks, and spread over every larger group
# up to 8 ranks (a TP=8 board): the ring's steps and neighbours differ with N, odd N included
SIZES = [(2, 1), (2, 2), (2, 3), (2, 4), (2, 5), (2, 6), (3, 2), (3, 5), (4, 3), (4, 6)]
SIZES += [(5, 3), (6, 2), (7, 3), (8, 2), (8, 4)]


def _shape(collective: str, world: int, chunks: int) -> tuple[int, int, int]:
    """Odd sizes: M not a multiple of the chunk count (all_reduce: nor of the world size), N and
    K not multiples of 8; a shard has at least as many rows as chunks."""
    shard = 6 * chunks + 1  # shard rows, never a multiple of the chunk count
    m = world * shard + (world // 2 if collective == "all_reduce" else 0)
    return m, 13, 11


def _executor_threads() -> list[str]:
    """The CPU executor's threads still alive (its ranks' host and FIFO workers, "rank<r>:...")."""
    return [t.name for t in threading.enumerate() if t.name.startswith("rank")]


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("world, chunks", SIZES)
def test_repeated_calls_match_float64(collective: str, world: int, chunks: int):
    m, n, k = _shape(collective, world, chunks)
    weights = (1,) * chunks if chunks % 2 else tuple(range(1, chunks + 1))  # equal and unequal chunks
    check = CpuCheck(
        collective=collective, world=world, m=m, n=n, k=k, weights=weights, calls=CALLS, seed=world
    )
    got = check_on_threads(check, FAST)
    assert not got.has_nan and got.rel_err < TOL, got
    # every worker has stopped when the run returns (one left inside a torch op when the
    # interpreter exits aborts the process)
    assert _executor_threads() == []


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("weights", [(1,), (2, 1), (1, 1, 1)])
def test_tiled_repeated_calls_match_float64(collective: str, weights):
    """The tiled mode (two ranks; its kernels run as their chunks, each waiting for its ready
    flag and counting its tiles): M and N end mid-tile."""
    check = CpuCheck(
        collective=collective,
        world=2,
        m=70,
        n=37,
        k=11,
        mode="tiled",
        tile=TILE,
        weights=weights,
        calls=CALLS,
    )
    got = check_on_threads(check, FAST)
    assert not got.has_nan and got.rel_err < TOL, got


ONE_FIFO = {s: "queue" for s in STREAMS}


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_streams_sharing_one_queue_complete(collective: str, world: int):
    """Every stream of a rank on one FIFO: the lists still complete, with the right sums."""
    m, n, k = _shape(collective, world, 3)
    check = CpuCheck(collective=collective, world=world, m=m, n=n, k=k, weights=(1, 1, 1), calls=3)
    got = check_on_threads(check, dataclasses.replace(FAST, fifos=ONE_FIFO))
    assert not got.has_nan and got.rel_err < TOL, got


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_tiled_streams_sharing_one_queue_complete(collective: str):
    check = CpuCheck(
        collective=collective, world=2, m=70, n=37, k=11, mode="tiled", tile=TILE, weights=(2, 1), calls=3
    )
    got = check_on_threads(check, dataclasses.replace(FAST, fifos=ONE_FIFO))
    assert not got.has_nan and got.rel_err < TOL, got


@pytest.mark.parametrize("seed", range(4))
def test_streams_sharing_random_queues_complete(seed: int):
    """Random groups of a rank's streams share a FIFO (as streams may share hardware queues)."""
    rng = random.Random(seed)
    fifos = {s: f"q{rng.randrange(2)}" for s in STREAMS}
    for collective in ("all_reduce", "reduce_scatter", "all_gather"):
        m, n, k = _shape(collective, 3, 2)
        check = CpuCheck(collective=collective, world=3, m=m, n=n, k=k, weights=(1, 2), calls=3, seed=seed)
        got = check_on_threads(check, dataclasses.replace(FAST, fifos=fifos, seed=seed))
        assert not got.has_nan and got.rel_err < TOL, (fifos, got)


def _first(kind, name: str, rank: int = 0):
    """A ``drop`` that leaves out rank ``rank``'s first operation of ``kind`` on a cell ``name``."""
    dropped = []

    def drop(r: int, i: int, op) -> bool:
        if r == rank and not dropped and isinstance(op, kind) and op.cell.name == name:
            dropped.append(i)
            return True
        return False

    return drop


@pytest.mark.parametrize(
    "collective, name", [("reduce_scatter", "partial"), ("all_reduce", "summed"), ("all_gather", "shard")]
)
def test_a_lost_flag_fails_within_the_timeout(collective: str, name: str):
    """A flag that is never set: the waiting stream raises ProtocolTimeout after ``timeout_s``,
    and every other thread stops waiting, so the run ends instead of hanging. (One call: in a
    second one, a wait that the lost flag holds up in turn could time out first.)"""
    m, n, k = _shape(collective, 3, 2)
    check = CpuCheck(collective=collective, world=3, m=m, n=n, k=k, weights=(1, 1), calls=1)
    opts = dataclasses.replace(FAST, timeout_s=0.5, drop=_first(Signal, name))
    start = time.monotonic()
    with pytest.raises(ProtocolTimeout, match=rf"waited for rank \d's {name}.*a lost flag or a deadlock"):
        check_on_threads(check, opts)
    assert time.monotonic() - start < 5.0
    assert _executor_threads() == []


def _operands(plan, seed: int = 0):
    spec = plan.spec
    gen = torch.Generator().manual_seed(seed * 31 + spec.rank)
    a = torch.randn(spec.m, spec.k, generator=gen)
    return a, torch.randn(spec.k, spec.n, generator=gen), torch.empty(plan.out_rows, spec.n)


def _run_plans(plans, options: CpuOptions, calls: int = 1) -> None:
    def body(rank):
        a, b, out = _operands(plans[rank.rank])
        for _ in range(calls):
            rank.call(plans[rank.rank], a, b, out)

    run_ranks(len(plans), body, region_bytes=region_bytes_for(plans[0], torch.float32), options=options)


def _side_first(plan):
    """The plan with its side stream's operations issued right after the eager prologue (the
    waits for the peer's partials ahead of the GEMMs the peer waits for)."""
    head, body = plan.ops[: plan.prologue], plan.ops[plan.prologue :]
    side = [op for op in body if op.stream == SIDE]
    rest = [op for op in body if op.stream != SIDE]
    return dataclasses.replace(plan, ops=(*head, *side, *rest))


def test_a_wait_queued_ahead_of_the_peers_work_deadlocks_on_a_shared_queue():
    """With the side stream's waits issued first, the lists still complete on separate FIFOs but
    deadlock when a rank's streams share one: caught as a timeout, not a hang."""
    plans = [_side_first(plan_call("ring", "reduce_scatter", 2, r, 40, 13, 11, (1, 1))) for r in range(2)]
    _run_plans(plans, FAST)  # separate FIFOs: fine
    start = time.monotonic()
    with pytest.raises(ProtocolTimeout, match="a lost flag or a deadlock"):
        _run_plans(plans, dataclasses.replace(FAST, timeout_s=0.5, fifos=ONE_FIFO))
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize(
    "collective, guard", [("reduce_scatter", "pulled"), ("all_reduce", "gathered"), ("all_gather", "taken")]
)
def test_a_missing_reuse_guard_is_caught(collective: str, guard: str):
    """Rank 0 leaves out its waits for one kind of guard (keeping the resets) while rank 1's
    host falls behind: rank 0 rewrites a buffer that rank 1 has not finished reading, and the run
    fails (a flag set before its reset, or a wrong sum) instead of passing. (At all_reduce the
    ``pulled`` guards are implied by the gathers: a peer's sums of chunk c exist only after every
    ring pull of chunk c.)"""
    m, n, k = _shape(collective, 2, 2)
    check = CpuCheck(collective=collective, world=2, m=m, n=n, k=k, weights=(1, 1), calls=4)
    no_wait = lambda r, i, op: r == 0 and isinstance(op, Wait) and op.cell.name == guard
    opts = dataclasses.replace(FAST, timeout_s=5.0, slow={1: 2e-3}, drop=no_wait)
    try:
        got = check_on_threads(check, opts)
    except ProtocolError as exc:
        assert "still set" in str(exc) or "a lost flag" in str(exc), exc
    else:
        assert got.has_nan or not got.rel_err < TOL, got
    good = check_on_threads(check, dataclasses.replace(opts, drop=None))  # with the guard: right
    assert not good.has_nan and good.rel_err < TOL, good


def test_a_wrong_sum_is_caught():
    """The float64 check can fail: without rank 1's last GEMM of one chunk, its rows of the sum
    lack rank 1's partial."""
    check = CpuCheck(collective="reduce_scatter", world=2, m=40, n=13, k=11, weights=(1, 1), calls=1)
    drop = lambda r, i, op: r == 1 and isinstance(op, Gemm) and op.beta == 1 and op.out.r0 == 0
    got = check_on_threads(check, dataclasses.replace(FAST, drop=drop))
    assert got.rel_err > 0.1, got


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(m=7), ShapeError, "all_gather needs M divisible by the world size 2, got M=7"),
        (dict(n=24), ShapeError, r"N and K multiples of 16 .*got N=24, K=16"),
        (dict(k=8), ShapeError, r"N and K multiples of 16 .*got N=16, K=8"),
        (dict(out_dtype=torch.int32), ScaleError, "out_dtype: torch.int32 is not one of"),
        (dict(out_dtype=torch.float8_e4m3fn), ScaleError, "out_dtype: torch.float8_e4m3fn is not one of"),
    ],
)
def test_a_check_the_ops_would_refuse_is_refused(changes: dict, error: type, match: str):
    """A check of a call the fp8 ops refuse (or an all_gather whose shards would differ in rows)
    raises naming the problem, before any rank starts."""
    with pytest.raises(error, match=match):
        shape = dict(m=8, n=16, k=16, scaling="rowwise") | changes
        check_on_threads(CpuCheck(collective="all_gather", world=2, **shape), FAST)


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(collective="all_to_all"), ScheduleError, "collective: 'all_to_all' is not one of"),
        (dict(world=1), ScheduleError, "world: must be >= 2, got 1"),
        (dict(world=0), ScheduleError, "world: must be >= 2, got 0"),
        (dict(world="2"), ScheduleError, "world: expected an integer, got '2'"),
        (dict(m=0), ShapeError, "m: must be >= 1, got 0"),
        (dict(n=-1), ShapeError, "n: must be >= 1, got -1"),
        (dict(k=2.5), ShapeError, "k: expected an integer, got 2.5"),
        (dict(mode="rings"), ScheduleError, "mode: 'rings' is not a copy-engine mode"),
        (dict(mode="tiled"), ScheduleError, "mode tiled: needs the persistent GEMM's tile"),
        (dict(weights=(0, 1)), ScheduleError, "weights: expected 1 to 64 positive integers"),
        (dict(dtype="float32"), ShapeError, "dtype: 'float32' is not one of torch.bfloat16"),
        (dict(dtype=torch.int32), ShapeError, "dtype: torch.int32 is not one of"),
        (dict(calls=0), ArgumentError, "calls: must be >= 1, got 0"),
        (dict(scaling="row"), ScaleError, "scaling: 'row' is not one of"),
        (dict(scaling="rowwise", out_dtype="bfloat16"), ScaleError, "out_dtype: 'bfloat16' is not one of"),
    ],
)
def test_a_bad_check_is_refused_on_construction(changes: dict, error: type, match: str):
    """Each field of a ``CpuCheck`` a caller can get wrong raises naming it when the check is
    made, not later inside a thread-rank (an IndexError, a torch error or a hang)."""
    with pytest.raises(error, match=match):
        CpuCheck(**(dict(collective="all_reduce", world=2, m=8, n=16, k=16) | changes))


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(timeout_s=0), r"timeout_s: expected a finite number of seconds > 0, got 0"),
        (dict(timeout_s="5"), r"timeout_s: .* got '5'"),
        (dict(timeout_s=float("inf")), r"timeout_s: .* got inf"),
        (dict(delay_s=float("nan")), r"delay_s: expected a finite number of seconds >= 0, got nan"),
        (dict(seed="x"), r"seed: expected an integer, got 'x'"),
        (dict(slow={0: -1.0}), r"slow: expected a mapping of rank .* got \{0: -1.0\}"),
        (dict(slow=[0.1]), r"slow: expected a mapping"),
        (dict(fifos={"mian": "q"}), r"fifos: unknown stream\(s\) \['mian'\]; valid: main"),
        (dict(fifos=["main"]), r"fifos: expected a mapping of stream name to FIFO name"),
        (dict(drop=True), r"drop: expected a function"),
        (dict(host_blocks=1), r"host_blocks: expected a function op -> bool, or None; got 1"),
    ],
)
def test_bad_executor_options_are_refused_on_construction(options: dict, match: str):
    with pytest.raises(ArgumentError, match=match):
        CpuOptions(**options)


def test_a_slow_rank_outside_the_run_is_refused_before_any_thread_starts():
    check = CpuCheck(collective="all_reduce", world=2, m=8, n=16, k=16, calls=1)
    with pytest.raises(ArgumentError, match=r"slow: rank\(s\) \[2\] outside the 2 ranks"):
        check_on_threads(check, CpuOptions(slow={2: 0.1}))
    assert not _executor_threads()


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_a_stale_fp8_scale_is_caught(monkeypatch: pytest.MonkeyPatch, scaling: str):
    """The float64 check can fail on scales: a rank that keeps its first call's scale_a (a stale
    scale) fails the later calls, whose scale_a differs, tensorwise as rowwise."""
    kept: dict[int, torch.Tensor] = {}
    real = CpuRank.call

    def stale(self, plan, a, b, out, gathered=None, scales=None):
        first = kept.setdefault(self.rank, scales.a.clone())
        return real(self, plan, a, b, out, gathered, dataclasses.replace(scales, a=first))

    check = CpuCheck(collective="all_gather", world=2, m=8, n=16, k=16, scaling=scaling, calls=2)
    assert check_on_threads(check, FAST).rel_err < BF16_TOL
    monkeypatch.setattr(CpuRank, "call", stale)
    got = check_on_threads(check, FAST)
    assert got.rel_err > 0.1, got


def test_a_stream_left_unjoined_is_caught():
    """A call whose side stream still has work when its main stream is done (the list does not
    join it back) fails at once, even though that work would wait forever."""
    plans = [plan_call("ring", "reduce_scatter", 2, r, 40, 13, 11, (1,)) for r in range(2)]
    stuck = Wait(SIDE, Cell(0, "ready", (0,)))  # the ring mode never sets it
    plans[0] = dataclasses.replace(plans[0], ops=(*plans[0].ops, stuck))
    start = time.monotonic()
    with pytest.raises(ProtocolError, match=r"stream\(s\) side still had work.*does not join"):
        _run_plans(plans, dataclasses.replace(FAST, timeout_s=5.0))
    assert time.monotonic() - start < 4.0


def test_a_ctrl_c_stops_the_thread_ranks_before_it_goes_on():
    """A Ctrl-C in the caller (``fo-tune demo --engine copy_engine``) while the thread-ranks run:
    they stop before the ``KeyboardInterrupt`` goes on; a thread still inside a torch op when the
    interpreter exits aborted the process ("terminate called without an active exception")."""
    main = threading.main_thread().ident
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def body(rank: CpuRank) -> None:
        if rank.rank == 0:
            signal.pthread_kill(main, signal.SIGINT)
        rank.world.wait_until(rank.rank, lambda: False, lambda: "a flag that never comes", 30.0)

    try:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_ranks(2, body, region_bytes=64)
        assert time.monotonic() - t0 < 10
        assert not [t.name for t in threading.enumerate() if t.name.startswith("rank")]
    finally:
        signal.signal(signal.SIGINT, previous)
