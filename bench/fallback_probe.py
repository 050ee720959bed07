"""Why does fo-tune's ``overlap: false`` path time slower than the bench's sequential variant?

    torchrun --nproc-per-node 2 bench/fallback_probe.py --out DIR

Both are cuBLAS then one NCCL AllReduce on the default group. The candidates, timed side by side
(``time_interleaved``, alternating rounds, max over ranks) on the same shape:

    prealloc      torch.mm(a, b, out=full); all_reduce(full)       (the bench's sequential)
    alloc         full = a @ b; all_reduce(full)                   (fresh output per call)
    fo_false      gemm_all_reduce(a, b, schedule=<overlap: false>)  (the runtime's fallback)
    prealloc_b2   as prealloc on the second operand set the bench gives fo-tune
    fo_false_b2   as fo_false on that second set
    fo_table      gemm_all_reduce(a2, b2) with the table's row (FO_TUNE_TABLE_DIR), as the bench calls it
Writes DIR/fallback_probe.csv and prints one line per shape.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fo_kernels.overlap import gemm_all_reduce
from fo_kernels.schedule import Problem, Schedule
from fo_tune.harness import Timing, open_pool, time_interleaved
from fo_tune.launch import RankContext
from fo_tune.measure import gemm_operands

SHAPES = ((2048, 4096, 4096), (8192, 8192, 8192))


class ProbeTask:
    def __init__(self, m: int, n: int, k: int) -> None:
        self.shape = (m, n, k)

    def run(self, ctx: RankContext) -> dict[str, Timing]:
        m, n, k = self.shape
        a, b = gemm_operands(m, n, k, "bfloat16", ctx.device, 11 + ctx.rank)
        a2, b2 = gemm_operands(m, n, k, "bfloat16", ctx.device, 999 + ctx.rank)
        full = torch.empty((m, n), dtype=a.dtype, device=a.device)
        full2 = torch.empty_like(full)
        off = Schedule(
            collective="all_reduce", dtype="bfloat16", world_size=ctx.world_size,
            problem=Problem(m=m, n=n, k=k), overlap=False,
        )  # fmt: skip

        def prealloc() -> None:
            torch.mm(a, b, out=full)
            dist.all_reduce(full)

        def alloc() -> None:
            dist.all_reduce(a @ b)

        def prealloc_b2() -> None:
            torch.mm(a2, b2, out=full2)
            dist.all_reduce(full2)

        fns = {
            "prealloc": prealloc,
            "alloc": alloc,
            "fo_false": lambda: gemm_all_reduce(a, b, schedule=off),
            "prealloc_b2": prealloc_b2,
            "fo_false_b2": lambda: gemm_all_reduce(a2, b2, schedule=off),
            "fo_table": lambda: gemm_all_reduce(a2, b2),
        }
        return time_interleaved(fns, ctx.device, rounds=15, agree=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for m, n, k in SHAPES:
            per_rank = pool.run(ProbeTask(m, n, k))
            merged = {name: Timing.max_over([r[name] for r in per_rank]) for name in per_rank[0]}
            row = {"shape": f"{m}x{n}x{k}", **{f"{name}_ms": t.median_ms for name, t in merged.items()}}
            rows.append(row)
            print(
                ", ".join(
                    f"{key} {val:.4f}" if isinstance(val, float) else f"{val}" for key, val in row.items()
                )
            )
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "fallback_probe.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
