"""The copy engine's push mode beside its cuBLAS-chunk mode and cuBLAS then NCCL (2 GPUs).

    python3 bench/ce_push_probe.py --out DIR [--shape MxNxK ...] [--collective C] [--rounds R]
                                   [--tiles NAME,NAME] [--modes ce,push,tl,half]

Session 7 (``docs/perf-notes.md``, run 43) found AllReduce 2048x4096x4096 latency-bound: two GEMM
phases plus two dependent NVLink hops (a chunk's GEMM ends, its flag crosses, a copy engine copies
it; then the same for the sums), ~20-25 us each. The push mode (``push: true`` with a ``tile``)
runs the whole call as one persistent Triton GEMM that stores each tile of the peer's rows straight
into the peer's memory and flags it per tile; the tiles of my rows add the peer's partial as it
lands and (AllReduce) store the sum into the peer's memory too. This probe times, per shape and
collective, in one ``time_interleaved`` run (max over ranks):

- ``seq``: cuBLAS then NCCL, preallocated (the bench's sequential);
- ``gemm``: cuBLAS alone, and ``tgemm_<tile>``: the Triton kernel alone, no signals;
- ``ce_c<C>``: the cuBLAS-chunk engine (the shipped tables' mode) with C equal chunks per shard,
  one copy engine per copy; ``_s2``: each pull and gather split over two copy engines
  (``CopyEnginePeers.copy_split``); ``_end`` (AllReduce): my sums copied into the output once, at
  the end (``own_copy_at_end``);
- ``push_<tile>_c<C>``: the push mode; C chunks per shard count the sums the peer gathers
  (AllReduce; ReduceScatter has no gather and runs C = 1 only); ``_nd``: each tile's flag
  published right after its stores instead of after the next tile's K loop; ``_tma``: TMA bulk
  stores into the peer's memory (``CopyEnginePeers.push_defer`` / ``push_tma_out``);
- ``tl_<tile>_c<C>``: the tiled mode (phase 1 stored locally and pulled by the copy engine chunk
  by chunk); for AllReduce its phase 2 pushes the sums into the peer's memory, and ``_gather``
  leaves them in mine for the peer to pull (``CopyEnginePeers.tiled_push_sums``); ``_cb``: phase 1
  as cuBLAS chunk GEMMs (``tiled_cublas_phase1``);
- ``half_local_<tile>`` / ``half_remote_<tile>``: the Triton kernel on the first M/2 rows, its
  output in my memory or in the peer's (NVLink stores; what a push-mode phase pays for them).

Engine calls go through the engine's own CUDA graphs (the bench's steady state). Every variant is
checked against a float32 reference before and after timing, on poisoned outputs.

Writes DIR/push.csv (appended case by case); prints one line per case and a summary last.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist
from probe_common import (
    OPERAND_SEED,
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
from fo_tune.measure import gemm_operands, rel_err
from fo_tune.space import load_space, packaged_spaces_dir

# search_spaces/hopper.yaml's tiles by the names its comments give them (``wide64`` is its
# 64x256 entry): 128x256 tiles make the fewest waves, 128x128 and 64x256 twice as many, so the
# sums left after the GEMM's last wave are half as many bytes.
_HOPPER = load_space(packaged_spaces_dir() / "hopper.yaml").tiles
TILES = {"big_ws": _HOPPER[0], "big": _HOPPER[1], "small_ws": _HOPPER[3], "wide64": _HOPPER[5]}
DEFAULT_TILES = "big_ws,big"  # the fastest in run 50 (push 0.158-0.159 ms vs 0.171-0.176)
CE_CHUNKS = (2, 4)
PUSH_CHUNKS = (1, 2)  # all_reduce
# (defer, tma_out) variants of the push mode: the default, then TMA stores (first tile, C = 1 only;
# run 51: publishing right after the stores, "_nd", was 6-12% slower at 4096x8192x4096)
PUSH_KNOBS = {"": (True, False), "_tma": (True, True)}
TILED_CHUNKS = (1, 2)
MODES = ("ce", "push", "tl", "half")  # the variant families (``--modes``)
TOLERANCE = 2e-2
CASE_TIMEOUT_S = 300  # a case that hangs (flags out of step) fails instead of eating the device call


class PushTask:
    def __init__(
        self,
        m: int,
        n: int,
        k: int,
        collective: str,
        rounds: int,
        biggest: int,
        tiles: dict[str, Tile],
        modes: tuple[str, ...],
    ) -> None:
        self.m, self.n, self.k, self.collective = m, n, k, collective
        self.rounds, self.biggest, self.tiles, self.modes = rounds, biggest, tiles, modes

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
        for name, tile in self.tiles.items():

            def triton_gemm(tile=tile) -> torch.Tensor:
                rows_gemm(a, operand, full, tile, grid=peers._sms, row_group=groups)
                return full

            fns[f"tgemm_{name}"], refs[f"tgemm_{name}"] = triton_gemm, gemm_ref

        half = m // 2
        remote, halves = {}, "half" in self.modes
        if halves:
            here = torch.empty((half, n), dtype=a.dtype, device=a.device)
            mine, theirs = peers._symmetric(half * n, a.dtype)  # (both ranks, same order: a rendezvous)
            mine, theirs = mine.view(half, n), theirs.view(half, n)
            half_groups = groups[: -(-half // 64)]
        for name, tile in self.tiles.items() if halves else ():

            def half_gemm(tile=tile, dst=here) -> torch.Tensor:
                rows_gemm(a[:half], operand, dst, tile, grid=peers._sms, row_group=half_groups)
                return dst

            fns[f"half_local_{name}"], refs[f"half_local_{name}"] = half_gemm, gemm_ref[:half]
            fns[f"half_remote_{name}"] = remote[f"half_remote_{name}"] = lambda f=half_gemm: f(dst=theirs)

        def engine(
            weights: tuple[int, ...],
            tile: Tile | None,
            push: bool = False,
            knobs=(True, False),
            sums=True,
            split=1,
            at_end=False,
            cublas1=False,
        ):
            def call() -> torch.Tensor:
                peers.push_defer, peers.push_tma_out = knobs
                peers.tiled_push_sums, peers.copy_split, peers.own_copy_at_end = sums, split, at_end
                peers.tiled_cublas_phase1 = cublas1
                return peers.run(self.collective, a, b, weights, tile, push=push)

            return call

        for c in CE_CHUNKS if "ce" in self.modes else ():
            fns[f"ce_c{c}"], refs[f"ce_c{c}"] = engine((1,) * c, None), ref
            fns[f"ce_c{c}_s2"], refs[f"ce_c{c}_s2"] = engine((1,) * c, None, split=2), ref
            if self.collective == "all_reduce":
                fns[f"ce_c{c}_end"], refs[f"ce_c{c}_end"] = engine((1,) * c, None, at_end=True), ref
        chunks = PUSH_CHUNKS if self.collective == "all_reduce" else (1,)
        for i, (name, tile) in enumerate(self.tiles.items()):
            for c in chunks if "push" in self.modes else ():
                for suffix, knobs in PUSH_KNOBS.items():
                    if suffix and (i or c > 1):
                        continue
                    x = f"push_{name}_c{c}{suffix}"
                    fns[x], refs[x] = engine((1,) * c, tile, True, knobs), ref
            for c in TILED_CHUNKS if "tl" in self.modes else ():
                fns[f"tl_{name}_c{c}"], refs[f"tl_{name}_c{c}"] = engine((1,) * c, tile), ref
                x = f"tl_{name}_c{c}_cb"
                fns[x], refs[x] = engine((1,) * c, tile, cublas1=True), ref
                if self.collective == "all_reduce" and not i and c == 1:
                    x = f"tl_{name}_c{c}_gather"
                    fns[x], refs[x] = engine((1,) * c, tile, sums=False), ref
        rows = m if self.collective == "all_reduce" else m // w
        if halves:
            peer_a, peer_b = gemm_operands(m, n, k, "bfloat16", ctx.device, OPERAND_SEED + 1 - ctx.rank)
            peer_ref = peer_a[:half].float() @ peer_b.float()
            del peer_a, peer_b

        def remote_error(call) -> float:
            """The peer's half GEMM as it landed in my buffer (poisoned first, both ranks synced)."""
            mine.fill_(float("nan"))
            torch.cuda.synchronize()
            dist.barrier()
            call()
            torch.cuda.synchronize()
            dist.barrier()
            return rel_err(mine, peer_ref)

        def checked(name: str) -> float:
            if name in remote:
                return remote_error(remote[name])
            return poisoned_error(fns[name], refs[name], full, peers, rows)

        errs = {name: checked(name) for name in fns}
        timings = time_interleaved(fns, ctx.device, rounds=self.rounds, agree=True)
        after = {name: checked(name) for name in fns}
        return {"errs": errs, "after": after, "timings": timings, "replays": peers.replays}


def main() -> None:
    ap = case_options(__doc__.splitlines()[0])
    ap.add_argument("--tiles", default=DEFAULT_TILES, help=f"comma-separated, of {', '.join(TILES)}")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    args = ap.parse_args()
    tiles = {name: TILES[name] for name in args.tiles.split(",")}
    modes = tuple(args.modes.split(","))
    shapes, collectives = cases(args)
    biggest = max(m * n for m, n, _ in shapes)  # bf16 bytes of the largest shard (half of M), x2
    progress = Progress()
    with open_pool(2) as pool:
        if not pool.is_driver:
            return
        for m, n, k in shapes:
            for coll in collectives:
                task = PushTask(m, n, k, coll, args.rounds, biggest, tiles, modes)
                per_rank = pool.run(task, timeout_s=CASE_TIMEOUT_S)
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
                append_rows(args.out / "push.csv", rows)
                best = {
                    kind: min(
                        (x for x in merged if x.startswith(kind) and passed[x]),
                        key=lambda x: merged[x].median_ms,
                        default="-",
                    )
                    for kind in ("ce_", "push_", "tl_")
                }
                summary = ", ".join(
                    f"{x} {seq / merged[x].median_ms:.2f}x" if x != "-" else "-" for x in best.values()
                )
                progress.line(f"{m}x{n}x{k} {coll}: seq {seq:.3f} best {summary} | " + ", ".join(parts))
    progress.summary()


if __name__ == "__main__":
    main()
