"""Do the table's copy-engine rows replay from the engine's own CUDA graphs? (2 GPUs)

    python3 bench/ce_replay_check.py [--shape MxNxK ...] [--calls N]

Run 36's bench timed the new tiled and exchange rows at 2048x4096x4096 ~50% slower than its own
search had (0.166 vs 0.114 ms ReduceScatter), as if every call were issued eagerly. Per shape and
collective this calls ``gemm_all_reduce`` / ``gemm_reduce_scatter`` (the table's row) ``--calls``
times on one operand pair, checks the last result against a float32 reference, and prints the
engine's replay count, why a capture failed (``graph_failure``) and the mean time per call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import operands_and_reference

from fo_kernels import gemm_all_reduce, gemm_reduce_scatter, lookup_schedule
from fo_kernels.runtime import runtime_for
from fo_tune.harness import open_pool
from fo_tune.launch import RankContext
from fo_tune.measure import rel_err


class ReplayTask:
    def __init__(self, m: int, n: int, k: int, collective: str, calls: int) -> None:
        self.m, self.n, self.k, self.collective, self.calls = m, n, k, collective, calls

    def run(self, ctx: RankContext) -> dict:
        m, n, k = self.m, self.n, self.k
        a, b, ref = operands_and_reference(ctx, m, n, k, self.collective)
        op = gemm_all_reduce if self.collective == "all_reduce" else gemm_reduce_scatter
        row = lookup_schedule(self.collective, m, n, k, dtype="bfloat16", world_size=2, device=ctx.device)
        engine = runtime_for(ctx.device, None).copy_engine()
        before = engine.replays
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(self.calls):
            out = op(a, b)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / self.calls
        return dict(
            row=row.describe(), err=rel_err(out, ref), replays=engine.replays - before,
            graph_after=engine.graph_after, failure=engine.graph_failure, ms=ms,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[], help="MxNxK (default 2048x4096x4096)")
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shape] or [(2048, 4096, 4096)]
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for m, n, k in shapes:
            for coll in ("all_reduce", "reduce_scatter"):
                for rank, r in enumerate(pool.run(ReplayTask(m, n, k, coll, args.calls))):
                    print(
                        f"{m}x{n}x{k} {coll} rank{rank}: {r['row']}; err {r['err']:.2e}, "
                        f"{r['replays']}/{args.calls} replayed, graph_after {r['graph_after']}, "
                        f"{r['ms']:.3f} ms/call{', failure: ' + r['failure'] if r['failure'] else ''}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
