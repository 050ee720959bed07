"""The copy engine's tiled mode beside its cuBLAS-chunk mode and cuBLAS then NCCL (2 GPUs).

    python3 bench/ce_tiled_probe.py --out DIR [--shape MxNxK ...] [--rounds R]

Session 5 (``docs/perf-notes.md``) left AllReduce 2048x4096x4096 at 1.07x and 4096x8192x4096 at
1.23x over sequential: the cuBLAS-chunk engine cuts each shard into chunks, and every chunk is a
small GEMM that fills the GPU badly (0.03 ms per 512-row chunk at 2048x4096x4096 against 0.023 for
a quarter of the whole GEMM). The tiled mode (``tile`` on an ``engine: copy_engine`` schedule)
runs each phase as one persistent Triton GEMM on all SMs that signals per chunk. This probe times,
per shape and collective, in one ``time_interleaved`` run (max over ranks):

- ``seq``: cuBLAS then NCCL, preallocated (the bench's sequential);
- ``gemm``: cuBLAS alone, and ``tgemm_<tile>``: the Triton kernel alone on the whole (M, N, K),
  no signals (how fast the phases could be);
- ``ce_c<C>``: the cuBLAS-chunk engine with C equal chunks per shard;
- ``tl_<tile>_c<C>``: the tiled mode;
- ``ex_c<C>`` (AllReduce): the exchange mode, C chunks of all M rows.

Engine calls go through the engine's own CUDA graphs (the bench's steady state). Every variant is
checked against a float32 reference (the collective's, or the GEMM's for the GEMM-only ones)
before and after timing.

Writes DIR/tiled.csv (appended case by case); prints one line per case and a summary last.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_common import (
    Progress,
    append_rows,
    case_options,
    cases,
    merge_checked,
    operands_and_reference,
    poisoned_error,
    sequential_call,
    shared_engine,
)

from fo_kernels.gemm import BOperand, rows_gemm
from fo_kernels.schedule import Tile
from fo_tune.harness import open_pool, time_interleaved
from fo_tune.launch import RankContext
from fo_tune.space import load_space, packaged_spaces_dir

# search_spaces/hopper.yaml's first and second tiles (its comments call them "big_ws" and "big"; the
# fourth, "small_ws", was slower in every tiled case of run 33).
_HOPPER = load_space(packaged_spaces_dir() / "hopper.yaml").tiles
TILES = {"big_ws": _HOPPER[0], "big": _HOPPER[1]}
CE_CHUNKS = (2, 4)
TILED_CHUNKS = (1, 2, 4)
EXCHANGE_CHUNKS = (1, 2, 3, 4)  # all_reduce only
TOLERANCE = 2e-2


class TiledTask:
    def __init__(self, m: int, n: int, k: int, collective: str, rounds: int, biggest: int) -> None:
        self.m, self.n, self.k, self.collective = m, n, k, collective
        self.rounds, self.biggest = rounds, biggest

    def run(self, ctx: RankContext) -> dict:
        m, n, k, w = self.m, self.n, self.k, ctx.world_size
        a, b, ref = operands_and_reference(ctx, m, n, k, self.collective)
        gemm_ref = a.float() @ b.float()
        peers = shared_engine(ctx.device, self.biggest)
        fns = {"seq": sequential_call(self.collective, a, b, w)[0]}
        refs = {"seq": ref}
        full = torch.empty((m, n), dtype=a.dtype, device=a.device)
        operand = BOperand.of(b)
        groups = torch.zeros(-(-m // 64), dtype=torch.int32, device=a.device)  # one group: no signal

        def cublas() -> torch.Tensor:
            return torch.mm(a, b, out=full)

        fns["gemm"], refs["gemm"] = cublas, gemm_ref
        for name, tile in TILES.items():

            def triton_gemm(tile=tile) -> torch.Tensor:
                rows_gemm(a, operand, full, tile, grid=peers._sms, row_group=groups)
                return full

            fns[f"tgemm_{name}"], refs[f"tgemm_{name}"] = triton_gemm, gemm_ref

        def engine(weights: tuple[int, ...], tile: Tile | None, exchange: bool = False):
            return lambda: peers.run(self.collective, a, b, weights, tile, exchange)

        for c in CE_CHUNKS:
            fns[f"ce_c{c}"], refs[f"ce_c{c}"] = engine((1,) * c, None), ref
        for name, tile in TILES.items():
            for c in TILED_CHUNKS:
                fns[f"tl_{name}_c{c}"], refs[f"tl_{name}_c{c}"] = engine((1,) * c, tile), ref
        if self.collective == "all_reduce":
            for c in EXCHANGE_CHUNKS:
                fns[f"ex_c{c}"], refs[f"ex_c{c}"] = engine((1,) * c, None, True), ref
        rows = m if self.collective == "all_reduce" else m // w

        def checked(name: str) -> float:
            return poisoned_error(fns[name], refs[name], full, peers, rows)

        errs = {name: checked(name) for name in fns}
        timings = time_interleaved(fns, ctx.device, rounds=self.rounds, agree=True)
        after = {name: checked(name) for name in fns}
        return {"errs": errs, "after": after, "timings": timings, "replays": peers.replays}


def main() -> None:
    args = case_options(__doc__.splitlines()[0]).parse_args()
    shapes, collectives = cases(args)
    biggest = max(m * n for m, n, _ in shapes) * 2  # bf16 bytes of the largest output (exchange)
    progress = Progress()
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for m, n, k in shapes:
            for coll in collectives:
                per_rank = pool.run(TiledTask(m, n, k, coll, args.rounds, biggest), timeout_s=600)
                merged, errors, passed = merge_checked(per_rank, TOLERANCE)
                rows, parts = [], []
                seq = merged["seq"].median_ms
                for x in merged:
                    t = merged[x].median_ms
                    rows.append(dict(
                        m=m, n=n, k=k, collective=coll, variant=x,
                        status="PASS" if passed[x] else "FAIL", rel_err=errors[x], median_ms=t,
                        iqr_ms=merged[x].iqr_ms, speedup_vs_seq=seq / t,
                    ))  # fmt: skip
                    parts.append(f"{x} {t:.3f}{'' if passed[x] else ' FAIL'}")
                append_rows(args.out / "tiled.csv", rows)
                best = min(
                    (x for x in merged if x.startswith(("ce_", "tl_", "ex_")) and passed[x]),
                    key=lambda x: merged[x].median_ms,
                    default="-",
                )
                speed = f"{seq / merged[best].median_ms:.2f}x" if best != "-" else "n/a"
                line = f"{m}x{n}x{k} {coll}: best {best} {speed} | " + ", ".join(parts)
                progress.line(line)
    progress.summary()


if __name__ == "__main__":
    main()
