"""Host time of the expert-parallel FFN's pieces on one GPU: what the MoE cost model's host terms read.

    python bench/moe_host.py --out DIR [--suite suites/moe/experts.yaml] [--models Mixtral-8x7B]
        [--ep 4,8] [--tokens 64,512] [--reps 30]

For every model, EP and tokens a rank of the suite, one rank's experts (E / EP of them, bf16,
tokens x k rows routed by a seeded top-k over them) on this GPU, three host times, each the median
over ``--reps`` calls issued with the device idle before each (``time.perf_counter`` around the
call; the device's work is not waited for), measured by ``fo_tune.moe.host`` (the code ``fo-tune
calibrate --only moe_host`` measures a calibration's record with, over a few of these shapes):

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
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("TRITON_INTERPRET", "0")

from moe_grouped_gemm import planned_shapes, read_suite  # (bench/: the script's own folder)

from fo_tune.moe.host import HostShape, measure_shape

SUITE = Path(__file__).resolve().parents[1] / "suites" / "moe" / "experts.yaml"
# A free local port for the one-rank NCCL group (any unused one works).
PORT = 29555
COLUMNS = (
    "model", "ep", "tokens", "experts_local", "chunks", "rows", "phase1_host_ms", "phase2_host_ms",
    "call_host_ms", "gpu", "host_cpu", "torch", "time",
)  # fmt: skip


def _host_cpu() -> str:
    """The host CPU's model name (Linux), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(model: dict, ep: int, tokens: int, reps: int, device: str = "cuda") -> list[dict]:
    """The rows of one model, EP and tokens (one per chunks; ``fo_tune.moe.host.measure_shape``),
    times rounded to 0.1 us."""
    rows = measure_shape(HostShape.of(model, ep, tokens), reps, torch.device(device))
    times = ("phase1_host_ms", "phase2_host_ms", "call_host_ms")
    return [{**row, **{name: round(row[name], 4) for name in times}} for row in rows]


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
