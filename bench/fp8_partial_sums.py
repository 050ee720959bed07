"""Where the copy engine folds a peer's partial sum into an fp8 chunk GEMM, timed on one GPU.

    python bench/fp8_partial_sums.py --out DIR [--rounds 20] [--calls 10]

The copy engine's chunk GEMM ``out += (a * scale_a) @ (b * scale_b)`` (rowwise scales, bfloat16
out; ``out`` holds the partial sum a peer's copy brought) can fold the sum in at two places:
``torch._scaled_mm`` then a fused add (torch._scaled_mm has no beta), or the persistent Triton rows
GEMM, which adds ``out``'s tile in its epilogue (``fo_kernels.gemm.rows_gemm`` with ``ready`` set,
what ``fo_kernels.engines.copy_engine.gpu`` runs). For each chunk shape (a TP=2/4/8 layer's M / TP
rows; ``CHUNKS``), variants timed side by side:

    gemm           torch._scaled_mm(a, b) into out        (beta 0: the GEMM alone)
    add            out += torch._scaled_mm(a, b)          (the library's sum)
    rows_k128      rows_gemm, out += in the epilogue, 128x256x128 (fp8's default tile)
    rows_k64       the same, 128x256x64

Every variant is checked first against the float64 sum (relative error < 2e-2, bf16). A sample
is one CUDA graph replay of ``--calls`` calls; rounds rotate the variants' order; the median of
the rounds is reported. Writes DIR/fp8_partial_sums.csv (one row per shape and variant, its time
over ``gemm``'s, the GPU, torch, Triton and time of the run) and prints it. Needs a Hopper GPU
(fp8 tensor cores).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("TRITON_INTERPRET", "0")

# The graphed sample, rotating rounds and relative error of the MoE bench beside this file.
from moe_grouped_gemm import _rel, _rounds, _timed

from fo_kernels.gemm import BOperand, rows_gemm
from fo_kernels.quantize import quantize_rows, quantize_weight
from fo_kernels.scaling import check_scales, scaled_mm
from fo_kernels.tile import Tile

# (layer M, N, K, TP): the rows one rank's chunk GEMM takes are M / TP. Suite shapes
# (suites/h200_profile.yaml) at TP = 2, 4, 8.
CHUNKS = (
    (4096, 8192, 4096, 2),
    (4096, 8192, 4096, 4),
    (4096, 8192, 4096, 8),
    (16384, 8192, 4096, 2),
    (16384, 8192, 4096, 4),
    (16384, 8192, 4096, 8),
    (8192, 8192, 8192, 2),
    (8192, 8192, 8192, 8),
)
TILES = {
    "rows_k128": Tile(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3),
    "rows_k64": Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4),
}
CHECK_TOL = 2e-2  # bf16 out (the ops' fp8 bf16 tolerance)
COLUMNS = (
    "m",
    "n",
    "k",
    "tp",
    "rows",
    "variant",
    "ms",
    "x_gemm",
    "rel_err",
    "gpu",
    "torch",
    "triton",
    "time",
)


def bench_chunk(m: int, n: int, k: int, tp: int, rounds: int, calls: int) -> list[dict]:
    """The rows of one chunk shape (see the module docstring)."""
    dev = torch.device("cuda")
    rows = m // tp
    gen = torch.Generator(device=dev).manual_seed(m + n + k + tp)
    x = torch.randn(rows, k, device=dev, generator=gen)
    w = torch.randn(n, k, device=dev, generator=gen) / k**0.5
    a, scale_a = quantize_rows(x, "rowwise")
    codes, scale_b = quantize_weight(w, "rowwise")
    b = codes.t()  # the transposed view of an (N, K) weight, as a layer passes it
    scales = check_scales("all_reduce", a, b, scale_a, scale_b, torch.bfloat16)
    partial = torch.randn(rows, n, device=dev, generator=gen).to(torch.bfloat16)
    want = partial.double() + (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
    out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    operand = BOperand.of(b)
    tiles_m = {name: -(-rows // t.block_m) for name, t in TILES.items()}
    row_group = {name: torch.zeros(t, dtype=torch.int32, device=dev) for name, t in tiles_m.items()}
    ready = torch.ones(1, dtype=torch.int32, device=dev)  # the peer's copy has landed

    def variant(name: str) -> Callable[[], object]:
        if name == "gemm":
            return lambda: scaled_mm(a, b, scales, out)
        if name == "add":
            return lambda: out.add_(scaled_mm(a, b, scales))
        tile, group = TILES[name], row_group[name]
        return lambda: rows_gemm(a, operand, out, tile, grid=sms, row_group=group, ready=ready, scales=scales)

    names = ("gemm", "add", *TILES)
    errors = {}
    for name in names:  # correctness first: one call on the partial sum, poisoned where it is not
        if name == "gemm":
            out.fill_(float("nan"))
            variant(name)()
            errors[name] = _rel(out.double(), want - partial.double())
        else:
            out.copy_(partial)
            variant(name)()
            errors[name] = _rel(out.double(), want)
        torch.cuda.synchronize()
        assert errors[name] < CHECK_TOL, (m, n, k, tp, name, errors[name])
    out.copy_(partial)
    med = _rounds({name: _timed(variant(name), calls) for name in names}, rounds)
    return [
        {"m": m, "n": n, "k": k, "tp": tp, "rows": rows, "variant": name, "ms": round(med[name], 4),
         "x_gemm": round(med[name] / med["gemm"], 3), "rel_err": f"{errors[name]:.1e}"}
        for name in names
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=10, help="calls per graph replay (a sample)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("needs a CUDA GPU with fp8 tensor cores (compute capability 9.0 or later)", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    run = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )  # fmt: skip
    rows: list[dict] = []
    path = out_dir / "fp8_partial_sums.csv"
    for m, n, k, tp in CHUNKS:
        for r in bench_chunk(m, n, k, tp, args.rounds, args.calls):
            rows.append({**r, **run})
            print(f"{m}x{n}x{k} TP={tp} {r['rows']:>5} rows  {r['variant']:<10} {r['ms']:.4f} ms  "
                  f"x gemm {r['x_gemm']:.3f}  err {r['rel_err']}", flush=True)  # fmt: skip
        _write(rows, path)  # after every shape: a run cut short keeps what it measured
    print(f"wrote {path}")
    return 0


def _write(rows: list[dict], path: Path) -> None:
    """The CSV of ``rows``, replaced atomically."""
    with open(path.with_suffix(".tmp"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    path.with_suffix(".tmp").replace(path)


if __name__ == "__main__":
    sys.exit(main())
