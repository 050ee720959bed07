"""Timing on the ranks: back-to-back samples, their median and spread, variants side by side.

    t = time_region(fn, device)                   # warm-up, then samples of back-to-back calls
    ts = time_interleaved({"a": fa, "b": fb}, device, agree=True)   # alternating rounds
    ts = time_interleaved(fns, device, graphs=True)   # each sample one CUDA graph of its calls
    Timing.max_over(per_rank)                     # a measurement is the slowest rank's

CUDA events bracket each sample on the current stream; on the CPU ``perf_counter`` does. Tasks of
``fo_tune.ranks.launch`` call these on every rank at once, so ``agree=True`` (an all_reduce of the call
counts) keeps the ranks' collectives matched. Why samples are as long as they are:
docs/design.md#timing.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Timing:
    """Median, spread (max - min) and interquartile range of repeated measurements, in milliseconds.

    ``spread_ms`` shows the outliers; ``iqr_ms`` is the robust noise figure decisions use.
    """

    median_ms: float
    spread_ms: float
    samples: int
    iqr_ms: float = math.nan

    @staticmethod
    def max_over(per_rank: Sequence[Timing]) -> Timing:
        """The slowest rank's median (a collective is as slow as its slowest rank)."""
        worst = max(per_rank, key=lambda t: t.median_ms)
        iqr = max((t.iqr_ms for t in per_rank), key=lambda x: -math.inf if math.isnan(x) else x)
        return Timing(worst.median_ms, max(t.spread_ms for t in per_rank), worst.samples, iqr)


# A timed sample spans at least this long: back-to-back calls keep the GPU queue full, so a
# launch's host overhead (~0.09 ms for the persistent GEMM) is hidden behind queued work as it is in
# a real loop and in nccl-tests. Each sample still pays its first launch once: 4 ms keeps that under
# ~2% on the suite's 2 ms ops, where 1 ms samples of one call each cost the overlapped ops 0.1-0.2 ms
# more (docs/design.md#timing).
MIN_SAMPLE_MS = 4.0
# Most calls in one sample (tiny kernels would otherwise need thousands).
MAX_INNER = 64
# The sample length of the side-by-side comparisons that decide or report (the bench, a search's
# confirmation) on GPUs. A sample also pays its first call's host time on an idle GPU and any rank's
# late start once: over the ~15 calls of a 4 ms sample a 0.15 ms fo-tune call (2048x4096x4096
# AllReduce) read 0.164 ms, against 0.151-0.154 ms with 16 ms samples, while sequential moved by
# <= 2%. 16 ms also keeps the large shapes' calls back to back for ~8 calls, near a loop's
# power-limited clock (docs/design.md#timing, #power-limit). The search's many trials keep
# MIN_SAMPLE_MS.
STEADY_SAMPLE_MS = 16.0
# Warm-up calls on the CPU, whatever a caller asks: a GPU's warm-up loads and compiles kernels,
# picks library algorithms and raises clocks, while the CPU's only one-time cost (Triton's
# interpreter and gloo set up on first use) is paid by the first call; each further warm-up call of
# an interpreted op costs 0.1-0.5 s.
CPU_WARMUP = 1


def warmup_calls(warmup: int, device: torch.device) -> int:
    """The warm-up calls to make on ``device``: ``warmup``, at most ``CPU_WARMUP`` off the GPU."""
    return warmup if device.type == "cuda" else min(warmup, CPU_WARMUP)


def comparison_sample_ms(on_gpu: bool) -> float:
    """The sample length of a side-by-side comparison that decides or reports: ``STEADY_SAMPLE_MS``
    on GPUs, ``MIN_SAMPLE_MS`` on the CPU (where a call of Triton's interpreter outlasts both)."""
    return STEADY_SAMPLE_MS if on_gpu else MIN_SAMPLE_MS


def time_region(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup: int = 3,
    reps: int = 10,
    inner: int | None = None,
    agree: bool = False,
) -> Timing:
    """Time ``fn`` ``reps`` times after ``warmup`` calls (``warmup_calls``); each sample runs
    ``inner`` calls back to back (default: enough for ``MIN_SAMPLE_MS``) and reports the time per
    call.

    CUDA events bracket each sample on the current stream; on the CPU ``perf_counter`` does.
    ``agree``: ``fn`` is a collective, so every rank must make the same number of calls; the ranks
    take the largest ``inner`` (an all_reduce on the default group).
    """
    for _ in range(warmup_calls(warmup, device)):
        fn()
    if inner is None:
        one = _samples(fn, device, reps=1, inner=1)[0]
        inner = max(1, min(MAX_INNER, math.ceil(MIN_SAMPLE_MS / max(one, 1e-6))))
        if agree and dist.is_initialized():
            t = torch.tensor([inner], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            inner = int(t.item())
    return _timing(_samples(fn, device, reps=reps, inner=inner))


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    device: torch.device,
    *,
    warmup: int = 3,
    rounds: int = 10,
    agree: bool = False,
    align: bool = False,
    lead_ms: float = 0.0,
    min_sample_ms: float = MIN_SAMPLE_MS,
    graphs: bool = False,
    before_samples: Callable[[], Any] | None = None,
) -> dict[str, Timing]:
    """Time several variants side by side: each round takes one sample of every variant in turn
    (``inner`` back-to-back calls each, per variant as in ``time_region``, enough for
    ``min_sample_ms``), so a clock or thermal drift during the run moves them all alike instead of
    favouring whichever ran first; the order rotates every round and every other round runs
    backwards, so no variant always follows the same one.

    ``agree``: some variants run collectives; the ranks agree on every variant's ``inner``.
    ``align`` (with ``agree``): the ranks start every sample together (``_align``), so no
    rank's sample includes waiting for a peer still finishing its previous sample. ``lead_ms``: each
    sample's first call is queued behind a spin kernel of that length, outside the timed region, so
    the GPU does not idle while the host issues it (a loop's steady state; see ``_samples``).

    ``graphs`` (CUDA only): after the warm-up each variant's ``inner`` calls are captured into one
    CUDA graph (``capture_calls``) and a sample is one replay of it, so the host's time per call
    (Python, Triton's launch path) drops out and the GPU runs the calls back to back, as in a loop
    whose host keeps ahead or under a caller's graph: the GPU's own time. ``inner`` comes from one
    eager call, as without graphs: for a host-bound call that is its host time, so its samples
    hold fewer calls than ``min_sample_ms`` asks, never more. One capture a variant (entering
    ``torch.cuda.graph`` synchronizes and empties the allocator's cache). The calls must be
    capturable (no host synchronization); their outputs are the graph's, written at every replay.
    Not with ``align`` or ``lead_ms``, which act between a sample's host-issued calls.

    ``before_samples``: called once after the warm-up, the sizing calls and the captures, right
    before the first timed sample (a caller poisons its outputs there, so that what they hold
    afterwards is the timed calls' work).
    """
    if graphs and (align or lead_ms > 0):
        raise ValueError("graphs: a sample is one replay, so align and lead_ms do not apply")
    names = list(fns)
    inners = []
    for name in names:
        for _ in range(warmup_calls(warmup, device)):
            fns[name]()
        one = _samples(fns[name], device, reps=1, inner=1)[0]
        inners.append(max(1, min(MAX_INNER, math.ceil(min_sample_ms / max(one, 1e-6)))))
    if agree and dist.is_initialized() and names:
        t = torch.tensor(inners, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        inners = [int(x) for x in t.tolist()]
    align = align and agree and dist.is_initialized()
    # a sample: (what the host calls, how often): ``inner`` calls, or one replay of a graph of them
    sample_of = {
        name: (capture_calls(fns[name], inner, device), 1) if graphs else (fns[name], inner)
        for name, inner in zip(names, inners, strict=True)
    }
    if before_samples is not None:
        before_samples()
    samples: dict[str, list[float]] = {name: [] for name in names}
    order = list(zip(names, inners, strict=True))
    for r in range(rounds):
        shift = r % len(order) if order else 0  # each variant takes every place in the round in turn,
        turn = order[shift:] + order[:shift]  # and every other round runs backwards, so it follows
        for name, inner in turn if r % 2 == 0 else turn[::-1]:  # different neighbours too
            fn, issued = sample_of[name]
            got = _samples(fn, device, reps=1, inner=issued, align=align, lead_ms=lead_ms)
            samples[name].extend(x * issued / inner for x in got)  # ms per call of ``fns[name]``
    return {name: _timing(v) for name, v in samples.items()}


def capture_calls(fn: Callable[[], Any], calls: int, device: torch.device) -> Callable[[], None]:
    """``calls`` back-to-back calls of ``fn`` captured into one CUDA graph (after the caller's
    warm-up: compilation and first-call allocations stay outside): its ``replay``, one launch that
    issues them all on the current stream. Tensors ``fn`` allocates come from the graph's private
    pool and are reused at every replay. ValueError off CUDA devices (no graphs there)."""
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device.type}: time without graphs there")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # synchronizes, then captures on a side stream of torch's
        for _ in range(calls):
            fn()
    return graph.replay


def _timing(samples: list[float]) -> Timing:
    iqr = math.nan
    if len(samples) >= 2:
        q1, _, q3 = statistics.quantiles(samples, n=4)
        iqr = q3 - q1
    return Timing(statistics.median(samples), max(samples) - min(samples), len(samples), iqr)


def _align(device: torch.device) -> None:
    """Return when every rank has reached this point (a one-element all_reduce, then a
    synchronization): the ranks leave within a few microseconds of each other."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _samples(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    reps: int,
    inner: int,
    align: bool = False,
    lead_ms: float = 0.0,
) -> list[float]:
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        cycles_per_ms = torch.cuda.get_device_properties(device).clock_rate if lead_ms > 0 else 0  # kHz
        for _ in range(reps):
            if align:
                _align(device)
            if lead_ms > 0:  # the GPU spins (untimed) while the host issues the first call
                torch.cuda._sleep(int(lead_ms * cycles_per_ms))
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
    else:
        for _ in range(reps):
            if align:
                _align(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return samples
