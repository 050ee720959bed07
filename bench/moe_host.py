"""Host time of the expert-parallel FFN's pieces on one GPU: what the MoE cost model's host terms read.

    python bench/moe_host.py --out DIR [--suite suites/moe/experts.yaml] [--models Mixtral-8x7B]
        [--ep 4,8] [--tokens 64,512] [--reps 30]

For every model, EP and tokens a rank of the suite, one rank's experts (E / EP of them, bf16,
tokens x k rows routed by a seeded top-k over them) on this GPU, three host times, each the median
over ``--reps`` calls issued with the device idle before each (``time.perf_counter`` around the
call; the device's work is not waited for):

    phase1   Stage.first of one piece: unpack, the up grouped GEMM, SwiGLU (the copy engine's
             Phase 1, as its list issues it for each piece; ``chunks`` pieces of the experts)
    phase2   Stage.second of one piece: the down grouped GEMM, pack (its Phase 2)
    call     fo_kernels.expert_parallel_ffn at world size 1 (one NCCL rank, no schedule: the
             no-overlap path): checks, routing, stages, both phases on every row, the weighted sum

Writes DIR/moe_host.csv (one row per model, EP, tokens and chunks, with the GPU, host CPU, torch
and time of the run). Host time depends on the host CPU and the software, hardly on the GPU or
the rows. Needs a CUDA GPU with ``torch._grouped_mm`` and NCCL.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("TRITON_INTERPRET", "0")

from moe_grouped_gemm import planned_shapes, read_suite  # (bench/: the script's own folder)

from fo_kernels import expert_parallel_ffn
from fo_kernels.moe.exchange import Layout
from fo_kernels.moe.routing import check_call, route
from fo_kernels.moe.stages import ForwardStage

SUITE = Path(__file__).resolve().parents[1] / "suites" / "moe" / "experts.yaml"
CHUNKS = (1, 2)  # pieces the copy engine cuts a source's experts into (its search space's first)
# A free local port for the one-rank NCCL group (any unused one works).
PORT = 29555
COLUMNS = (
    "model", "ep", "tokens", "experts_local", "chunks", "rows", "phase1_host_ms", "phase2_host_ms",
    "call_host_ms", "gpu", "host_cpu", "torch", "time",
)  # fmt: skip


def _median_host_ms(fn, reps: int, setup=lambda: None) -> float:
    """Median host ms of ``fn()`` over ``reps`` calls, each after ``setup()`` with the device idle."""
    setup()
    fn()  # warm-up: kernels loaded, memory allocated
    times = []
    for _ in range(reps):
        setup()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def _host_cpu() -> str:
    """The host CPU's model name (Linux), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _rank_inputs(model: dict, ep: int, tokens: int, seed: int):
    """One rank's tokens, routing over its E / EP experts, and those experts' weights (bf16)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h, inter, k = model["hidden"], model["intermediate"], model["top_k"]
    experts = model["experts"] // ep
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    w, ids = logits.softmax(-1).topk(min(k, experts), dim=-1)
    w13 = torch.randn(experts, h, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=gen) / h**0.5
    w2 = torch.randn(experts, inter, h, device="cuda", dtype=torch.bfloat16, generator=gen) / inter**0.5
    return x, ids, w, w13, w2


def measure(model: dict, ep: int, tokens: int, reps: int) -> list[dict]:
    """The rows of one model, EP and tokens (one per chunks)."""
    x, ids, w, w13, w2 = _rank_inputs(model, ep, tokens, seed=ep * 7919 + tokens)
    shape = check_call(x, ids, w, w13, w2, 1)
    routing = route(ids, shape)
    layout = Layout(0, routing.host_counts, routing.host_counts, (shape.tokens,))
    call = _median_host_ms(lambda: expert_parallel_ffn(x, ids, w, w13, w2), reps)
    out = []
    for chunks in CHUNKS:
        if chunks > shape.experts:
            continue
        bounds = [c * shape.experts // chunks for c in range(chunks + 1)]
        piece = (0, bounds[0], bounds[1])  # the first of ``chunks`` pieces
        stage = ForwardStage(x, w, shape, routing, layout, w13, w2)
        r0, r1 = stage.piece_rows(piece)
        rows = stage.outgoing()[r0:r1]
        phase1 = _median_host_ms(lambda s=stage, p=piece, q=rows: s.first([p], q), reps)
        # (each phase 2 pops what a phase 1 kept: one runs, untimed, before each)
        phase2 = _median_host_ms(
            lambda s=stage, p=piece: s.second([p]),
            reps,
            setup=lambda s=stage, p=piece, q=rows: s.first([p], q),
        )
        out.append(
            dict(
                model=model["name"],
                ep=ep,
                tokens=tokens,
                experts_local=shape.experts,
                chunks=chunks,
                rows=r1 - r0,
                phase1_host_ms=round(phase1, 4),
                phase2_host_ms=round(phase2, 4),
                call_host_ms=round(call, 4),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + " Needs a CUDA GPU with torch._grouped_mm and NCCL."
    )
    parser.add_argument("--out", required=True, help="folder to write moe_host.csv into (made if missing)")
    parser.add_argument(
        "--suite", default=str(SUITE), help="the models' expert shapes (default: %(default)s)"
    )
    parser.add_argument("--models", default="", help="comma-separated model names (default: all)")
    parser.add_argument("--ep", default="4,8", help="comma-separated EP sizes (default: %(default)s)")
    parser.add_argument(
        "--tokens", default="64,512", help="comma-separated tokens a rank (default: %(default)s)"
    )
    parser.add_argument("--reps", type=int, default=30, help="calls per median (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    suite, wanted, eps, tokens = read_suite(parser, args)
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print(
            "needs a CUDA GPU and torch._grouped_mm (the host time of the machine it runs on)",
            file=sys.stderr,
        )
        return 2
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out: {exc.strerror}: {args.out}")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{PORT}", rank=0, world_size=1)
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        host_cpu=_host_cpu(),
        torch=torch.__version__,
        time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    rows = []
    # (each row written as it is measured: a failure keeps the rows before it)
    with open(out_dir / "moe_host.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        try:
            for _, model, ep, count in planned_shapes(suite, wanted, eps, tokens):
                for row in measure(model, ep, count, args.reps):
                    rows.append({**row, **meta})
                    writer.writerow(rows[-1])
                    f.flush()
                    print(", ".join(f"{k} {row[k]}" for k in row), flush=True)
                torch.cuda.empty_cache()
        finally:
            dist.destroy_process_group()
    for name in ("phase1_host_ms", "phase2_host_ms", "call_host_ms"):
        print(f"median {name}: {statistics.median(r[name] for r in rows):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
