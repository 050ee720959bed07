"""The measurement harness on gloo ranks: spawned pools, failures that end within a timeout, torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness_tasks import ExitOn, FailOn, RankAndSum, SkewedSamples, SleepOn, TimeSleep

from fo_tune.harness import SpawnedPool, Timing, open_pool
from fo_tune.launch import LaunchError

TESTS = Path(__file__).resolve().parent


def test_timing_max_over_takes_the_slowest_rank():
    t = Timing.max_over([Timing(1.0, 0.5, 10, 0.2), Timing(3.0, 0.1, 7, 0.05), Timing(2.0, 0.9, 10)])
    assert t == Timing(3.0, 0.9, 7, 0.2)


def test_pool_results_by_rank_then_a_failing_rank_closes_it():
    with open_pool(2, backend="gloo") as pool:
        assert pool.is_driver and pool.world_size == 2 and pool.backend == "gloo"
        assert pool.run(RankAndSum()) == [(0, 2, "gloo", 2.0), (1, 2, "gloo", 2.0)]
        assert pool.run(RankAndSum()) == [(0, 2, "gloo", 2.0), (1, 2, "gloo", 2.0)]  # the same ranks serve
        per_rank = pool.run(TimeSleep(ms_per_rank=2.0))
        assert [t.samples for t in per_rank] == [3, 3]
        slowest = Timing.max_over(per_rank)
        assert slowest.median_ms == per_rank[1].median_ms >= 4.0
        with pytest.raises(LaunchError, match=r"rank 1 failed during FailOn") as info:
            pool.run(FailOn(rank=1))
        assert "ValueError: boom on rank 1" in str(info.value)
        with pytest.raises(LaunchError, match="closed"):
            pool.run(RankAndSum())


def test_a_dead_rank_ends_the_task():
    pool = SpawnedPool(2, backend="gloo")
    try:
        start = time.monotonic()
        with pytest.raises(LaunchError, match=r"rank 1 died during ExitOn \(exit code 3\)"):
            pool.run(ExitOn(rank=1, code=3), timeout_s=60)
        assert time.monotonic() - start < 30
    finally:
        pool.close()


def test_a_hung_rank_ends_the_task_at_the_timeout():
    pool = SpawnedPool(2, backend="gloo")
    try:
        start = time.monotonic()
        with pytest.raises(LaunchError, match=r"rank\(s\) \[1\] did not finish SleepOn within 3 s"):
            pool.run(SleepOn(rank=1, seconds=4.5), timeout_s=3)
        assert time.monotonic() - start < 20  # the timeout, plus the pool's shutdown
        with pytest.raises(LaunchError, match="closed"):
            pool.run(RankAndSum())
    finally:
        pool.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DRIVER = """
import torch.distributed as dist

from fo_tune.harness import open_pool
from harness_tasks import RankAndSum

with open_pool(2, backend="gloo") as pool:
    if pool.is_driver:
        print("RESULTS", pool.run(RankAndSum()), flush=True)
    else:
        print("SERVED", flush=True)
assert not dist.is_initialized(), "the pool must leave torchrun's process group"
"""


def test_torchrun_rank_0_drives_and_rank_1_serves(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        str(script),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULTS [(0, 2, 'gloo', 2.0), (1, 2, 'gloo', 2.0)]" in done.stdout, done.stdout
    assert done.stdout.count("SERVED") == 1, done.stdout


def test_time_interleaved_alternates_the_variants():
    """Each round samples every variant once, in order, so a drift hits them all alike."""
    import torch

    from fo_tune.harness import time_interleaved

    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    timings = time_interleaved(fns, torch.device("cpu"), warmup=1, rounds=4)
    assert set(timings) == {"a", "b", "c"}
    assert all(t.samples == 4 and t.median_ms >= 0 and t.iqr_ms >= 0 for t in timings.values())
    # after the warm-ups and probes, the timed calls come in rounds: the order rotates each round
    # and every other round runs backwards
    timed = calls[6:]
    runs = [name for i, name in enumerate(timed) if i == 0 or timed[i - 1] != name]
    assert runs == ["a", "b", "c", "a", "c", "b", "c", "a", "b", "c", "b", "a"]


def test_time_interleaved_takes_longer_samples_on_request():
    """``min_sample_ms`` sets the calls per sample: 1 ms calls, 3 ms samples -> 3 calls each."""
    import torch

    from fo_tune.harness import time_interleaved

    calls: list[int] = []

    def one_ms() -> None:
        calls.append(1)
        time.sleep(1e-3)

    timings = time_interleaved({"x": one_ms}, torch.device("cpu"), warmup=1, rounds=2, min_sample_ms=3.0)
    assert timings["x"].samples == 2
    assert len(calls) == 1 + 1 + 2 * 3  # the warm-up, the one-call probe, two samples of three


def test_aligned_samples_leave_out_a_late_peer():
    """Rank 0 starts each all_reduce sample 60 ms before rank 1: unaligned, its median holds that
    wait; aligned (``align=True``), the ranks start together and it does not."""
    with open_pool(2, backend="gloo") as pool:
        (plain0, aligned0), (_, aligned1) = pool.run(SkewedSamples(late_ms=60.0))
    assert plain0 > 40.0, plain0
    assert aligned0 < 20.0 and aligned1 < 20.0, (aligned0, aligned1)
