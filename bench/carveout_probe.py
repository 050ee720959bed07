"""Can cuBLAS leave SMs free for a concurrent kernel? One GPU, no NCCL needed.

    python3 bench/carveout_probe.py --out DIR

torch's ``torch._C._set_sm_carveout_experimental(r)`` asks cuBLASLt (``SM_COUNT_TARGET``) to run
a matmul on ``sm_count - r`` SMs. Hopper's cuBLAS kernels are persistent and hold every SM, which is
why a GEMM and an independent NCCL call launched together took the sum of their times
(``../shared/DESIGN.md``). This probe measures, per GEMM shape, BLAS library and carveout:

    gemm      the matmul alone (``triton.testing.do_bench``, median)
    grid      the CTA count of its kernel (torch.profiler's trace)
    side      a stand-in for an NCCL kernel: a persistent Triton copy on ``SIDE_CTAS`` CTAs
    both      the matmul on the caller's stream and the copy on a second one, launched together

``both / max(gemm, side)`` near 1 means they ran side by side; near ``(gemm + side) / max`` means
the copy waited for the GEMM. Writes DIR/carveout_probe.csv; prints one line per case.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

# NCCL's default CTA count for an intra-node AllReduce on H200 x2 is 16-32 (NCCL_MAX_CTAS); the
# stand-in uses the low end, the number DESIGN.md saw waiting behind cuBLAS.
SIDE_CTAS = 16
# The stand-in copies one 64 MiB chunk, about an 8192x4096 bf16 group.
SIDE_BYTES = 64 << 20
SHAPES = (  # the suite's (M, N, K), plus a quarter-M chunk of each
    (2048, 4096, 4096),
    (4096, 8192, 4096),
    (4096, 8192, 14336),
    (8192, 8192, 8192),
    (16384, 8192, 4096),
    (2048, 8192, 8192),
    (1024, 8192, 14336),
    (1024, 8192, 4096),
)
CARVEOUTS = (0, 8, 16, 24, 32)
LIBRARIES = ("cublas", "cublaslt")


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr, CTAS: tl.constexpr):
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, n, CTAS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def side_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    _copy_kernel[(SIDE_CTAS,)](src, dst, src.numel(), BLOCK=4096, CTAS=SIDE_CTAS, num_warps=8)


def kernel_grids(fn, tag: str) -> list[int]:
    """CTA counts of the CUDA kernels ``fn`` launches whose name does not contain ``_copy_kernel``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{tag}.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    grids = []
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "kernel" and "_copy_kernel" not in ev.get("name", ""):
            g = ev.get("args", {}).get("grid", [0, 0, 0])
            grids.append(int(g[0]) * int(g[1]) * int(g[2]))
    return grids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    name = torch.cuda.get_device_name(dev)
    print(f"{name} sms={sms} torch={torch.__version__} triton={triton.__version__}")
    src = torch.randn(SIDE_BYTES // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream(dev, priority=-1)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=120, return_mode="median")
    rows = []
    seen = set()
    for m, n, k in SHAPES:
        if (m, n, k) in seen:
            continue
        seen.add((m, n, k))
        g = torch.Generator(device=dev).manual_seed(m + n + k)
        a = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=g) / k**0.5
        b = torch.randn(k, n, dtype=torch.bfloat16, device=dev, generator=g)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        ref = a.float() @ b.float()
        # the ReduceScatter chunk form: rows of both halves of M in one strided batched GEMM
        a3, b3 = a.view(2, m // 2, k), b.expand(2, k, n)
        out3 = torch.empty(2, m // 2, n, dtype=torch.bfloat16, device=dev)
        for lib in LIBRARIES:
            torch.backends.cuda.preferred_blas_library(lib)
            for r in CARVEOUTS:
                torch._C._set_sm_carveout_experimental(r if r else None)
                for op in ("mm", "bmm"):
                    if op == "mm":
                        gemm = lambda: torch.mm(a, b, out=out)
                    else:
                        gemm = lambda: torch.bmm(a3, b3, out=out3)
                    out.fill_(float("nan"))
                    out3.fill_(float("nan"))
                    gemm()
                    torch.cuda.synchronize()
                    got = out if op == "mm" else out3.view(m, n)
                    err = ((got.float() - ref).norm() / ref.norm()).item()

                    def both() -> None:
                        main = torch.cuda.current_stream(dev)
                        side.wait_stream(main)
                        gemm()
                        with torch.cuda.stream(side):
                            side_copy(src, dst)
                        main.wait_stream(side)

                    t_gemm = bench(gemm)
                    t_side = bench(lambda: side_copy(src, dst))
                    t_both = bench(both)
                    grids = kernel_grids(gemm, f"{lib}{r}{op}")
                    row = dict(
                        m=m, n=n, k=k, op=op, library=lib, carveout=r, grid=max(grids or [0]),
                        kernels=len(grids), rel_err=err, gemm_ms=t_gemm, side_ms=t_side, both_ms=t_both,
                        both_over_max=t_both / max(t_gemm, t_side),
                        sum_over_max=(t_gemm + t_side) / max(t_gemm, t_side),
                    )  # fmt: skip
                    rows.append(row)
                    print(
                        f"{m}x{n}x{k} {op:3s} {lib:8s} r={r:2d} grid={row['grid']:4d} err={err:.1e} "
                        f"gemm={t_gemm:.3f} side={t_side:.3f} both={t_both:.3f} "
                        f"both/max={row['both_over_max']:.2f} (serial {row['sum_over_max']:.2f})",
                        flush=True,
                    )
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library("cublas")
    with open(args.out / "carveout_probe.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("summary: rows", len(rows))


if __name__ == "__main__":
    main()
