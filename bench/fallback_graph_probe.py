"""The `overlap: false` fallback replayed from the runtime's own graphs vs GEMM then the collective (2 GPUs).

    python3 bench/fallback_graph_probe.py --out DIR [--shape MxNxK ...] [--collective C] [--rounds R]

Runs 64-65 (``docs/perf-notes.md``) timed the eager fallback at 1024x4096x4096 up to 1.5x slower
than the GPU work in a loop (66-69 us of host time a call against 80 us of GPU time); run 25 timed
cuBLAS then NCCL replayed from a graph 1.3-1.5x faster than eagerly at 512x4096x4096. Per shape
and collective, side by side (``time_interleaved``, the bench's 16 ms samples, max over ranks):

    seq        the bench's sequential variant: cuBLAS into a preallocated buffer, then the collective
    fo_eager   the op with an ``overlap: false`` schedule, its graphs off (every call issued eagerly)
    fo_graph   the same with the graphs on (from the GRAPH_AFTER_CALLS-th call of a key: replayed)
    fo_table   the op with ``schedule=None`` (the shipped table's row for the shape)

Each variant is checked against a float32 reference before timing and again after it, its last
output poisoned with NaN first (a replay that wrote nothing fails). Writes DIR/fallback_graph.csv
(appended case by case); prints a line per case and a summary last.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import (
    Progress,
    append_rows,
    case_options,
    cases,
    merge_checked,
    operands_and_reference,
    sequential_call,
)

from fo_kernels import gemm_all_reduce, gemm_reduce_scatter
from fo_kernels.graphs import GRAPH_AFTER_CALLS
from fo_kernels.runtime import runtime_for
from fo_kernels.schedule import Problem, Schedule
from fo_tune.harness import comparison_sample_ms, open_pool, time_interleaved
from fo_tune.launch import RankContext
from fo_tune.measure import GEMM_TOL, rel_err

# The shapes of the shipped tables' ``overlap: false`` rows (M 512-724 for every suite (N, K), and
# 725-1448 at 4096x4096), and 2048x4096x4096 (a suite shape whose row is the copy engine).
SHAPES = ((512, 4096, 4096), (1024, 4096, 4096), (512, 8192, 4096), (512, 8192, 8192), (512, 8192, 14336),
          (2048, 4096, 4096))  # fmt: skip


def recheck(call, ref: torch.Tensor) -> float:
    """``call``'s error with its previous output poisoned (a dropped output's block comes back)."""
    got = call()
    got.fill_(math.nan)
    del got
    err = rel_err(call(), ref)
    torch.cuda.synchronize()
    return err


class FallbackGraphTask:
    def __init__(self, collective: str, m: int, n: int, k: int, rounds: int) -> None:
        self.collective, self.shape, self.rounds = collective, (m, n, k), rounds

    def run(self, ctx: RankContext) -> dict:
        m, n, k = self.shape
        a, b, ref = operands_and_reference(ctx, m, n, k, self.collective)
        op = gemm_all_reduce if self.collective == "all_reduce" else gemm_reduce_scatter
        row = Schedule(
            collective=self.collective, dtype="bfloat16", world_size=ctx.world_size,
            problem=Problem(m=m, n=n, k=k), overlap=False,
        )  # fmt: skip
        graphs = runtime_for(ctx.device, None).fallback().graphs
        assert graphs is not None, "the fallback graphs need CUDA and NCCL"

        def fo(after: int):
            def call() -> torch.Tensor:
                graphs.after = after  # (both ranks run the same variant at a time)
                return op(a, b, schedule=row)

            return call

        seq, _, _ = sequential_call(self.collective, a, b, ctx.world_size)
        fns = {
            "seq": seq,
            "fo_eager": fo(0),
            "fo_graph": fo(GRAPH_AFTER_CALLS),
            "fo_table": lambda: op(a, b),
        }
        errs = {name: rel_err(fn(), ref) for name, fn in fns.items()}
        before = graphs.replays, graphs.calls
        timings = time_interleaved(
            fns, ctx.device, rounds=self.rounds, agree=True, min_sample_ms=comparison_sample_ms(True)
        )
        replays = (graphs.replays - before[0], graphs.calls - before[1])
        after = {name: recheck(fn, ref) for name, fn in fns.items()}
        graphs.after = GRAPH_AFTER_CALLS
        return {"timings": timings, "errs": errs, "after": after, "replays": replays}


def main() -> None:
    ap = case_options(__doc__.splitlines()[0], rounds=15, shapes="the tables' overlap: false shapes")
    args = ap.parse_args()
    shapes, collectives = cases(args, SHAPES)
    progress = Progress()
    csv_path = args.out / "fallback_graph.csv"
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for (m, n, k), collective in ((s, c) for s in shapes for c in collectives):
            per_rank = pool.run(FallbackGraphTask(collective, m, n, k, args.rounds))
            timings, errors, passed = merge_checked(per_rank, GEMM_TOL["bfloat16"])
            replays = min(r["replays"][0] for r in per_rank), max(r["replays"][1] for r in per_rank)
            rows = [
                dict(m=m, n=n, k=k, collective=collective, variant=name, passed=passed[name],
                     rel_err=errors[name], median_ms=t.median_ms, iqr_ms=t.iqr_ms, samples=t.samples)
                for name, t in timings.items()
            ]  # fmt: skip
            append_rows(csv_path, rows)
            ms = {name: t.median_ms for name, t in timings.items()}
            bad = [name for name, ok in passed.items() if not ok]
            progress.line(
                f"{m}x{n}x{k} {collective}: seq {ms['seq']:.4f} fo_eager {ms['fo_eager']:.4f} "
                f"fo_graph {ms['fo_graph']:.4f} fo_table {ms['fo_table']:.4f} ms; seq/fo_graph "
                f"{ms['seq'] / ms['fo_graph']:.2f}x seq/fo_eager {ms['seq'] / ms['fo_eager']:.2f}x "
                f"seq/fo_table {ms['seq'] / ms['fo_table']:.2f}x; fallback calls replayed "
                f"{replays[0]}/{replays[1]}" + (f"; FAILED {bad}" if bad else "")
            )
    progress.summary()


if __name__ == "__main__":
    main()
