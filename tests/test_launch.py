"""Rank processes on gloo: spawned pools, failures that end within a timeout, torchrun, the backend
rule and the fingerprint the ranks must agree on."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fo_kernels.errors import ArgumentError, EnvironmentMismatchError
from fo_kernels.fingerprint import current_fingerprint
from fo_tune.ranks import backend as rank_backend
from fo_tune.ranks import launch, spawned
from fo_tune.ranks.backend import choose_backend
from fo_tune.ranks.interrupt import sigint_deferred
from fo_tune.ranks.launch import agreed_fingerprint, open_pool
from fo_tune.ranks.pool import LaunchError
from fo_tune.ranks.spawned import SpawnedPool
from fo_tune.ranks.timing import Timing
from ports import free_port
from rank_tasks import CtrlC, ExitOn, FailOn, RankAndSum, SigintBlocked, SleepOn, TimeSleep, WhereAmI, fail_on

TESTS = Path(__file__).resolve().parent


def test_pool_results_by_rank_then_a_failing_rank_closes_it():
    with open_pool(2, backend="gloo") as pool:
        assert pool.is_driver and pool.world_size == 2 and pool.backend == "gloo"
        assert pool.run(RankAndSum()) == [(0, 2, "gloo", 2.0), (1, 2, "gloo", 2.0)]
        assert pool.run(RankAndSum()) == [(0, 2, "gloo", 2.0), (1, 2, "gloo", 2.0)]  # the same ranks serve
        # A terminal's Ctrl-C goes to the whole process group: the ranks (and the forkserver they
        # fork from) started with SIGINT blocked, the driver takes it and closes them.
        assert pool.run(SigintBlocked()) == [True, True]
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        per_rank = pool.run(TimeSleep(ms_per_rank=2.0))
        assert [t.samples for t in per_rank] == [3, 3]
        slowest = Timing.max_over(per_rank)
        assert slowest.median_ms == per_rank[1].median_ms >= 4.0
        with pytest.raises(LaunchError, match=r"rank 1 failed during FailOn") as info:
            pool.run(FailOn(rank=1))
        assert "ValueError: boom on rank 1" in str(info.value)
        with pytest.raises(LaunchError, match="closed"):
            pool.run(RankAndSum())


def test_run_ranks_names_the_function_a_rank_failed_in():
    """A ``run_ranks`` failure says what the ranks were doing: the function's name, not the
    internal task type that carries it."""
    with pytest.raises(LaunchError, match=r"rank 0 failed during fail_on:") as info:
        launch.run_ranks(fail_on, 2, 0, backend="gloo")
    assert "ValueError: boom on rank 0" in str(info.value)


def test_a_ctrl_c_while_ranks_start_is_raised_once_they_are_started():
    """A Ctrl-C that comes while the driver starts processes (another thread of it may take the
    signal) is raised after the last one started, so the pool closes every rank: one left half
    started, its queues gone, printed a traceback."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = threading.Event()
    other = threading.Thread(target=done.wait)  # a thread that does not block SIGINT (a feeder's)
    other.start()
    started = []
    try:
        with pytest.raises(KeyboardInterrupt), sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # (where the interrupt would land without the deferral)
            started.append("rank 1")
        assert started == ["rank 1"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        done.set()
        other.join()
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_a_task_stops_its_busy_ranks_within_seconds():
    """The ranks do not take a Ctrl-C (the driver does) and would finish their task before they
    read the close: the driver stops them after ``INTERRUPTED_WAIT_S``, not the 10 s a closing
    pool gives them, so the command ends about a second after the Ctrl-C."""
    pool = SpawnedPool(1, backend="gloo")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    try:
        start = time.monotonic()
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            pool.run(SleepOn(rank=0, seconds=30.0))
        assert time.monotonic() - start < 5  # (a closing pool waits 10 s)
        with pytest.raises(LaunchError, match="closed"):
            pool.run(RankAndSum())
    finally:
        ctrl_c.cancel()
        signal.signal(signal.SIGINT, previous)
        pool.close()


def test_each_pool_s_ranks_start_where_the_driver_is_then(tmp_path, monkeypatch):
    """gloo ranks fork from a server started with the first pool: a later pool's ranks still
    take the driver's working folder, environment and sys.path as they are when it starts."""
    assert spawned.rank_processes("gloo").get_start_method() in ("forkserver", "spawn")
    assert spawned.rank_processes("nccl").get_start_method() == "spawn"
    with open_pool(2, backend="gloo") as pool:
        before = pool.run(WhereAmI("FO_TEST_LAUNCH_MARK", str(tmp_path)))
    assert before == [(os.getcwd(), None, False)] * 2
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FO_TEST_LAUNCH_MARK", "later")
    monkeypatch.syspath_prepend(str(tmp_path))
    with open_pool(2, backend="gloo") as pool:
        assert (
            pool.run(WhereAmI("FO_TEST_LAUNCH_MARK", str(tmp_path))) == [(str(tmp_path), "later", True)] * 2
        )


def test_a_dead_rank_ends_the_task():
    pool = SpawnedPool(2, backend="gloo")
    try:
        start = time.monotonic()
        with pytest.raises(LaunchError, match=r"rank 1 died during ExitOn \(exit code 3\)"):
            pool.run(ExitOn(rank=1, code=3), timeout_s=60)
        assert time.monotonic() - start < 30
    finally:
        pool.close()


def test_a_ctrl_c_is_the_drivers_to_handle_not_the_ranks():
    """A terminal's Ctrl-C reaches the driver and every rank (one process group): a rank that
    raised KeyboardInterrupt could report its failure before the driver its interrupt, ending the
    command as a failed rank (exit 1) instead of interrupted (130). The ranks leave it to the
    driver, which closes them; they still run tasks afterwards."""
    with open_pool(2, backend="gloo") as pool:
        assert pool.run(CtrlC(), timeout_s=60) == [0, 1]
        assert [r[0] for r in pool.run(RankAndSum())] == [0, 1]


def test_a_hung_rank_ends_the_task_at_the_timeout():
    pool = SpawnedPool(2, backend="gloo")
    try:
        start = time.monotonic()
        # a fractional --timeout is said as given (it read "within 0 s" for 0.5), with what to do
        with pytest.raises(
            LaunchError, match=r"rank\(s\) \[1\] did not finish SleepOn within 2.5 s .*a longer --timeout"
        ):
            pool.run(SleepOn(rank=1, seconds=4.5), timeout_s=2.5)
        assert time.monotonic() - start < 20  # the timeout, plus the pool's shutdown
        with pytest.raises(LaunchError, match="closed"):
            pool.run(RankAndSum())
    finally:
        pool.close()


KILLED_DRIVER = """
import sys, time

from fo_tune.ranks.spawned import SpawnedPool
from rank_tasks import Pid

if __name__ == "__main__":
    pool = SpawnedPool(2, "gloo")
    print(*pool.run(Pid()), flush=True)
    time.sleep(600)
"""


def test_ranks_leave_and_remove_the_pool_s_files_when_the_driver_is_killed(tmp_path, request):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(KILLED_DRIVER))
    # (the driver's temporary folder, short: the forkserver's socket path there has ~100 bytes)
    tmp = Path(tempfile.mkdtemp(prefix="fo-killed-"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        ranks = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(ranks) == 2 and any(p.name.startswith("fo-tune-pool-") for p in tmp.iterdir())
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (any(map(_running, ranks)) or any(tmp.iterdir())):
        time.sleep(0.2)
    assert not [pid for pid in ranks if _running(pid)], "a rank outlived its killed driver"
    assert not list(tmp.iterdir()), "the pool's files outlived its killed driver"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


DRIVER = """
import torch.distributed as dist

from fo_tune.ranks.launch import open_pool
from rank_tasks import RankAndSum

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
        str(free_port()),
        str(script),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULTS [(0, 2, 'gloo', 2.0), (1, 2, 'gloo', 2.0)]" in done.stdout, done.stdout
    assert done.stdout.count("SERVED") == 1, done.stdout


# ------------------------------------------------------------------------------ the backend rule
@pytest.mark.parametrize(
    ("gpus", "world", "backend", "want"),
    [
        (0, 2, None, "gloo"),
        (0, 2, "auto", "gloo"),
        (2, 2, None, "nccl"),
        (8, 2, "auto", "nccl"),
        (1, 2, "gloo", "gloo"),
        (2, 2, "nccl", "nccl"),
        (1, 1, None, "nccl"),
    ],
)
def test_choose_backend(monkeypatch, gpus, world, backend, want):
    monkeypatch.setattr(rank_backend, "visible_gpus", lambda: gpus)
    for key in rank_backend.TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    assert choose_backend(world, backend) == want


@pytest.mark.parametrize(("gpus", "backend"), [(0, None), (0, "auto"), (2, "gloo")])
def test_choose_backend_refuses_more_cpu_ranks_than_the_bound(monkeypatch, gpus, backend):
    monkeypatch.setattr(rank_backend, "visible_gpus", lambda: gpus)
    for key in rank_backend.TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    assert choose_backend(rank_backend.MAX_CPU_WORLD_SIZE, backend) == "gloo"
    with pytest.raises(
        ArgumentError, match=f"at most {rank_backend.MAX_CPU_WORLD_SIZE} ranks run without GPUs"
    ):
        choose_backend(rank_backend.MAX_CPU_WORLD_SIZE + 1, backend)


@pytest.mark.parametrize(("gpus", "backend"), [(1, None), (1, "auto"), (0, "nccl"), (1, "nccl")])
def test_choose_backend_refuses_too_few_gpus(monkeypatch, gpus, backend):
    """GPUs present but fewer than the ranks: gloo beside them is asked for, never picked."""
    monkeypatch.setattr(rank_backend, "visible_gpus", lambda: gpus)
    for key in rank_backend.TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    # the fix named fits: no --world-size to lower to without a GPU
    fix = "lower --world-size to 1, or use --backend gloo" if gpus else "; use --backend gloo"
    with pytest.raises(
        EnvironmentMismatchError, match=rf"world size 2 needs 2 GPU\(s\), {gpus} visible \(NCCL"
    ) as info:
        choose_backend(2, backend)
    assert fix in str(info.value) and (gpus or "lower" not in str(info.value)), info.value


def test_choose_backend_under_torchrun_and_bad_values(monkeypatch):
    for key, value in zip(rank_backend.TORCHRUN_VARS, ("0", "4", "0", "localhost"), strict=True):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(rank_backend, "visible_gpus", lambda: 1)  # the ranks may span hosts
    assert rank_backend.in_torchrun() and choose_backend(4) == "nccl"
    monkeypatch.setattr(rank_backend, "visible_gpus", lambda: 0)
    assert choose_backend(4) == "gloo"
    # torchrun started its ranks: the bound on the ranks this machine spawns does not apply
    assert choose_backend(rank_backend.MAX_CPU_WORLD_SIZE + 1, "gloo") == "gloo"
    with pytest.raises(ArgumentError, match="--backend 'mpi' is not one of auto, nccl, gloo"):
        choose_backend(2, "mpi")
    with pytest.raises(ArgumentError, match="--world-size: expected an integer >= 1, got 0"):
        choose_backend(0)


# ------------------------------------------------------------------------------ the fingerprint
@dataclasses.dataclass
class FakePool:
    """A driver pool whose ranks answer every task with the given fingerprints."""

    answers: list
    is_driver: bool = True
    world_size: int = 2
    backend: str = "gloo"

    def run(self, task, *, timeout_s=0.0):
        return list(self.answers)


def test_agreed_fingerprint_refuses_ranks_on_different_hardware():
    fp = current_fingerprint("cpu", 2)
    assert agreed_fingerprint(FakePool([fp, fp]), "bench") == fp
    other = dataclasses.replace(fp, device_key="nvidia-h200-cc90-132sm-w2-nvlink18")
    with pytest.raises(
        EnvironmentMismatchError, match=r"ranks see different hardware .*; search on identical"
    ):
        agreed_fingerprint(FakePool([fp, other]), "search")


def test_search_checks_that_its_ranks_agree(monkeypatch, tmp_path):
    """A measured search takes its ranks' fingerprint only when they agree (no rank is spawned)."""
    from fo_tune.search import SearchRequest, run_search

    fp = current_fingerprint("cpu", 2)
    other = dataclasses.replace(fp, device_key="other-key")

    @contextlib.contextmanager
    def fake_open_pool(world_size, *, backend=None):
        yield FakePool([fp, other])

    monkeypatch.setattr(launch, "open_pool", fake_open_pool)
    request = SearchRequest(
        shapes=((64, 96, 64),), mode="measure", backend="gloo", storage=f"sqlite:///{tmp_path / 's.db'}"
    )
    with pytest.raises(EnvironmentMismatchError, match="ranks see different hardware"):
        run_search(request)
