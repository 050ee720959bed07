"""Probe (temporary): how fast a K-split tail's float32 parts can be summed on one H200.

What a 128x256 K-split tail at 2048x4096x4096 on 124 programs would need (docs/perf-notes.md,
session 20, "What is left"): 8 tail tiles of 128x256 in p parts each. Three ways to sum them:
- fixup: one program per tail tile reads its p float32 parts (128 KB each) and writes the bf16 tile;
- sliced: F programs per tail tile, each summing 1/F of the tile's rows of the p parts;
- red: each part's program adds its float32 part into a zeroed tile (red.global.add, relaxed),
  so a finisher reads one tile (plus a memset of the 8 tiles per call).
Each kernel repeats its work REPS times inside (loads with .cg, so from L2, as the real parts
would be: 8 x p x 128 KB stays in the 50 MB L2), timed with CUDA events over graph replays.
Prints a table (us per repetition); writes $OUT/reduce_probe.csv.
"""

from __future__ import annotations

import csv
import os
import statistics

import torch
import triton
import triton.language as tl

BM, BN, TILES = 128, 256, 8
REPS = 20


@triton.jit
def fixup_kernel(
    parts_ptr,
    out_ptr,
    P: tl.constexpr,
    ROWS: tl.constexpr,
    F: tl.constexpr,
    REPS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    CH: tl.constexpr,
):
    """Program (tile, f): rows [f * ROWS, (f + 1) * ROWS) of tile's P parts summed, CH rows at a time."""
    pid = tl.program_id(0)
    tile = pid // F
    f = pid % F
    cols = tl.arange(0, BN)
    for _r in range(REPS):
        for c in range(ROWS // CH):
            rows = f * ROWS + c * CH + tl.arange(0, CH)
            off = rows[:, None] * BN + cols[None, :]
            acc = tl.zeros((CH, BN), tl.float32)
            for q in tl.static_range(P):
                acc += tl.load(parts_ptr + (tile * P + q) * (BM * BN) + off, cache_modifier=".cg")
            tl.store(out_ptr + tile * (BM * BN) + off, acc.to(tl.bfloat16))


@triton.jit
def red_kernel(
    part_ptr,
    acc_ptr,
    P: tl.constexpr,
    REPS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    CH: tl.constexpr,
):
    """Program (tile, q): its part (one float32 tile in registers, CH rows at a time) added into
    tile's accumulator with relaxed float32 atomics."""
    pid = tl.program_id(0)
    tile = pid // P
    cols = tl.arange(0, BN)
    for _r in range(REPS):
        for c in range(BM // CH):
            rows = c * CH + tl.arange(0, CH)
            off = rows[:, None] * BN + cols[None, :]
            x = tl.load(part_ptr + pid * (BM * BN) + off, cache_modifier=".cg")
            tl.atomic_add(acc_ptr + tile * (BM * BN) + off, x, sem="relaxed")


@triton.jit
def store_kernel(part_ptr, dst_ptr, REPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr):
    """Program q: its part stored to its own slot (what the parts cost today, for comparison)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    for _r in range(REPS):
        for c in range(BM // CH):
            rows = c * CH + tl.arange(0, CH)
            off = rows[:, None] * BN + cols[None, :]
            x = tl.load(part_ptr + pid * (BM * BN) + off, cache_modifier=".cg")
            tl.store(dst_ptr + pid * (BM * BN) + off, x + 1.0)


def timed(fn, calls: int = 10, rounds: int = 15) -> float:
    """Median ms of one call, from replays of a CUDA graph of ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows_out = []
    for p in (2, 4, 8, 15):
        parts = torch.randn(TILES * p, BM, BN, device=dev)
        ref = parts.view(TILES, p, BM, BN).sum(1)
        out = torch.empty(TILES, BM, BN, device=dev, dtype=torch.bfloat16)
        for f, warps, ch in ((1, 8, 16), (1, 8, 32), (4, 4, 16), (8, 4, 16)):
            rows = BM // f

            def run(reps, f=f, warps=warps, ch=ch, rows=rows):
                fixup_kernel[(TILES * f,)](parts, out, p, rows, f, reps, BM, BN, ch, num_warps=warps)

            out.fill_(float("nan"))
            run(1)
            torch.cuda.synchronize()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, ("fixup", p, f, err)
            us = timed(lambda: run(REPS)) / REPS * 1e3
            mb = p * BM * BN * 4 / f / 1e6
            rows_out.append(
                dict(
                    way=f"fixup F={f} w{warps} ch{ch}",
                    parts=p,
                    programs=TILES * f,
                    us=us,
                    gbs_per_program=mb / us * 1e3,
                )
            )
        acc = torch.zeros(TILES, BM, BN, device=dev)
        for warps, ch in ((8, 16), (4, 16)):

            def red(reps, warps=warps, ch=ch):
                red_kernel[(TILES * p,)](parts, acc, p, reps, BM, BN, ch, num_warps=warps)

            acc.zero_()
            red(1)
            torch.cuda.synchronize()
            err = ((acc - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-5, ("red", p, err)
            us = timed(lambda: red(REPS)) / REPS * 1e3
            rows_out.append(
                dict(
                    way=f"red w{warps} ch{ch}",
                    parts=p,
                    programs=TILES * p,
                    us=us,
                    gbs_per_program=BM * BN * 4 / 1e6 / us * 1e3,
                )
            )
        dst = torch.empty_like(parts)
        us = timed(lambda: store_kernel[(TILES * p,)](parts, dst, REPS, BM, BN, 16, num_warps=8)) / REPS * 1e3
        assert torch.equal(dst, parts + 1.0)
        rows_out.append(
            dict(
                way="store w8 ch16",
                parts=p,
                programs=TILES * p,
                us=us,
                gbs_per_program=BM * BN * 4 / 1e6 / us * 1e3,
            )
        )
        zero = torch.empty(TILES, BM, BN, device=dev)
        rows_out.append(
            dict(
                way="memset of the 8 tiles (1 MB)",
                parts=p,
                programs=0,
                us=timed(lambda: zero.zero_()) * 1e3,
                gbs_per_program=float("nan"),
            )
        )
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "reduce_probe.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows_out[0]))
        w.writeheader()
        w.writerows(rows_out)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for r in rows_out:
        print(
            f"{r['way']:30s} p={r['parts']:2d} programs={r['programs']:3d} {r['us']:8.2f} us "
            f"{r['gbs_per_program']:7.1f} GB/s a program"
        )


if __name__ == "__main__":
    main()
