"""Timing on the ranks: the slowest rank's numbers, interleaved variants, aligned samples."""

from __future__ import annotations

import pytest

from fo_tune.ranks.launch import open_pool
from fo_tune.ranks.timing import Timing
from rank_tasks import SkewedSamples


def test_timing_max_over_takes_the_slowest_rank():
    t = Timing.max_over([Timing(1.0, 0.5, 10, 0.2), Timing(3.0, 0.1, 7, 0.05), Timing(2.0, 0.9, 10)])
    assert t == Timing(3.0, 0.9, 7, 0.2)


def test_the_cpu_warms_up_once_and_a_gpu_as_asked():
    """Off the GPU a call's one-time costs are paid by its first call: three warm-up calls asked
    for become ``CPU_WARMUP``, in time_region and time_interleaved alike; a GPU makes all three."""
    import torch

    from fo_tune.ranks.timing import CPU_WARMUP, time_interleaved, time_region, warmup_calls

    calls: list[str] = []
    time_region(lambda: calls.append("r"), torch.device("cpu"), warmup=3, reps=2, inner=1)
    assert len(calls) == CPU_WARMUP + 2 == 3
    calls.clear()
    time_interleaved(
        {"x": lambda: calls.append("x")}, torch.device("cpu"), warmup=3, rounds=2, min_sample_ms=0
    )
    assert len(calls) == CPU_WARMUP + 1 + 2  # the warm-up, the one-call probe, two one-call samples
    assert warmup_calls(3, torch.device("cuda", 0)) == 3 and warmup_calls(0, torch.device("cpu")) == 0


def test_time_interleaved_alternates_the_variants():
    """Each round samples every variant once, in order, so a drift hits them all alike. The
    variants sleep 2, 10 and 20 ms: each median is its sleep per call, within a late wake-up
    (a sleep never returns early; 7 ms is a loaded CI machine's margin)."""
    import time

    import torch

    from fo_tune.ranks.timing import time_interleaved

    sleep_ms = {"a": 2.0, "b": 10.0, "c": 20.0}
    calls: list[str] = []

    def variant(name: str):
        def fn() -> None:
            calls.append(name)
            time.sleep(sleep_ms[name] / 1e3)

        return fn

    fns = {name: variant(name) for name in sleep_ms}
    timings = time_interleaved(fns, torch.device("cpu"), warmup=1, rounds=4)
    assert set(timings) == {"a", "b", "c"}
    assert all(t.samples == 4 for t in timings.values())
    for name, ms in sleep_ms.items():
        assert ms <= timings[name].median_ms < ms + 7.0, (name, timings[name])
    # after the warm-ups and probes, the timed calls come in rounds: the order rotates each round
    # and every other round runs backwards
    timed = calls[6:]
    runs = [name for i, name in enumerate(timed) if i == 0 or timed[i - 1] != name]
    assert runs == ["a", "b", "c", "a", "c", "b", "c", "a", "b", "c", "b", "a"]


def test_time_interleaved_takes_longer_samples_on_request(monkeypatch):
    """``min_sample_ms`` sets the calls per sample: 1 ms calls, 3 ms samples -> 3 calls each. The
    clock is a stand-in that each call moves by exactly 1 ms, so a loaded machine's late wake-ups
    (a real 1 ms sleep can take 3 ms on CI) do not change the count."""
    import types

    import torch

    import fo_tune.ranks.timing as timing

    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    calls: list[int] = []

    def one_ms() -> None:
        calls.append(1)
        now[0] += 1e-3

    fns = {"x": one_ms}
    timings = timing.time_interleaved(fns, torch.device("cpu"), warmup=1, rounds=2, min_sample_ms=3.0)
    assert timings["x"].samples == 2
    assert abs(timings["x"].median_ms - 1.0) < 1e-9
    assert len(calls) == 1 + 1 + 2 * 3  # the warm-up, the one-call probe, two samples of three


def test_aligned_samples_leave_out_a_late_peer():
    """Rank 0 starts each all_reduce sample 60 ms before rank 1: unaligned, its median holds that
    wait; aligned (``align=True``), the ranks start together and it does not."""
    with open_pool(2, backend="gloo") as pool:
        (plain0, aligned0), (_, aligned1) = pool.run(SkewedSamples(late_ms=60.0))
    assert plain0 > 40.0, plain0
    assert aligned0 < 20.0 and aligned1 < 20.0, (aligned0, aligned1)


def test_graphed_samples_replay_one_capture_of_inner_calls(monkeypatch):
    """``graphs=True``: after the warm-up and one eager call (which sizes the samples) each
    variant's ``inner`` calls are captured once, and a sample is one replay, its time divided by
    ``inner``. ``capture_calls`` is replaced by a replay that runs the captured calls in a loop
    (the CPU has no CUDA graphs), on a clock each call moves by 1 ms."""
    import types

    import torch

    import fo_tune.ranks.timing as timing

    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    calls: list[str] = []
    captures: list[tuple[str, int]] = []

    def fake_capture(fn, count, device):
        captures.append((fn.__name__, count))

        def replay() -> None:
            for _ in range(count):
                fn()

        return replay

    monkeypatch.setattr(timing, "capture_calls", fake_capture)

    def one_ms() -> None:
        calls.append("a")
        now[0] += 1e-3

    def two_ms() -> None:
        calls.append("b")
        now[0] += 2e-3

    fns = {"a": one_ms, "b": two_ms}
    poison = lambda: calls.append("|")  # what a caller runs right before the samples
    cpu = torch.device("cpu")
    got = timing.time_interleaved(
        fns, cpu, warmup=1, rounds=3, min_sample_ms=4.0, graphs=True, before_samples=poison
    )
    assert captures == [("one_ms", 4), ("two_ms", 2)]
    assert calls.index("|") == 4 and calls.count("|") == 1  # after both warm-ups and sizing calls
    assert got["a"].samples == got["b"].samples == 3
    assert abs(got["a"].median_ms - 1.0) < 1e-9 and abs(got["b"].median_ms - 2.0) < 1e-9
    # the warm-up and the sizing call, then three replays of the 4-call (2-call) graph
    assert calls.count("a") == 1 + 1 + 3 * 4 and calls.count("b") == 1 + 1 + 3 * 2


def test_graphed_samples_need_a_cuda_device_and_no_host_pacing():
    import torch

    from fo_tune.ranks.timing import capture_calls, time_interleaved

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        capture_calls(lambda: None, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        time_interleaved({"x": lambda: None}, torch.device("cpu"), warmup=0, rounds=1, graphs=True)
    with pytest.raises(ValueError, match="align and lead_ms do not apply"):
        time_interleaved({"x": lambda: None}, torch.device("cpu"), graphs=True, lead_ms=1.0)
