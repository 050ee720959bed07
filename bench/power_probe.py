"""Is a sustained GEMM slower than one timed between lighter work? (one GPU, power and clocks)

    python3 bench/power_probe.py --out DIR [--shape MxNxK ...] [--seconds S]

Session 7 (``docs/perf-notes.md``, run 40) timed the same cuBLAS GEMM 16384x8192x4096 at 1.72 ms
in a probe whose other variants were all GEMM-heavy, and at 1.51 ms in the bench, where it is timed
between NCCL collectives and the sequential baseline. If the card's power limit lowers its clock
under a sustained GEMM, an overlapped call (which keeps the GEMM busy without pause) pays that
clock, while GEMM then the collective rests during the collective. This probe runs each shape's
bf16 GEMM for ``--seconds`` in three patterns and reports ms per GEMM (CUDA events over the span)
beside the SM clock and board power that ``nvidia-smi`` sampled meanwhile (every 50 ms):

- ``sustained``: GEMMs back to back;
- ``duty50``: a GEMM burst of ~4 ms, then an idle spin of the same length (``torch.cuda._sleep``),
  the bench's GEMM-then-collective rhythm with the collective's SMs idle;
- ``with_copies``: back to back beside 64 MiB device-to-device copies on another stream (the
  copy engine's HBM traffic in an overlapped call), to separate HBM contention from power.

Writes DIR/power.csv; prints one line per (shape, pattern) and a summary last. Needs
``nvidia-smi`` for the clock and power columns (left empty without it).
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import SUITE_SHAPES, Progress

# nvidia-smi's sampling period (ms) and the fields read (the SM clock in MHz, board power in W).
SAMPLE_MS = 50
QUERY = "clocks.sm,power.draw"
# A duty-cycle burst's GEMMs span about this long (the bench's samples span >= 4 ms).
BURST_MS = 4.0
COPY_BYTES = 64 << 20


class Sampler:
    """``nvidia-smi`` sampling one GPU in the background (each line stamped with the host time it
    arrived: nvidia-smi flushes a line per sample); ``window(t0, t1)`` is the mean SM clock (MHz)
    and power (W) of the samples between two ``time.time()`` stamps."""

    def __init__(self, index: int) -> None:
        self.proc = None
        self.rows: list[tuple[float, float, float]] = []
        if shutil.which("nvidia-smi") is None:
            return
        cmd = ["nvidia-smi", "-i", str(index), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        self.proc = subprocess.Popen([*cmd, f"-lms={SAMPLE_MS}"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.rows.append((time.time(), float(parts[0]), float(parts[1])))
            except (ValueError, IndexError):
                continue

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.thread.join(timeout=10)

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        inside = [(c, p) for t, c, p in self.rows if t0 <= t <= t1]
        if not inside:
            return float("nan"), float("nan")
        return statistics.fmean(c for c, _ in inside), statistics.fmean(p for _, p in inside)


def run_pattern(pattern: str, a: torch.Tensor, b: torch.Tensor, seconds: float, one_ms: float) -> float:
    """ms per GEMM over ``seconds`` of ``pattern``: CUDA events around each burst of GEMMs, so
    the idle spins of ``duty50`` are not counted."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=a.device).random_()
    dst = torch.empty_like(src)
    burst = max(1, round(BURST_MS / one_ms))
    cycles_per_ms = torch.cuda.get_device_properties(a.device).clock_rate  # kHz: cycles per ms
    bursts: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    deadline = time.time() + seconds
    while time.time() < deadline:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if pattern == "with_copies":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for _ in range(2 * burst):  # more copy time than GEMM time: copies all along
                    dst.copy_(src)
        e0.record()
        for _ in range(burst):
            torch.mm(a, b, out=out)
        e1.record()
        bursts.append((e0, e1))
        if pattern == "duty50":
            torch.cuda._sleep(int(burst * one_ms * cycles_per_ms))
        if len(bursts) % 8 == 0:  # the host stays a few bursts ahead, not seconds
            e1.synchronize()
    torch.cuda.synchronize()
    return sum(e0.elapsed_time(e1) for e0, e1 in bursts) / (len(bursts) * burst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", action="append", default=[], help="MxNxK (repeatable; default: the suite)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per (shape, pattern)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shape] or list(SUITE_SHAPES)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    progress = Progress()
    sampler = Sampler(device.index)
    spans = []
    gen = torch.Generator(device=device).manual_seed(7)
    for m, n, k in shapes:
        a = torch.randn((m, k), device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn((k, n), device=device, dtype=torch.bfloat16, generator=gen)
        for _ in range(3):
            torch.mm(a, b)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b)
        torch.cuda.synchronize()
        one_ms = (time.perf_counter() - t) / 5 * 1e3
        for pattern in ("duty50", "sustained", "with_copies"):
            t0 = time.time()
            ms = run_pattern(pattern, a, b, args.seconds, one_ms)
            spans.append((m, n, k, pattern, ms, t0 + 0.5, time.time()))  # (the first 0.5 s ramps)
            time.sleep(1.0)  # let the card settle between patterns
    sampler.stop()
    rows = []
    for m, n, k, pattern, ms, t0, t1 in spans:
        clock, power = sampler.window(t0, t1)
        rows.append(dict(m=m, n=n, k=k, pattern=pattern, ms_per_gemm=ms, sm_clock_mhz=clock, power_w=power))
        progress.line(f"{m}x{n}x{k} {pattern}: {ms:.3f} ms/GEMM, SM clock {clock:.0f} MHz, {power:.0f} W")
    with (args.out / "power.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    progress.summary()


if __name__ == "__main__":
    main()
