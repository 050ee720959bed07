"""The copy engine's chunk GEMMs on one stream or two, its sums copied per chunk or at the end (2 GPUs).

    python3 bench/ce_streams_probe.py --out DIR [--shape MxNxK ...] [--rounds R] [--collective C]
                                      [--exchange]

Session 6 (``docs/perf-notes.md``) left the cuBLAS-chunk engine 0.07-0.29 ms slower than the whole
GEMM alone on every suite shape, far more than the last chunk's exposed copies. One suspect: every
chunk is its own cuBLAS GEMM on one stream, so each chunk boundary waits for the GEMM's last,
partly filled wave to drain before the next chunk's first tile starts (4096x8192x4096 with weights
[2, 1] cuts chunks of ~683 rows: ~1.3 waves of 128x256 tiles, run as 2). With the chunks
alternating between two streams (``CopyEnginePeers.gemm_streams``), the next chunk's tiles fill
the SMs the last wave leaves. This probe times, per shape and collective, in one
``time_interleaved`` run (max over ranks):

- ``seq``: cuBLAS then NCCL, preallocated (the bench's sequential); ``gemm``: cuBLAS alone;
- ``cut_s1`` / ``cut_s2``: only the chunk GEMMs of the table's schedule (the engine's own row cuts,
  in its order: the peer's shard, then mine), plain GEMMs into one (M, N) output, replayed from a
  CUDA graph, on one stream or alternating two: what chunking costs without any copy;
- ``ce_s1``: the engine with the table's weights as session 6 left it: GEMMs on one stream, and for
  AllReduce my sums copied into the output chunk by chunk beside the remaining GEMMs;
- ``ce_s2_percopy`` (AllReduce): GEMMs on two streams, the sums copied chunk by chunk (the
  engine's default);
- ``ce_s2``: GEMMs on two streams, and for AllReduce the sums copied once after the last chunk
  (``own_copy_at_end``);
- ``ce_s2_c<C>``: ``ce_s2`` with C equal chunks per shard (does finer chunking pay now?);
- ``ex_s<S>_c<C>`` (``--exchange``, AllReduce, M <= 4096): the exchange mode, C chunks of all M
  rows, S streams.

Engine calls go through the engine's own CUDA graphs (the bench's steady state). Every variant is
checked against a float32 reference (the collective's, or the GEMM's for ``gemm`` and ``cut_*``)
on poisoned outputs before and after timing.

Writes DIR/streams.csv (appended case by case); prints one line per case and a summary last.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import (
    Progress,
    append_rows,
    case_options,
    cases,
    graphed,
    merge_checked,
    operands_and_reference,
    poisoned_error,
    sequential_call,
    shared_engine,
)

from fo_kernels.table import lookup_schedule
from fo_tune.harness import open_pool, time_interleaved
from fo_tune.launch import RankContext

EQUAL_CHUNKS = (2, 4, 8)
# AllReduce's exchange mode (``ex_s<S>_c<C>``, ``--exchange``: C chunks of all M rows, GEMMs on S
# streams), timed up to this M only: it lost on the larger suite shapes in session 6 (run 35), and
# at 2048x4096x4096 on one or two streams in run 42.
EXCHANGE_CHUNKS = (2, 4)
EXCHANGE_MAX_M = 4096
TOLERANCE = 2e-2


class StreamsTask:
    def __init__(
        self, m: int, n: int, k: int, collective: str, rounds: int, biggest: int, exchange: bool
    ) -> None:
        self.m, self.n, self.k, self.collective = m, n, k, collective
        self.rounds, self.biggest, self.exchange = rounds, biggest, exchange

    def run(self, ctx: RankContext) -> dict:
        m, n, k, w = self.m, self.n, self.k, ctx.world_size
        a, b, ref = operands_and_reference(ctx, m, n, k, self.collective)
        gemm_ref = a.float() @ b.float()
        peers = shared_engine(ctx.device, self.biggest)
        schedule = lookup_schedule(self.collective, m, n, k, dtype=a.dtype, world_size=w, device=ctx.device)
        weights = tuple(schedule.groups) if schedule.engine == "copy_engine" and schedule.overlap else (1, 1)
        fns = {"seq": sequential_call(self.collective, a, b, w)[0]}
        refs = {"seq": ref}
        full = torch.empty((m, n), dtype=a.dtype, device=a.device)
        fns["gemm"], refs["gemm"] = (lambda: torch.mm(a, b, out=full)), gemm_ref

        plan = peers._plan(self.collective, m, n, a.dtype, weights)
        cuts = [(plan.theirs[0] + r0, plan.theirs[0] + r1) for r0, r1 in plan.other]
        cuts += [(plan.mine[0] + r0, plan.mine[0] + r1) for r0, r1 in plan.own]
        alt = torch.cuda.Stream()

        def chunk_gemms(streams: int) -> torch.Tensor:
            here = torch.cuda.current_stream()
            if streams == 2:
                alt.wait_stream(here)
            for g, (r0, r1) in enumerate(cuts):
                with torch.cuda.stream(alt if streams == 2 and g % 2 else here):
                    torch.mm(a[r0:r1], b, out=full[r0:r1])
            if streams == 2:
                here.wait_stream(alt)
            return full

        for s in (1, 2):
            fns[f"cut_s{s}"], refs[f"cut_s{s}"] = graphed(lambda s=s: chunk_gemms(s)), gemm_ref

        def engine(
            cut_weights: tuple[int, ...], streams: int, exchange: bool = False, at_end: bool = True
        ) -> Callable:
            def call() -> torch.Tensor:
                peers.gemm_streams, peers.own_copy_at_end = streams, at_end
                return peers.run(self.collective, a, b, cut_weights, exchange=exchange)

            return call

        fns["ce_s1"], refs["ce_s1"] = engine(weights, 1, at_end=False), ref  # session 6's engine
        if self.collective == "all_reduce":  # (only all_reduce copies its sums locally)
            fns["ce_s2_percopy"], refs["ce_s2_percopy"] = engine(weights, 2, at_end=False), ref
        fns["ce_s2"], refs["ce_s2"] = engine(weights, 2), ref
        for c in EQUAL_CHUNKS:
            fns[f"ce_s2_c{c}"], refs[f"ce_s2_c{c}"] = engine((1,) * c, 2), ref
        if self.collective == "all_reduce" and self.exchange and m <= EXCHANGE_MAX_M:
            for s, c in itertools.product((1, 2), EXCHANGE_CHUNKS):
                fns[f"ex_s{s}_c{c}"], refs[f"ex_s{s}_c{c}"] = engine((1,) * c, s, exchange=True), ref
        rows = m if self.collective == "all_reduce" else m // w

        def checked(name: str) -> float:
            return poisoned_error(fns[name], refs[name], full, peers, rows)

        errs = {name: checked(name) for name in fns}
        timings = time_interleaved(fns, ctx.device, rounds=self.rounds, agree=True)
        after = {name: checked(name) for name in fns}
        return {
            "errs": errs, "after": after, "timings": timings, "weights": weights,
            "replays": peers.replays, "graph_failure": peers.graph_failure,
        }  # fmt: skip


def main() -> None:
    ap = case_options(__doc__.splitlines()[0])
    ap.add_argument("--exchange", action="store_true", help="also the exchange mode (AllReduce, M <= 4096)")
    args = ap.parse_args()
    shapes, collectives = cases(args)
    biggest = max(m * n for m, n, _ in shapes)  # bf16 bytes of the largest shard (M/2 rows)
    progress = Progress()
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for m, n, k in shapes:
            for coll in collectives:
                task = StreamsTask(m, n, k, coll, args.rounds, biggest, args.exchange)
                per_rank = pool.run(task, timeout_s=600)
                merged, errors, passed = merge_checked(per_rank, TOLERANCE)
                weights = per_rank[0]["weights"]
                failure = per_rank[0]["graph_failure"]
                rows, parts = [], []
                seq = merged["seq"].median_ms
                for x in merged:
                    t = merged[x].median_ms
                    rows.append(dict(
                        m=m, n=n, k=k, collective=coll, variant=x, table_weights=" ".join(map(str, weights)),
                        status="PASS" if passed[x] else "FAIL", rel_err=errors[x], median_ms=t,
                        iqr_ms=merged[x].iqr_ms, speedup_vs_seq=seq / t,
                    ))  # fmt: skip
                    parts.append(f"{x} {t:.3f}{'' if passed[x] else ' FAIL'}")
                append_rows(args.out / "streams.csv", rows)
                s1, s2 = merged["ce_s1"].median_ms, merged["ce_s2"].median_ms
                line = (
                    f"{m}x{n}x{k} {coll} w{list(weights)}: ce_s1 {seq / s1:.2f}x ce_s2 {seq / s2:.2f}x | "
                    + ", ".join(parts)
                    + (f" | graph failure: {failure}" if failure else "")
                )
                progress.line(line)
    progress.summary()


if __name__ == "__main__":
    main()
