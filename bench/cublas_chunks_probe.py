"""Chunked cuBLASLt GEMM with an SM carveout, each chunk's collective beside the next chunk's GEMM.

    torchrun --nproc-per-node 2 bench/cublas_chunks_probe.py --out DIR [--quick]

``bench/carveout_probe.py`` showed (one H200) that cuBLASLt honours
``torch._C._set_sm_carveout_experimental(r)``: its grid drops to ``sm_count - r`` and a 16-CTA kernel
on a second stream then runs beside it (launched together: max of the two, not the sum), while the
default cuBLAS path ignores the carveout. This probe asks whether that turns the hand-chunked
decomposition into a real overlap with NCCL. Per suite shape and collective, side by side in
alternating rounds (``time_interleaved``, max over ranks), every variant numerically checked first:

    seq            cuBLAS GEMM then the collective (the bench's sequential)
    seq_lt         the same through cuBLASLt
    chunk_c<C>     cuBLAS chunks, no carveout (the bench's chunked)
    lt_<w>_r<R>_c<CAP>
                   cuBLASLt chunks of relative row weights <w>, carveout R SMs, the collectives
                   on a high-priority NCCL communicator capped at CAP CTAs
Writes DIR/cublas_chunks_probe.csv; prints the best variants per case and a summary last.
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import SUITE_SHAPES, operands_and_reference

from fo_kernels.copy_engine import chunk_bounds
from fo_kernels.runtime import reduce_scatter_tensor, runtime_for
from fo_tune.harness import Timing, open_pool, time_interleaved
from fo_tune.launch import RankContext
from fo_tune.measure import rel_err

SHAPES = SUITE_SHAPES
WEIGHTS = ((1, 1), (1, 1, 1), (1, 1, 1, 1), (1,) * 6, (1,) * 8, (2, 1, 1), (4, 2, 1, 1), (3, 3, 2))
CARVE_CAP = ((8, 8), (16, 8), (16, 16), (24, 16), (24, 24), (32, 32))
QUICK_WEIGHTS = ((1, 1), (1, 1, 1, 1), (2, 1, 1))
QUICK_CARVE_CAP = ((16, 16), (24, 16))
TOLERANCE = 2e-2


def set_blas(library: str, carveout: int | None) -> None:
    torch.backends.cuda.preferred_blas_library(library)
    torch._C._set_sm_carveout_experimental(carveout)


class ProbeTask:
    def __init__(self, m: int, n: int, k: int, collective: str, quick: bool) -> None:
        self.m, self.n, self.k, self.collective, self.quick = m, n, k, collective, quick

    def run(self, ctx: RankContext) -> dict:
        m, n, k, w = self.m, self.n, self.k, ctx.world_size
        a, b, ref = operands_and_reference(ctx, m, n, k, self.collective)
        rt = runtime_for(ctx.device, None)
        side = rt.comm_stream
        main = torch.cuda.current_stream(ctx.device)
        fns = {}

        def sequential(library: str):
            full = torch.empty((m, n), dtype=a.dtype, device=ctx.device)
            out = (
                full
                if self.collective == "all_reduce"
                else torch.empty((m // w, n), dtype=a.dtype, device=ctx.device)
            )

            def run():
                set_blas(library, None)
                torch.mm(a, b, out=full)
                if self.collective == "all_reduce":
                    dist.all_reduce(full)
                else:
                    reduce_scatter_tensor(out, full)
                return out

            return run

        def chunked(weights, library, carveout, cap):
            group = rt.comm_group(cap)
            gemms, comms = [], []
            if self.collective == "all_reduce":
                out = torch.empty((m, n), dtype=a.dtype, device=ctx.device)
                for r0, r1 in itertools.pairwise(chunk_bounds(m, weights)):
                    gemms.append(functools.partial(torch.mm, a[r0:r1], b, out=out[r0:r1]))
                    comms.append(functools.partial(dist.all_reduce, out[r0:r1], group=group))
            else:
                shard = m // w
                a3, b3 = a.view(w, shard, k), b.expand(w, k, n)
                out = torch.empty((shard, n), dtype=a.dtype, device=ctx.device)
                for s0, s1 in itertools.pairwise(chunk_bounds(shard, weights)):
                    buf = torch.empty((w, s1 - s0, n), dtype=a.dtype, device=ctx.device)
                    gemms.append(functools.partial(torch.bmm, a3[:, s0:s1], b3, out=buf))
                    comms.append(
                        functools.partial(reduce_scatter_tensor, out[s0:s1], buf.view(-1, n), group=group)
                    )
            events = [torch.cuda.Event() for _ in gemms]

            def run():
                set_blas(library, carveout)
                side.wait_stream(main)
                for gemm, comm, ev in zip(gemms, comms, events, strict=True):
                    gemm()
                    ev.record(main)
                    with torch.cuda.stream(side):
                        side.wait_event(ev)
                        comm()
                main.wait_stream(side)
                return out

            return run

        fns["seq"] = sequential("cublas")
        fns["seq_lt"] = sequential("cublaslt")
        for c in (2, 4):
            fns[f"chunk_c{c}"] = chunked((1,) * c, "cublas", None, 0)
        weights = QUICK_WEIGHTS if self.quick else WEIGHTS
        pairs = QUICK_CARVE_CAP if self.quick else CARVE_CAP
        for wts, (r, cap) in itertools.product(weights, pairs):
            fns[f"lt_{'-'.join(map(str, wts))}_r{r}_c{cap}"] = chunked(wts, "cublaslt", r, cap)
        errs = {}
        for name, fn in fns.items():
            out = fn()
            out.fill_(float("nan"))
            out = fn()
            torch.cuda.synchronize()
            errs[name] = rel_err(out, ref)
        timings = time_interleaved(fns, ctx.device, rounds=12, agree=True)
        set_blas("cublas", None)
        return {"errs": errs, "timings": timings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rows = []
    summary = []
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for (m, n, k), coll in itertools.product(SHAPES, ("all_reduce", "reduce_scatter")):
            per_rank = pool.run(ProbeTask(m, n, k, coll, args.quick))
            names = list(per_rank[0]["timings"])
            merged = {x: Timing.max_over([r["timings"][x] for r in per_rank]) for x in names}
            errs = {x: max(r["errs"][x] for r in per_rank) for x in names}
            seq = merged["seq"].median_ms
            for x in names:
                ok = errs[x] == errs[x] and errs[x] < TOLERANCE
                rows.append(dict(
                    m=m, n=n, k=k, collective=coll, variant=x, status="PASS" if ok else "FAIL",
                    rel_err=errs[x], median_ms=merged[x].median_ms, iqr_ms=merged[x].iqr_ms,
                    speedup_vs_seq=seq / merged[x].median_ms,
                ))  # fmt: skip
            ok_names = [x for x in names if errs[x] == errs[x] and errs[x] < TOLERANCE]
            best = sorted(ok_names, key=lambda x: merged[x].median_ms)[:3]
            bad = [x for x in names if x not in ok_names]
            line = (
                f"{m}x{n}x{k} {coll}: seq {seq:.3f} seq_lt {merged['seq_lt'].median_ms:.3f} "
                f"chunk_c2 {merged['chunk_c2'].median_ms:.3f} "
                f"chunk_c4 {merged['chunk_c4'].median_ms:.3f} | best "
                + ", ".join(f"{x} {merged[x].median_ms:.3f} ({seq / merged[x].median_ms:.2f}x)" for x in best)
                + (f" | FAILED {bad}" if bad else "")
            )
            print(line, flush=True)
            summary.append(line)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "cublas_chunks_probe.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("SUMMARY")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
