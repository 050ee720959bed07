"""Host time of each step of an ``overlap: false`` call, one at a time (1 GPU, no collective).

    python3 bench/host_pieces_probe.py [--calls N]

Run 67 (``docs/perf-notes.md``) found the fallback replayed from its own graphs host-bound at
1024x4096x4096 ReduceScatter (~85 us of host time a call against ~80 us of GPU work). This times,
in a loop of ``--calls`` calls each (the GPU kept busy, nothing synchronizes), the torch and
fo_kernels calls that path makes, so the slow ones show. The table lookup reads
``FO_TUNE_TABLE_DIR`` (set it to the shipped tables for the lookup to hit a row). Prints microseconds
per call, slowest first.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fo_kernels.graphs import OutputPool
from fo_kernels.overlap import _check_operands
from fo_kernels.table import lookup_schedule


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    a = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    small_a, small_b = a[:64, :64].contiguous(), b[:64, :64].contiguous()
    out = torch.empty(64, 64, device=dev, dtype=torch.bfloat16)
    pool = OutputPool(dev)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        torch.matmul(small_a, small_b, out=out)
        graph.capture_begin(capture_error_mode="thread_local")
        torch.matmul(small_a, small_b, out=out)
        graph.capture_end()
    torch.cuda.synchronize()
    warnings.simplefilter("ignore")
    ptrs = lambda: (a.data_ptr(), b.data_ptr(), out.data_ptr(), a.stride(), b.stride())
    steps: dict[str, Callable[[], object]] = {
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(dev),
        "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "torch.is_grad_enabled": torch.is_grad_enabled,
        "torch.empty (64x64)": lambda: torch.empty((64, 64), dtype=torch.bfloat16, device=dev),
        "OutputPool.empty (64x64)": lambda: pool.empty((64, 64), torch.bfloat16),
        "CUDAGraph.replay (one small GEMM)": graph.replay,
        "torch.matmul out= (64x64x64)": lambda: torch.matmul(small_a, small_b, out=out),
        "_check_operands": lambda: _check_operands(a, b),
        "lookup_schedule": lambda: lookup_schedule(
            "reduce_scatter", 1024, 4096, 4096, dtype=a.dtype, world_size=2, device=dev
        ),
        "data_ptr x3, stride x2": ptrs,
    }
    rows = []
    for name, fn in steps.items():
        rows.append((per_call_us(fn, args.calls), name))
        torch.cuda.synchronize()
    print("SUMMARY (us per call, host)")
    for us, name in sorted(rows, reverse=True):
        print(f"{us:8.2f}  {name}")


if __name__ == "__main__":
    main()
