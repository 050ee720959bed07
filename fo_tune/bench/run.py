"""``run_bench``: one worker pool, the ranks' agreed fingerprint, then one ``BenchCaseTask`` per
(shape, collective), merged into rows."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

from fo_kernels.schedule import SHARDED_COLLECTIVES
from fo_tune.bench.request import CPU_REPS, CPU_WARMUP, GPU_REPS, WARMUP, BenchRequest, check_runnable
from fo_tune.bench.rows import BenchResult, case_rows, merge, skipped_rows
from fo_tune.bench.task import BenchCaseTask
from fo_tune.output import Reporter, SilentReporter, whole
from fo_tune.ranks.backend import choose_backend
from fo_tune.ranks.launch import fingerprinted_pool
from fo_tune.ranks.pool import LaunchError
from fo_tune.ranks.timing import comparison_sample_ms


def run_bench(
    request: BenchRequest,
    reporter: Reporter | None = None,
    keep: Callable[[BenchResult], object] | None = None,
) -> BenchResult | None:
    """Benchmark every (shape, collective) of ``request`` in one worker pool (``fo_tune.bench``).

    Returns None on a torchrun rank other than 0 (it served rank 0's tasks). Raises
    ``ProblemSizeError`` / ``BenchRequestError`` before any rank starts for shapes that cannot run
    here (``check_runnable``), ``EnvironmentMismatchError`` when the ranks see different hardware,
    ``LaunchError`` when a rank fails, dies or hangs (``request.timeout_s`` per case).

    ``keep``: called with the finished cases' rows (its ``settings["stopped"]`` says after which
    case and why) when a rank fails or the run is interrupted after one case or more finished,
    before the exception goes on: the cases timed so far are not lost.
    """
    rep = reporter or SilentReporter()
    t0 = time.monotonic()
    backend = choose_backend(request.world_size, request.backend)
    check_runnable(request, backend)
    with fingerprinted_pool(request.world_size, backend=backend, purpose="bench") as (pool, fp):
        if fp is None:
            return None
        cpu = pool.backend != "nccl"
        dtype = request.dtype_for(pool.backend)
        reps = request.reps or (CPU_REPS if cpu else GPU_REPS)
        sample_ms = request.sample_ms or comparison_sample_ms(not cpu)
        warmup = CPU_WARMUP if cpu else WARMUP
        cases = [(s, c) for s in request.shapes for c in request.collectives]
        result = BenchResult(
            fingerprint=fp,
            backend=pool.backend,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            settings=dict(
                shapes=[list(s) for s in request.shapes],
                collectives=list(request.collectives),
                world_size=request.world_size,
                dtype=dtype,
                backend=pool.backend,
                reps=reps,
                sample_ms=whole(sample_ms),
                warmup=warmup,
                chunks=list(request.chunks),
                suite=request.suite,
                timeout_s=whole(request.timeout_s),
                seed=request.seed,
            ),
        )
        rep.stage("bench", len(cases))
        try:
            _run_cases(request, result, cases, pool, dtype, warmup, reps, sample_ms, rep)
        except (KeyboardInterrupt, LaunchError) as exc:
            if keep is not None and result.rows:
                done = len({(r.m, r.n, r.k, r.collective) for r in result.rows})
                why = "interrupted" if isinstance(exc, KeyboardInterrupt) else " ".join(str(exc).split())
                result.settings["stopped"] = f"after {done} of {len(cases)} cases: {why}"
                result.wall_s = time.monotonic() - t0
                keep(result)
            raise
    result.wall_s = time.monotonic() - t0
    return result


def _run_cases(
    request: BenchRequest,
    result: BenchResult,
    cases: list[tuple[tuple[int, int, int], str]],
    pool: Any,
    dtype: str,
    warmup: int,
    reps: int,
    sample_ms: float,
    rep: Reporter,
) -> None:
    """Each case's rows onto ``result.rows`` as it finishes."""
    fp = result.fingerprint
    for (m, n, k), collective in cases:
        head = dict(device_key=fp.device_key, world_size=pool.world_size, dtype=dtype, m=m, n=n, k=k,
                    collective=collective)  # fmt: skip
        if collective in SHARDED_COLLECTIVES and m % pool.world_size:
            why = f"M={m} is not divisible by the world size {pool.world_size}"
            result.rows += skipped_rows(head, request.chunks, why)
        else:
            task = BenchCaseTask(
                collective, m, n, k, dtype, request.chunks, warmup, reps, request.seed,
                min_sample_ms=sample_ms,
            )  # fmt: skip
            per_rank = pool.run(task, timeout_s=request.timeout_s)
            merged = [merge([r[i] for r in per_rank]) for i in range(len(per_rank[0]))]
            result.rows += case_rows(head, merged)
        rep.step("bench", f"{collective} {m}x{n}x{k}")
