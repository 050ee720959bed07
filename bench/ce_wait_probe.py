"""The copy engine's costs on 2 GPUs: the flag latency, and the engine's GPU and host time per call.

    python3 bench/ce_wait_probe.py --out DIR [--quick]

Session 3 measured ~0.1-0.16 ms per extra chunk of ``engine: copy_engine`` where the GEMM of a
chunk is 0.03 ms (``docs/perf-notes.md``, runs 12-14), and one schedule's speed flipping between
device sessions. This probe measures, in one call:

1. ``latency``: a flag ping-pong between the two GPUs (``cuStreamWriteValue32`` to the peer, then
   ``cuStreamWaitValue32`` for the answer and a reset), 200 round trips. Half a round trip is the
   one-way latency.
2. ``engine``: ``fo_kernels.copy_engine.CopyEnginePeers`` per shape, collective and chunk count,
   beside cuBLAS then NCCL (``seq``), each checked against a float32 reference before and after
   timing (``time_interleaved``, max over ranks), and each variant's host time per call (``host_us``:
   the CPU time to issue 30 back-to-back calls; a call whose host time exceeds its GPU time is
   launch-bound).

Run 17 ran this probe with two more engine options, since removed (both were slower): spin-kernel
waits and a cuBLASLt SM carveout (commit ``9ac9206``, ``results/bench/<x2 key>/probes/``).

Writes DIR/latency.csv and DIR/engine.csv (appended case by case, so a timeout keeps what was done),
prints one line per case as it goes and a summary last.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import (
    SUITE_SHAPES,
    Progress,
    append_rows,
    merge_checked,
    operands_and_reference,
    sequential_call,
)

from fo_kernels.copy_engine import PARTIAL, CopyEnginePeers
from fo_tune.harness import open_pool, time_interleaved
from fo_tune.launch import RankContext
from fo_tune.measure import rel_err

SHAPES = ((512, 4096, 4096), *SUITE_SHAPES)  # a launch-bound shape, then the suite
CHUNKS = (1, 2, 3, 4)
ROUND_TRIPS = 200
HOST_CALLS = 30
TOLERANCE = 2e-2

# one CopyEnginePeers per rank process, reused across cases (it holds symmetric buffers; making one
# per case would allocate and rendezvous every time)
_PEERS: dict[str, CopyEnginePeers] = {}


def peers_for(device: torch.device) -> CopyEnginePeers:
    if "engine" not in _PEERS:
        _PEERS["engine"] = CopyEnginePeers(device=device)
    return _PEERS["engine"]


class LatencyTask:
    """Flag ping-pong between the two ranks through a fresh peers object's first flag slot."""

    def run(self, ctx: RankContext) -> dict:
        peers = CopyEnginePeers(device=ctx.device)  # fresh flags, from 0
        stream = torch.cuda.current_stream(ctx.device)
        handle = peers._stream(stream.cuda_stream)
        results = []
        for _ in range(3):  # the first repetition warms up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            torch.cuda.synchronize()
            start.record(stream)
            for _ in range(ROUND_TRIPS):
                if ctx.rank == 0:
                    peers._signal(handle, PARTIAL)
                    peers._wait(handle, PARTIAL)
                else:
                    peers._wait(handle, PARTIAL)
                    peers._signal(handle, PARTIAL)
            end.record(stream)
            end.synchronize()
            results.append(start.elapsed_time(end) * 1000 / ROUND_TRIPS)  # us per round trip
        return {"round_trip_us": results[1:]}


class EngineTask:
    def __init__(self, m: int, n: int, k: int, collective: str) -> None:
        self.m, self.n, self.k, self.collective = m, n, k, collective

    def run(self, ctx: RankContext) -> dict:
        m, n, k, w = self.m, self.n, self.k, ctx.world_size
        a, b, ref = operands_and_reference(ctx, m, n, k, self.collective)
        seq, seq_full, seq_out = sequential_call(self.collective, a, b, w)
        fns = {"seq": seq}
        peers = peers_for(ctx.device)
        for c in CHUNKS:
            fns[f"ce_c{c}"] = lambda wts=(1,) * c: peers.run(self.collective, a, b, wts)
        errs, notes = {}, {}
        out_rows = m if self.collective == "all_reduce" else m // w
        for name, fn in fns.items():  # every rank runs every variant: no early exit (a hang)
            self.poison(seq_full, seq_out, (out_rows, n), ctx.device)
            out = fn()
            torch.cuda.synchronize()
            errs[name] = rel_err(out, ref)
            for _ in range(2):
                out = fn()
            torch.cuda.synchronize()
            errs[name] = max(errs[name], rel_err(out, ref))
        timings = time_interleaved(fns, ctx.device, rounds=15, agree=True)
        after = {name: rel_err(fn(), ref) for name, fn in fns.items()}
        host = {}
        for name, fn in fns.items():
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(HOST_CALLS):
                fn()
            host[name] = (time.perf_counter() - start) * 1e6 / HOST_CALLS
        torch.cuda.synchronize()
        return {"errs": errs, "after": after, "timings": timings, "notes": notes, "host": host}

    @staticmethod
    def poison(seq_full, seq_out, out_shape, device) -> None:
        """NaN in every buffer a variant might read stale data from: the sequential outputs, the
        engines' symmetric buffers (0xFF bytes are NaN in bf16) and the allocator block the next
        output will likely get (a freed NaN tensor of the same size)."""
        torch.cuda.synchronize()
        dist.barrier()
        seq_full.fill_(float("nan"))
        seq_out.fill_(float("nan"))
        for peers in _PEERS.values():  # (none before the first case)
            for buf in (peers._part, peers._final):
                if buf is not None:
                    buf.fill_(255)
        junk = torch.full(out_shape, float("nan"), dtype=torch.bfloat16, device=device)
        del junk
        torch.cuda.synchronize()
        dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="two shapes only (a smoke run)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        per_rank = pool.run(LatencyTask())
        rt = [max(vals) for vals in zip(*(r["round_trip_us"] for r in per_rank), strict=True)]
        append_rows(
            args.out / "latency.csv",
            [{"wait": "stream_wait", "repeat": i, "round_trip_us": v} for i, v in enumerate(rt)],
        )
        line = f"latency: round trip {', '.join(f'{v:.1f}' for v in rt)} us"
        progress.line(line)
        shapes = SHAPES[:2] if args.quick else SHAPES
        for (m, n, k), coll in itertools.product(shapes, ("all_reduce", "reduce_scatter")):
            per_rank = pool.run(EngineTask(m, n, k, coll))
            merged, errors, passed = merge_checked(per_rank, TOLERANCE)
            names = list(merged)
            seq = merged["seq"].median_ms
            rows, parts = [], []
            for x in names:
                err, ok = errors[x], passed[x]
                t = merged[x].median_ms
                host = max(r["host"][x] for r in per_rank)
                rows.append(dict(
                    m=m, n=n, k=k, collective=coll, variant=x, status="PASS" if ok else "FAIL",
                    rel_err=err, median_ms=t, iqr_ms=merged[x].iqr_ms, speedup_vs_seq=seq / t,
                    host_us=host,
                ))  # fmt: skip
                parts.append(f"{x} {t:.3f}{'' if ok else ' FAIL'} (host {host:.0f}us)")
            append_rows(args.out / "engine.csv", rows)
            best = min((x for x in names if x != "seq"), key=lambda x: merged[x].median_ms)
            line = (
                f"{m}x{n}x{k} {coll}: seq {seq:.3f}, best {best} {merged[best].median_ms:.3f} "
                f"({seq / merged[best].median_ms:.2f}x) | " + ", ".join(parts)
            )
            progress.line(line)
    progress.summary()


if __name__ == "__main__":
    main()
