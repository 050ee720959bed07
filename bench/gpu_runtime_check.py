"""One-call GPU check and side-by-side timing of the runtime (run under torchrun on 2+ GPUs).

    torchrun --nproc-per-node 2 bench/gpu_runtime_check.py --suite suites/h200_tp.yaml --out $OUT

1. Correctness: both ops on the suite and odd shapes, heuristic and hand schedules, against the
   float32 reference (matmul, then the collective in float32); a visibility stress test (outputs
   poisoned through the caching allocator, many repetitions, both ranks); counters == host totals.
2. Timing, same run, same inputs, side by side: cuBLAS; the signalled Triton GEMM at full and
   reduced grid (loop options too); NCCL alone; cuBLAS then NCCL; the overlapped ops with hand
   schedules (SMs left free, NCCL CTA cap, grouping, layout). Median of batches, max over ranks.
3. A timeline (CUDA events) of the best overlapped AllReduce per shape: GEMM end, each group's end.

Writes CSVs and a JSON timeline under --out; prints a short summary last.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fo_kernels import Problem, Schedule, Tile, current_fingerprint
from fo_kernels.gemm import BOperand
from fo_kernels.heuristics import split_decreasing, wave_aligned_sms_free
from fo_kernels.overlap import _overlapped, gemm_all_reduce, gemm_reduce_scatter
from fo_kernels.plan import cdiv
from fo_kernels.runtime import reduce_scatter_tensor, runtime_for
from fo_tune.launch import torchrun_context
from fo_tune.measure import gemm_runner

BIG = Tile(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, warp_specialize=True)
SMALL = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, warp_specialize=True)
TINY = Tile(block_m=64, block_n=64, block_k=64, group_m=2, num_warps=4, num_stages=3)
GEMM_VARIANTS = {
    "big": replace(BIG, warp_specialize=False),
    "big_ws": BIG,
    "big4_ws": replace(BIG, num_stages=4),
    "big_gm16_ws": replace(BIG, group_m=16),
    "small": replace(SMALL, warp_specialize=False),
    "small_ws": SMALL,
}
# Least SMs left to NCCL, and its CTA cap there: DESIGN.md saw NCCL run beside the GEMM with
# r = c + 4..8 (run 1 here: a cap of 4 CTAs made every AllReduce 1.5-2x slower, so none below 8).
FREE_CAP = [(12, 8), (20, 16), (28, 24)]


def log(ctx, *msg) -> None:
    if ctx.rank == 0:
        print(*msg, flush=True)


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_fn(fn, iters: int, batches: int = 5, warmup: int = 3) -> tuple[float, float]:
    """(median ms per call, spread = max - min of batch means), max over ranks."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(batches):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / iters)
    return max_over_ranks(statistics.median(means)), max_over_ranks(max(means) - min(means))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


def hand(
    collective,
    world,
    m,
    n,
    k,
    tile,
    sms_free,
    cap,
    n_groups,
    layout="row_band",
    front=False,
    sm_count=132,
    wait="stream_wait",
) -> Schedule | None:
    """A hand-written schedule: band units (row_band) or wave units (tile_major)."""
    shards = world if collective == "reduce_scatter" else 1
    mt, nt = cdiv(m // shards, tile.block_m), cdiv(n, tile.block_n)
    tiles = shards * mt * nt
    if layout == "row_band":
        unit = shards * tile.group_m * nt
    elif layout == "fine":  # tile_major, one local tile per unit
        layout, unit = "tile_major", shards
    else:
        grid = min(tiles, sm_count - sms_free)
        unit = cdiv(grid, shards) * shards
    units = cdiv(tiles, unit)
    if units < n_groups:
        return None
    groups = list(split_decreasing(units, n_groups))
    if front and n_groups >= 2:  # a small last group: its collective is the one left exposed
        groups = [*groups[:-2], groups[-2] + groups[-1] - max(1, groups[-1] // 2), max(1, groups[-1] // 2)]
    return Schedule(
        collective=collective,
        dtype="bfloat16",
        world_size=world,
        problem=Problem(m=m, n=n, k=k),
        tile=tile,
        sms_free=sms_free,
        nccl_max_ctas=cap,
        signal_tiles=unit,
        groups=tuple(groups),
        layout=layout,
        wait_mode=wait,
    )


def pick_tile(m, n, sm_count) -> Tile:
    if cdiv(m, BIG.block_m) * cdiv(n, BIG.block_n) >= sm_count:
        return BIG
    if cdiv(m, SMALL.block_m) * cdiv(n, SMALL.block_n) >= sm_count // 2:
        return SMALL
    return TINY


def hand_schedules(collective, world, m, n, k, sm_count):
    out = []
    tile = pick_tile(m, n, sm_count)
    shards = world if collective == "reduce_scatter" else 1
    tiles = shards * cdiv(m // shards, tile.block_m) * cdiv(n, tile.block_n)
    for min_free, cap in FREE_CAP:
        sms_free = wave_aligned_sms_free(tiles, min_free, sm_count)
        for n_groups in (2, 4, 8):
            s = hand(collective, world, m, n, k, tile, sms_free, cap, n_groups, sm_count=sm_count)
            if s is not None:
                out.append(s)
        s = hand(collective, world, m, n, k, tile, sms_free, cap, 4, front=True, sm_count=sm_count)
        if s is not None:
            out.append(s)
    free20 = wave_aligned_sms_free(tiles, 20, sm_count)
    if tile.warp_specialize:  # runs 2-3: without warp specialization was faster at K=14336 and M=16384
        plain = replace(tile, warp_specialize=False)
        for n_groups in (4, 8):
            s = hand(collective, world, m, n, k, plain, free20, 16, n_groups, sm_count=sm_count)
            if s is not None:
                out.append(s)
    gm4 = replace(tile, group_m=4)  # twice the bands: finer row-band groups
    for n_groups in (4, 8):
        for front in (False, True):
            s = hand(collective, world, m, n, k, gm4, free20, 16, n_groups, front=front, sm_count=sm_count)
            if s is not None:
                out.append(s)
    for n_groups in (2, 3, 4):
        s = hand(
            collective, world, m, n, k, tile, free20, 16, n_groups, layout="tile_major", sm_count=sm_count
        )
        if s is not None:
            out.append(s)
    s = hand(collective, world, m, n, k, tile, free20, 16, 4, wait="spin", sm_count=sm_count)
    if s is not None:
        out.append(s)
    return out


def operands(m, n, k, rank, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g).div_(k**0.5).to(torch.bfloat16)  # nn.Linear weight
    return a, w.t()


def reference(a, b, collective, world):
    ref = a.float() @ b.float()
    if collective == "all_reduce":
        dist.all_reduce(ref)
        return ref
    out = torch.empty(a.shape[0] // world, b.shape[1], device="cuda")
    reduce_scatter_tensor(out, ref)
    return out


def poison_cache(numel: int) -> None:
    junk = torch.full((numel,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk


def check_correctness(ctx, shapes, sm_count, rows) -> None:
    world = ctx.world_size
    ops = {"all_reduce": gemm_all_reduce, "reduce_scatter": gemm_reduce_scatter}
    for m, n, k in shapes:
        a, b = operands(m, n, k, ctx.rank, seed=m + n + k)
        for collective, op in ops.items():
            if m % world and collective == "reduce_scatter":
                continue
            ref = reference(a, b, collective, world)
            fine = hand(
                collective,
                world,
                m,
                n,
                k,
                pick_tile(m, n, sm_count),
                20,
                16,
                3,
                layout="fine",
                sm_count=sm_count,
            )
            cands = [None, *hand_schedules(collective, world, m, n, k, sm_count)[::4], fine]
            for s in cands:
                poison_cache(m * n * 2)
                out = op(a, b, schedule=s)
                err = max_over_ranks(rel_err(out, ref))
                nan = max_over_ranks(float(out.isnan().any()))
                rows.append(
                    dict(
                        check="op",
                        collective=collective,
                        m=m,
                        n=n,
                        k=k,
                        schedule=s.describe() if s else "lookup",
                        rel_err=err,
                        nan=bool(nan),
                        ok=bool(err < 1e-2 and not nan),
                    )
                )
    rt = runtime_for(torch.device("cuda", torch.cuda.current_device()), None)
    torch.cuda.synchronize()
    dev = [int(x) & 0xFFFFFFFF for x in rt.counters[:8].tolist()]
    host = rt.counter_totals(8)
    rows.append(
        dict(
            check="counters",
            collective="-",
            m=0,
            n=0,
            k=0,
            schedule=str(dev),
            rel_err=0.0,
            nan=False,
            ok=bool(max_over_ranks(float(dev != host)) == 0.0),
        )
    )


def stress_visibility(ctx, m, n, k, reps, sm_count, rows) -> None:
    """Many back-to-back overlapped calls with poisoned outputs; every one must match."""
    for collective in ("all_reduce", "reduce_scatter"):
        a, b = operands(m, n, k, ctx.rank, seed=99)
        ref = reference(a, b, collective, ctx.world_size)
        for s in (
            hand_schedules(collective, ctx.world_size, m, n, k, sm_count)[:2]
            + hand_schedules(collective, ctx.world_size, m, n, k, sm_count)[-3:]
        ):
            op = gemm_all_reduce if collective == "all_reduce" else gemm_reduce_scatter
            worst, nans = 0.0, 0
            outs = []
            for _ in range(reps):
                poison_cache(m * n * 4)
                outs.append(op(a, b, schedule=s))
                if len(outs) == 8:
                    for o in outs:
                        worst = max(worst, rel_err(o, ref))
                        nans += int(o.isnan().any())
                    outs = []
            for o in outs:
                worst = max(worst, rel_err(o, ref))
                nans += int(o.isnan().any())
            worst, nans = max_over_ranks(worst), max_over_ranks(nans)
            rows.append(
                dict(
                    check=f"stress x{reps}",
                    collective=collective,
                    m=m,
                    n=n,
                    k=k,
                    schedule=s.describe(),
                    rel_err=worst,
                    nan=bool(nans),
                    ok=bool(worst < 1e-2 and not nans),
                )
            )


def gemm_only(a, b, tile, sms_free, sm_count):
    """The signalled GEMM alone (one group, row-major output, private counters)."""
    return gemm_runner(a, b, tile, sms_free, sm_count)[0]


def timeline(ctx, collective, a, b, s) -> dict:
    rt = runtime_for(torch.device("cuda", torch.cuda.current_device()), None)
    best = None
    for _ in range(5):
        trace: list = []
        _overlapped(collective, a, BOperand.of(b), s, rt, trace)
        torch.cuda.synchronize()
        t0 = trace[0][1]
        marks = {name: t0.elapsed_time(ev) for name, ev in trace[1:]}
        total = max(marks.values())
        if best is None or total < best["total"]:
            best = dict(total=total, marks=marks)
    return best


def time_shapes(ctx, shapes, sm_count, rows, timelines) -> None:
    world = ctx.world_size
    for m, n, k in shapes:
        a, b = operands(m, n, k, ctx.rank, seed=1)
        out_bytes = m * n * 2
        iters = max(5, min(50, int(20.0 / (2 * m * n * k / 6e11 + 0.05))))
        full = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        part = torch.empty(m // world, n, dtype=torch.bfloat16, device="cuda")
        base = dict(m=m, n=n, k=k)

        def rec(variant, fn, **extra):
            try:
                med, spread = time_fn(fn, iters)
                rows.append(dict(base, variant=variant, ms=med, spread_ms=spread, **extra))
                log(ctx, f"  {m}x{n}x{k} {variant:<44} {med:8.4f} ms (+-{spread:.4f})")
            except Exception as exc:  # a variant that fails to compile/launch is reported, not fatal
                rows.append(
                    dict(
                        base,
                        variant=variant,
                        ms=float("nan"),
                        spread_ms=float("nan"),
                        error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                        **extra,
                    )
                )
                log(ctx, f"  {m}x{n}x{k} {variant:<44} FAILED {type(exc).__name__}: {str(exc)[:300]}")

        rec("cublas", lambda: a @ b)
        ref = a.float() @ b.float()
        for name, tile in GEMM_VARIANTS.items():
            frees = (0, wave_aligned_sms_free(cdiv(m, tile.block_m) * cdiv(n, tile.block_n), 20, sm_count))
            for sms_free in frees:
                fn = gemm_only(a, b, tile, sms_free, sm_count)
                try:
                    err = rel_err(fn(), ref)
                except Exception:
                    err = float("nan")
                rec(
                    f"triton_{name}_free{sms_free if sms_free == 0 else 'W'}",
                    fn,
                    rel_err=err,
                    sms_free=sms_free,
                )
        del ref
        rec("nccl_all_reduce", lambda: dist.all_reduce(full))
        rec("nccl_reduce_scatter", lambda: reduce_scatter_tensor(part, full))

        def seq_ar():
            c = a @ b
            dist.all_reduce(c)

        def seq_rs():
            c = a @ b
            reduce_scatter_tensor(part, c)

        rec("seq_all_reduce", seq_ar)
        rec("seq_reduce_scatter", seq_rs)
        for collective, op in (("all_reduce", gemm_all_reduce), ("reduce_scatter", gemm_reduce_scatter)):
            best = None
            for s in hand_schedules(collective, world, m, n, k, sm_count):
                rec(
                    f"fo_{collective}",
                    lambda s=s, op=op: op(a, b, schedule=s),
                    schedule=s.describe(),
                    sms_free=s.sms_free,
                    cap=s.nccl_max_ctas,
                    groups=str(list(s.groups)),
                    layout=s.layout,
                    wait=s.wait_mode,
                )
                if rows[-1]["ms"] == rows[-1]["ms"] and (best is None or rows[-1]["ms"] < best[0]):
                    best = (rows[-1]["ms"], s)
            if best is not None and collective == "all_reduce" and out_bytes > 0:
                timelines.append(
                    dict(
                        base,
                        collective=collective,
                        schedule=best[1].describe(),
                        **timeline(ctx, collective, a, b, best[1]),
                    )
                )


def host_costs(ctx, sm_count, out_dir: Path) -> dict:
    """Host ms per call of the pieces of an overlapped call, and of the op itself both ways."""
    import cProfile
    import io
    import pstats

    m, n, k = 2048, 4096, 4096
    a, b = operands(m, n, k, ctx.rank, seed=5)
    rt = runtime_for(torch.device("cuda", torch.cuda.current_device()), None)
    s = hand("all_reduce", ctx.world_size, m, n, k, pick_tile(m, n, sm_count), 20, 16, 2, sm_count=sm_count)
    capped = rt.comm_group(16)
    x = torch.randn(1 << 19, device="cuda", dtype=torch.bfloat16)
    comm = rt.comm_stream
    scratch = torch.zeros(4, dtype=torch.int32, device="cuda")
    waiter = rt.waiter("stream_wait")

    def on_comm(fn):
        def run():
            with torch.cuda.stream(comm):
                fn()

        return run

    cases = [
        ("ar_default_stream_world", lambda: dist.all_reduce(x)),
        ("ar_default_stream_capped", lambda: dist.all_reduce(x, group=capped)),
        ("ar_comm_stream_world", on_comm(lambda: dist.all_reduce(x))),
        ("ar_comm_stream_capped", on_comm(lambda: dist.all_reduce(x, group=capped))),
        ("stream_wait_value", lambda: waiter.wait(scratch, 0, 0)),
        ("gemm_launch", gemm_only(a, b, pick_tile(m, n, sm_count), 20, sm_count)),
        ("op_overlapped", lambda: gemm_all_reduce(a, b, schedule=s)),
        ("seq_cublas_nccl", lambda: dist.all_reduce(a @ b)),
    ]
    res = {}
    for (
        name,
        fn,
    ) in cases:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(100):
            fn()
        host = (time.perf_counter() - t) / 100 * 1e3
        torch.cuda.synchronize()
        total = (time.perf_counter() - t) / 100 * 1e3
        res[name] = (round(max_over_ranks(host), 4), round(max_over_ranks(total), 4))
    prof = cProfile.Profile() if ctx.rank == 0 else None
    dist.barrier()
    if prof:
        prof.enable()
    for _ in range(30):
        gemm_all_reduce(a, b, schedule=s)
    if prof:
        prof.disable()
    torch.cuda.synchronize()
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        (out_dir / "host_profile.txt").write_text(buf.getvalue())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="suites/h200_tp.yaml")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--stress-reps", type=int, default=64)
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    ctx = torchrun_context("nccl")
    torch.manual_seed(0)
    suite = yaml.safe_load(Path(args.suite).read_text())
    shapes = [tuple(s) for s in suite["shapes"]]
    odd = [tuple(s) for s in suite.get("odd_shapes", [])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fp = current_fingerprint(ctx.device, ctx.world_size)
    sm_count = fp.sm_count
    log(ctx, f"fingerprint: {fp.to_dict()}")
    t0 = time.time()
    checks: list[dict] = []
    timing: list[dict] = []
    timelines: list[dict] = []
    try:
        check_correctness(ctx, shapes + odd, sm_count, checks)
        log(ctx, f"correctness done in {time.time() - t0:.0f} s")
        stress_visibility(ctx, 4096, 8192, 4096, args.stress_reps, sm_count, checks)
        log(ctx, f"stress done in {time.time() - t0:.0f} s")
        host = host_costs(ctx, sm_count, out)
        for name, (h, w) in host.items():
            log(ctx, f"host {name:<28} host {h:.4f} ms/call, wall {w:.4f} ms/call")
        if not args.skip_timing:
            time_shapes(ctx, shapes, sm_count, timing, timelines)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        if ctx.rank == 0:
            write_csv(out / "gpu_check.csv", checks)
            write_csv(out / "gpu_timing.csv", [dict(r, device_key=fp.device_key) for r in timing])
            (out / "gpu_timeline.json").write_text(
                json.dumps(dict(fingerprint=fp.to_dict(), timelines=timelines), indent=1)
            )
    if ctx.rank == 0:
        summarize(checks, timing, shapes, time.time() - t0)
        for t in timelines:
            marks = " ".join(f"{k}={v:.3f}" for k, v in t["marks"].items())
            print(f"timeline {t['m']}x{t['n']}x{t['k']} [{t['schedule'].split(': ', 1)[1][:90]}] {marks}")
    dist.destroy_process_group()


def write_csv(path: Path, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def summarize(checks, timing, shapes, wall) -> None:
    bad = [c for c in checks if not c["ok"]]
    worst = max((c["rel_err"] for c in checks), default=0.0)
    print(f"\n=== correctness: {len(checks) - len(bad)}/{len(checks)} ok, worst rel err {worst:.2e}")
    for c in bad[:10]:
        print("  FAIL", c)
    if not timing:
        return
    print(f"=== timing (ms, median, max over ranks), wall {wall:.0f} s")
    print(
        f"{'shape':>18} {'cublas':>7} {'tri0':>7} {'tri20':>7} {'AR':>7} {'seqAR':>7} {'foAR':>7} "
        f"{'xAR':>5} {'RS':>7} {'seqRS':>7} {'foRS':>7} {'xRS':>5}"
    )
    gemm_ok = ar_win = 0
    for m, n, k in shapes:
        rs = [r for r in timing if (r["m"], r["n"], r["k"]) == (m, n, k) and r["ms"] == r["ms"]]

        def get(v):
            vals = [r["ms"] for r in rs if r["variant"] == v]
            return min(vals) if vals else float("nan")

        tri0 = min(get(f"triton_{v}_free0") for v in GEMM_VARIANTS)
        tri20 = min(get(f"triton_{v}_freeW") for v in GEMM_VARIANTS)
        cub, seq_ar, fo_ar = get("cublas"), get("seq_all_reduce"), get("fo_all_reduce")
        seq_rs, fo_rs = get("seq_reduce_scatter"), get("fo_reduce_scatter")
        gemm_ok += cub / tri0 >= 0.95
        ar_win += fo_ar < seq_ar
        print(
            f"{m}x{n}x{k:>6} {cub:7.3f} {tri0:7.3f} {tri20:7.3f} {get('nccl_all_reduce'):7.3f} {seq_ar:7.3f} "
            f"{fo_ar:7.3f} {seq_ar / fo_ar:5.2f} {get('nccl_reduce_scatter'):7.3f} {seq_rs:7.3f} "
            f"{fo_rs:7.3f} "
            f"{seq_rs / fo_rs:5.2f}"
        )
    print(
        f"triton >= 0.95x cublas on {gemm_ok}/{len(shapes)}; "
        f"overlapped AR beats seq on {ar_win}/{len(shapes)}"
    )


if __name__ == "__main__":
    main()
