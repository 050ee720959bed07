"""GEMM + ReduceScatter / AllReduce on 2 NVLink GPUs with the communication on the copy engines.

    torchrun --nproc-per-node 2 bench/ce_probe.py --out DIR

The NCCL variants measured so far lose to interference: NCCL's kernels need SMs, and beside a GEMM
both slow down (``docs/perf-notes.md``). This probe moves the data with the copy engines instead,
which use no SM, and folds the reduction into cuBLAS's ``beta = 1`` epilogue:

    rank r owns shard r (rows [r*S, (r+1)*S) of the output, S = M/2).
    phase 1  on the main stream, the GEMM of the peer's shard, chunk by chunk, into a symmetric
             buffer ``part``; after each chunk a flag is written into the peer's memory
             (``cuStreamWriteValue32``, no SM);
    pull     on a second stream, per chunk: wait for the peer's flag (``cuStreamWaitValue32``),
             copy the peer's partial of my shard into my output (a device-to-device copy of a
             peer-mapped buffer: the copy engine);
    phase 2  on the main stream, per chunk: ``out[c].addmm_(A_own[c], B)``: my partial plus the
             peer's, summed by the GEMM's epilogue.
    AllReduce adds a gather: each finished chunk is flagged and the peer copies it (copy engine).

Variants, side by side (``time_interleaved``, max over ranks), each checked against a float32
reference first: ``seq`` (cuBLAS then NCCL), ``async_tp`` (ReduceScatter), ``ce_c<C>`` (C chunks
per shard). Writes DIR/ce_probe.csv; prints one line per case and a summary last.

``CEOverlap`` is the prototype that run 12 measured (docs/perf-notes.md); the runtime's
``fo_kernels.copy_engine.CopyEnginePeers`` grew out of it (buffer growth, the gather's local copies
on their own stream, rank agreement) and is what tables and the bench use. Kept as run 12's record.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import SUITE_SHAPES, merge_checked, operands_and_reference, sequential_call

from fo_kernels.wait import StreamWaiter, _driver_module
from fo_tune.harness import open_pool, time_interleaved
from fo_tune.launch import RankContext
from fo_tune.measure import rel_err

SHAPES = SUITE_SHAPES
CHUNKS = (1, 2, 4, 8)
TOLERANCE = 2e-2
# flags: [0, C) partial chunk c ready, [C, 2C) final chunk c ready, DONE: the peer finished reading.
MAX_CHUNKS = 64
DONE = 2 * MAX_CHUNKS


class CEOverlap:
    """One (shape, collective, chunk count) of the copy-engine scheme on this rank (world size 2)."""

    def __init__(self, m: int, n: int, k: int, collective: str, chunks: int, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        self.SymmetricMemory = torch._C._distributed_c10d._SymmetricMemory
        self.m, self.n, self.collective = m, n, collective
        self.rank, self.peer = dist.get_rank(), 1 - dist.get_rank()
        self.shard = m // 2
        s = self.shard
        self.bounds = [i * s // chunks for i in range(chunks + 1)]
        group = dist.group.WORLD
        bf16 = torch.bfloat16
        self.part = symm_mem.empty((s, n), dtype=bf16, device=device)
        self.peer_part = symm_mem.rendezvous(self.part, group).get_buffer(self.peer, (s, n), bf16)
        self.final = self.peer_final = None
        if collective == "all_reduce":
            self.final = symm_mem.empty((s, n), dtype=bf16, device=device)
            self.peer_final = symm_mem.rendezvous(self.final, group).get_buffer(self.peer, (s, n), bf16)
        self.flags = symm_mem.empty((DONE + 1,), dtype=torch.uint32, device=device)
        self.flags.zero_()
        self.peer_flags = symm_mem.rendezvous(self.flags, group).get_buffer(
            self.peer, (DONE + 1,), torch.uint32
        )
        torch.cuda.synchronize()
        dist.barrier()
        self.waiter = StreamWaiter(_driver_module())
        self.side = torch.cuda.Stream(device, priority=-1)
        self.epoch = 0
        n_chunks = len(self.bounds) - 1
        self.pulled = [torch.cuda.Event() for _ in range(n_chunks)]
        self.summed = [torch.cuda.Event() for _ in range(n_chunks)]

    def signal(self, index: int, value: int) -> None:
        self.SymmetricMemory.stream_write_value32(self.peer_flags, index, value)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        e = self.epoch + 1
        s, n, me, peer = self.shard, self.n, self.rank, self.peer
        out = torch.empty(
            (self.m if self.collective == "all_reduce" else s, n), dtype=a.dtype, device=a.device
        )
        dst = self.final if self.collective == "all_reduce" else out
        main, side = torch.cuda.current_stream(a.device), self.side
        if e > 1:  # the peer has finished reading my buffers of the previous call
            self.waiter.wait(self.flags, DONE, e - 1)
        side.wait_stream(main)
        chunks = list(itertools.pairwise(self.bounds))
        for c, (r0, r1) in enumerate(chunks):  # phase 1: the peer's shard
            torch.mm(a[peer * s + r0 : peer * s + r1], b, out=self.part[r0:r1])
            self.signal(c, e)
        with torch.cuda.stream(side):  # pull the peer's partials of my shard
            for c, (r0, r1) in enumerate(chunks):
                self.waiter.wait(self.flags, c, e)
                dst[r0:r1].copy_(self.peer_part[r0:r1])
                self.pulled[c].record(side)
        for c, (r0, r1) in enumerate(chunks):  # phase 2: my shard, summed in the epilogue
            main.wait_event(self.pulled[c])
            dst[r0:r1].addmm_(a[me * s + r0 : me * s + r1], b)
            if self.collective == "all_reduce":
                self.signal(MAX_CHUNKS + c, e)
                self.summed[c].record(main)
        if self.collective == "all_reduce":
            with torch.cuda.stream(side):  # gather: the peer's sums, and mine into the output
                for c, (r0, r1) in enumerate(chunks):
                    self.waiter.wait(self.flags, MAX_CHUNKS + c, e)
                    out[peer * s + r0 : peer * s + r1].copy_(self.peer_final[r0:r1])
                    side.wait_event(self.summed[c])
                    out[me * s + r0 : me * s + r1].copy_(self.final[r0:r1])
        with torch.cuda.stream(side):
            self.signal(DONE, e)
        main.wait_stream(side)
        self.epoch = e
        return out


def trace_kinds(fn) -> dict[str, int]:
    """Counts of CUDA kernels and memcpy operations one call of ``fn`` issues (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kinds: dict[str, int] = {}
    for ev in events:
        cat = ev.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kinds[cat] = kinds.get(cat, 0) + 1
    return kinds


class ProbeTask:
    def __init__(self, m: int, n: int, k: int, collective: str) -> None:
        self.m, self.n, self.k, self.collective = m, n, k, collective

    def run(self, ctx: RankContext) -> dict:
        m, n, k, w = self.m, self.n, self.k, ctx.world_size
        a, b, ref = operands_and_reference(ctx, m, n, k, self.collective)
        fns = {}
        fns["seq"] = sequential_call(self.collective, a, b, w)[0]
        if self.collective == "reduce_scatter":
            from torch.distributed import _symmetric_memory as symm_mem

            name = dist.group.WORLD.group_name
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(name)
            op = torch.ops.symm_mem.fused_matmul_reduce_scatter
            fns["async_tp"] = lambda: op(a, b, "sum", 0, name)
        notes = {}
        for c in CHUNKS:
            try:
                ce = CEOverlap(m, n, k, self.collective, c, ctx.device)
                fns[f"ce_c{c}"] = lambda ce=ce: ce(a, b)
            except Exception as exc:  # a probe reports what failed and goes on
                notes[f"ce_c{c}"] = f"{type(exc).__name__}: {exc}"[:300]
        errs = {}
        for name, fn in list(fns.items()):
            try:
                for _ in range(3):
                    out = fn()
                torch.cuda.synchronize()
                errs[name] = rel_err(out, ref)
            except Exception as exc:  # a probe reports what failed and goes on
                notes[name] = f"{type(exc).__name__}: {exc}"[:300]
                del fns[name]
        kinds = trace_kinds(fns["ce_c4"]) if "ce_c4" in fns else {}
        timings = time_interleaved(fns, ctx.device, rounds=15, agree=True)
        after = {}
        for name, fn in fns.items():  # still right after hundreds of back-to-back calls
            after[name] = rel_err(fn(), ref)
        return {"errs": errs, "after": after, "timings": timings, "notes": notes, "kinds": kinds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows, summary = [], []
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for (m, n, k), coll in itertools.product(SHAPES, ("reduce_scatter", "all_reduce")):
            per_rank = pool.run(ProbeTask(m, n, k, coll))
            merged, errors, passed = merge_checked(per_rank, TOLERANCE)
            seq = merged["seq"].median_ms
            parts = []
            for x in merged:
                err, ok = errors[x], passed[x]
                t = merged[x].median_ms
                rows.append(dict(
                    m=m, n=n, k=k, collective=coll, variant=x, status="PASS" if ok else "FAIL", rel_err=err,
                    median_ms=t, iqr_ms=merged[x].iqr_ms, speedup_vs_seq=seq / t,
                ))  # fmt: skip
                parts.append(f"{x} {t:.3f}{'' if ok else ' FAIL'} ({seq / t:.2f}x)")
            notes = {k2: v for r in per_rank for k2, v in r["notes"].items()}
            line = f"{m}x{n}x{k} {coll}: " + ", ".join(parts)
            if notes:
                line += f" | notes {notes}"
            line += f" | trace {per_rank[0]['kinds']}"
            print(line, flush=True)
            summary.append(line)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "ce_probe.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("SUMMARY")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
