"""Where the copy engine's time goes: a GPU timeline of its calls, and copy latencies (2 GPUs).

    python3 bench/ce_trace_probe.py --out DIR

Run 17 (``bench/ce_wait_probe.py``) measured a flag's one-way latency at ~6 us, yet AllReduce
512x4096x4096 takes 0.457 ms with one chunk (the GEMM is ~0.03 ms) and each extra chunk adds
~0.08-0.16 ms. This probe finds the cost:

1. ``copies``: the time of one device-to-device copy on a side stream, local and of the peer's
   symmetric buffer (the engine's pull), 2 MB to 128 MB, by the copy engine (``copy_``) and by an
   SM kernel (a Triton load/store loop reading the peer's memory over NVLink), 20 repetitions each.
2. ``trace``: torch.profiler's GPU timeline (kernels, memcpys, per stream) of three back-to-back
   engine calls per case in ``TRACE_CASES``, both ranks, as start offsets and durations.

Writes DIR/copies.csv, DIR/trace_rank{0,1}.csv; prints one line per case and a summary last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import OPERAND_SEED, Progress, append_rows

from fo_kernels.copy_engine import CopyEnginePeers
from fo_tune.harness import open_pool
from fo_tune.launch import RankContext
from fo_tune.measure import gemm_operands

COPY_MB = (2, 8, 32, 128)
REPS = 20
TRACE_CASES = (
    ("all_reduce", 512, 4096, 4096, 1),
    ("all_reduce", 512, 4096, 4096, 2),
    ("reduce_scatter", 2048, 4096, 4096, 1),
    ("all_reduce", 4096, 8192, 4096, 2),
)
COPY_BLOCK = 8192


@triton.jit
def _sm_copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def timed(fn, stream: torch.cuda.Stream) -> list[float]:
    times = []
    for _ in range(REPS + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times[3:])


def row(mb: int, src: str, how: str, times: list[float]) -> dict:
    return dict(mb=mb, src=src, how=how, median_us=times[len(times) // 2], min_us=times[0])


class CopyTask:
    def run(self, ctx: RankContext) -> dict:
        peers = CopyEnginePeers(device=ctx.device)
        biggest = max(COPY_MB) << 20
        peers._reserve(biggest)
        torch.cuda.synchronize()
        dist.barrier()
        local_src = torch.empty(biggest, dtype=torch.uint8, device=ctx.device)
        dst = torch.empty(biggest, dtype=torch.uint8, device=ctx.device)
        side = torch.cuda.Stream(ctx.device)
        rows = []
        for mb in COPY_MB:
            nbytes = mb << 20
            n16 = nbytes // 2
            srcs = {"local": local_src[:nbytes], "peer": peers._peer_part[:nbytes]}
            for where, src in srcs.items():
                ce = timed(lambda s=src: dst[:nbytes].copy_(s), side)
                s16, d16 = src.view(torch.bfloat16), dst[:nbytes].view(torch.bfloat16)
                for sms in (8, 32, 132):
                    grid = (min(sms, triton.cdiv(n16, COPY_BLOCK)),)

                    def sm(s16=s16, d16=d16, grid=grid):
                        _sm_copy_kernel[grid](s16, d16, n16, BLOCK=COPY_BLOCK, num_warps=8)

                    t = timed(sm, side)
                    rows.append(row(mb, where, f"sm{sms}", t))
                rows.append(row(mb, where, "copy_engine", ce))
        dist.barrier()
        return {"rows": rows}


class TraceTask:
    def __init__(self, collective: str, m: int, n: int, k: int, chunks: int) -> None:
        self.case = (collective, m, n, k, chunks)

    def run(self, ctx: RankContext) -> dict:
        collective, m, n, k, chunks = self.case
        a, b = gemm_operands(m, n, k, "bfloat16", ctx.device, OPERAND_SEED + ctx.rank)
        peers = CopyEnginePeers(device=ctx.device)
        for _ in range(5):
            peers.run(collective, a, b, (1,) * chunks)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                peers.run(collective, a, b, (1,) * chunks)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "t.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
        gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        t0 = min((e["ts"] for e in gpu), default=0)
        rows = [
            dict(case="/".join(map(str, self.case)), cat=e["cat"], stream=e.get("tid"),
                 name=str(e.get("name"))[:60], start_us=round(e["ts"] - t0, 1), dur_us=e.get("dur"))
            for e in sorted(gpu, key=lambda e: e["ts"])
        ]  # fmt: skip
        end = max((e["ts"] + e.get("dur", 0) for e in gpu), default=t0)
        busy = sum(e.get("dur", 0) for e in gpu)
        dist.barrier()
        return {"rows": rows, "span_us": end - t0, "busy_us": busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--case",
        action="append",
        default=[],
        help="collective:M:N:K:chunks to trace instead of TRACE_CASES (repeatable)",
    )
    ap.add_argument("--no-copies", action="store_true", help="skip the copy latencies")
    args = ap.parse_args()
    cases = [
        (c, int(m), int(n), int(k), int(ch)) for c, m, n, k, ch in (x.split(":") for x in args.case)
    ] or list(TRACE_CASES)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        if not args.no_copies:
            per_rank = pool.run(CopyTask())
            append_rows(args.out / "copies.csv", per_rank[0]["rows"])
            for r in per_rank[0]["rows"]:
                what = f"copy {r['mb']} MB {r['src']} {r['how']}"
                progress.keep(f"{what}: {r['median_us']:.1f} us (min {r['min_us']:.1f})")
            progress.line("copies done", keep=False)
        for case in cases:
            per_rank = pool.run(TraceTask(*case))
            for rank, res in enumerate(per_rank):
                append_rows(args.out / f"trace_rank{rank}.csv", res["rows"])
            spans = [
                f"rank{i} span {r['span_us']:.0f} us busy {r['busy_us']:.0f} us"
                for i, r in enumerate(per_rank)
            ]
            line = f"trace {case}: " + ", ".join(spans)
            progress.line(line)
    progress.summary()


if __name__ == "__main__":
    main()
