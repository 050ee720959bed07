"""The copy engine and cuBLAS-then-NCCL replayed from CUDA graphs, beside their eager calls (2 GPUs).

    python3 bench/ce_graph_probe.py --out DIR

Runs 19-21 (``docs/perf-notes.md``) showed the copy engine launch-bound below ~4k x 8k x 4k: ~0.2 ms
of host time a call. Serving stacks replay whole steps from CUDA graphs, which takes the host out;
an ``engine: copy_engine`` call can be captured after one eager call of its shape. This probe
times, per shape and collective, ``seq`` (cuBLAS then NCCL) and ``ce_c<C>`` eagerly and as graph
replays (``*_graph``: captured once on static operands), and ``ce_c<C>_auto``: eager calls through
the engine's own graphs (``graph_after`` = GRAPH_AFTER_CALLS; ``ce_c<C>`` sets it to 0, every call
issued op by op). Every variant is checked against a float32 reference before and after timing
(``time_interleaved``, max over ranks).

Writes DIR/graph.csv (appended case by case); prints one line per case and a summary last.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import (
    Progress,
    append_rows,
    graphed,
    merge_checked,
    operands_and_reference,
    sequential_call,
    shared_engine,
)

from fo_kernels.copy_engine import GRAPH_AFTER_CALLS
from fo_tune.harness import open_pool, time_interleaved
from fo_tune.launch import RankContext
from fo_tune.measure import rel_err

SHAPES = ((512, 4096, 4096), (2048, 4096, 4096), (4096, 8192, 4096))
CHUNKS = (1, 2)
TOLERANCE = 2e-2


class GraphTask:
    def __init__(self, m: int, n: int, k: int, collective: str) -> None:
        self.m, self.n, self.k, self.collective = m, n, k, collective

    def run(self, ctx: RankContext) -> dict:
        m, n, k, w = self.m, self.n, self.k, ctx.world_size
        a, b, ref = operands_and_reference(ctx, m, n, k, self.collective)
        seq = sequential_call(self.collective, a, b, w)[0]
        # the buffers may not grow once a graph is captured: size them for the largest shape
        peers = shared_engine(ctx.device, max((sm + 1) // 2 * sn for sm, sn, _ in SHAPES) * a.element_size())
        fns = {"seq": seq}

        def engine(weights: tuple[int, ...], graph_after: int):
            def call() -> torch.Tensor:
                peers.graph_after = graph_after  # both ranks run the same variant at a time
                return peers.run(self.collective, a, b, weights)

            return call

        for c in CHUNKS:
            fns[f"ce_c{c}"] = engine((1,) * c, 0)
        for name in list(fns):
            fns[f"{name}_graph"] = graphed(fns[name])
        for c in CHUNKS:
            fns[f"ce_c{c}_auto"] = engine((1,) * c, GRAPH_AFTER_CALLS)
        errs = {}
        for name, fn in fns.items():
            out = fn()
            torch.cuda.synchronize()
            errs[name] = rel_err(out, ref)
        timings = time_interleaved(fns, ctx.device, rounds=20, agree=True)
        after = {name: rel_err(fn(), ref) for name, fn in fns.items()}
        torch.cuda.synchronize()
        return {"errs": errs, "after": after, "timings": timings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for (m, n, k), coll in itertools.product(SHAPES, ("all_reduce", "reduce_scatter")):
            per_rank = pool.run(GraphTask(m, n, k, coll))
            merged, errors, passed = merge_checked(per_rank, TOLERANCE)
            rows, parts = [], []
            for x in merged:
                err, ok = errors[x], passed[x]
                t = merged[x].median_ms
                rows.append(dict(
                    m=m, n=n, k=k, collective=coll, variant=x, status="PASS" if ok else "FAIL",
                    rel_err=err, median_ms=t, iqr_ms=merged[x].iqr_ms,
                ))  # fmt: skip
                parts.append(f"{x} {t:.3f}{'' if ok else ' FAIL'}")
            append_rows(args.out / "graph.csv", rows)
            line = f"{m}x{n}x{k} {coll}: " + ", ".join(parts)
            progress.line(line)
    progress.summary()


if __name__ == "__main__":
    main()
