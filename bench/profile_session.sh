#!/usr/bin/env bash
# The device session of the signalled GEMM on one H200 (kind nvidia-h200): kernel variants and
# the tile profiles, each beside cuBLAS, both timed back to back in one run. Results and their
# reading: docs/perf-notes.md, "The signalled GEMM at cuBLAS speed (one H200)".
#
#   bash bench/profile_session.sh variants  # every kernel variant (tile x KernelOptions) at full grid
#                                           # on six shapes, all in one interleaved timing with
#                                           # cuBLAS; the best four again at r = 0, 8, 12, 16 free
#                                           # SMs; then the GEMM's GPU tests (visibility first, alone)
#                                           # (stream_k, defer_signal, split_tail off: the kernel then)
#   bash bench/profile_session.sh ab        # the last partial wave run whole, by stream-K's rule,
#                                           # split into pieces by the rule, or split always (its
#                                           # own launch or fused into the whole waves'), or
#                                           # shared out always (stream-K, its runs in order or
#                                           # aligned, aligned and fused), with TMA-store
#                                           # epilogues, and the ping-pong kernel with its split
#                                           # tail, its K-split tail, without, forced (up
#                                           # to 4 parts a tile, or 8): one
#                                           # interleaved timing with cuBLAS per
#                                           # shape and grid (r = 0, 8, 12, 16), ten shapes (or
#                                           # AB_SHAPES=2048x4096x4096,8192x4096x2048; AB_VARIANTS
#                                           # names a subset; AB_TIMING=graphs replays each
#                                           # sample's calls from a CUDA graph)
#   bash bench/profile_session.sh last      # the visibility test, the profile, the other GPU tests
#   bash bench/profile_session.sh profile   # fo-tune's profile (fo_tune.calibrate.run.profile_shape and
#                                           # confirm_grids, as `fo-tune profile`: each grid's three
#                                           # fastest re-timed side by side) of the suite and five public TP=2
#                                           # layer shapes with search_spaces/hopper.yaml's tiles at
#                                           # r = 0, 8, 12, 16 (no tests: device_session.sh
#                                           # gpu1-tests runs them; PROFILE_SHAPES names a subset;
#                                           # PROFILE_TIMING=eager has the host issue every call,
#                                           # default graphs as `fo-tune profile` on GPUs)
#   bash bench/profile_session.sh tests     # the GEMM's GPU tests only
#
# Run from the repository root (where the device tool runs a command). Writes CSVs and logs under
# $OUT (default ./out): variants.csv and variants_reduced.csv (or ab.csv), profiles.tgz (results/profiles/<device-key>/*.csv, re-packed after each
# shape), smi.csv (SM clock and power every 200 ms), session.log. TESTS_S caps each pytest call.
# The image's python3 has no optuna; nothing here needs it.
set -uo pipefail
STAGE="${1:?stage: variants, ab, last, profile or tests}"
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT" /tmp/fk
ln -sfn "$PWD/kernels" /tmp/fk/fo_kernels
ln -sfn "$PWD/results" /tmp/fk/fo_results
export PYTHONPATH="/tmp/fk:$PWD" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore TRITON_INTERPRET=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 >"$OUT/smi.csv" &
SMI=$!
trap 'kill "$SMI" 2>/dev/null' EXIT

gpu_tests() {  # the visibility test alone (its reader needs the free SMs), then the rest in parallel
  if [ -z "${NO_VIS:-}" ]; then
    timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k visible 2>&1 |
      tail -n 15
  fi
  if [ -z "${VIS_ONLY:-}" ]; then
    timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "not visible" \
      -n 8 2>&1 | tail -n 15
  fi
}

variants() {
  python3 - "$OUT" "$1" <<'EOF'
import csv, functools, os, sys, torch
from unittest import mock
from fo_kernels import plan as fo_plan
from fo_kernels.gemm import BOperand, KernelOptions, signalled_gemm
from fo_kernels.plan import cdiv, make_plan
from fo_kernels.schedule import Problem, Schedule, Tile, TritonSettings
from fo_tune.ranks.timing import STEADY_SAMPLE_MS, time_interleaved
from fo_tune.ranks.trials import gemm_operands, rel_err

out_dir, mode = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
ROUNDS = 8
def T(bm, bn, bk, w, s, gm=8):
    return Tile(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=s)
# The first variants ran before the stream-K tail, the deferred signal and the split tail existed.
K = functools.partial(KernelOptions, stream_k=False, defer_signal=False, split_tail=False)
VARIANTS = {  # name: (tile, options); "base" is the kernel before this work (a loop per tile)
    "base": (T(128, 256, 64, 8, 3), K(flatten=False, subtile=1)),
    "loop_sub2": (T(128, 256, 64, 8, 3), K(flatten=False, subtile=2)),
    "flat_sub1": (T(128, 256, 64, 8, 3), K(subtile=1)),
    "flat_sub2": (T(128, 256, 64, 8, 3), K(subtile=2)),
    "flat_sub4": (T(128, 256, 64, 8, 3), K(subtile=4)),
    "flat_s4_sub2": (T(128, 256, 64, 8, 4), K(subtile=2)),
    "flat_s4_sub4": (T(128, 256, 64, 8, 4), K(subtile=4)),
    "flat_sub2_tma": (T(128, 256, 64, 8, 3), K(subtile=2, tma_store=True)),
    "flat_s4_sub2_tma": (T(128, 256, 64, 8, 4), K(subtile=2, tma_store=True)),
    "flat_s4_sub4_tma": (T(128, 256, 64, 8, 4), K(subtile=4, tma_store=True)),
    "flat_s4_sub2_gm4": (T(128, 256, 64, 8, 4, 4), K(subtile=2)),
    "flat_s4_sub2_gm16": (T(128, 256, 64, 8, 4, 16), K(subtile=2)),
    "256x128_s3_sub2": (T(256, 128, 64, 8, 3), K(subtile=2)),
    "256x128_s4_sub2": (T(256, 128, 64, 8, 4), K(subtile=2)),
    "256x128_s4_sub2_tma": (T(256, 128, 64, 8, 4), K(subtile=2, tma_store=True)),
    "128x128_s5_sub2": (T(128, 128, 64, 8, 5), K(subtile=2)),
    "128x128w4_s4_sub2": (T(128, 128, 64, 4, 4), K(subtile=2)),
    "128x128x128_s3_sub2": (T(128, 128, 128, 8, 3), K(subtile=2)),
    "128x256x128_s2_sub2": (T(128, 256, 128, 8, 2), K(subtile=2)),
    "64x256_w4_s4_sub2": (T(64, 256, 64, 4, 4), K(subtile=2)),
}
SHAPES = [(2048, 4096, 4096), (4096, 8192, 4096), (4096, 8192, 14336), (8192, 8192, 8192),
          (3000, 5120, 6912), (8192, 4096, 2048)]
def runner(a, b, tile, opts, r, max_parts=None):
    m, k = a.shape
    n = b.shape[1]
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    s = Schedule(collective="all_reduce", dtype="bfloat16", world_size=1, problem=Problem(m=m, n=n, k=k),
                 settings=TritonSettings(tile=tile, sms_free=r, signal_tiles=tiles, groups=(1,), layout="row_band"))
    plan = make_plan(s, m, n, k, sm_count=SMS)
    cnt = torch.zeros(4, dtype=torch.int32, device=dev)
    ug = torch.zeros(1, dtype=torch.int32, device=dev)
    gi = torch.tensor([0, m], dtype=torch.int32, device=dev)
    out = torch.empty(m * n, dtype=a.dtype, device=dev)
    op = BOperand.of(b)
    def run():
        if max_parts is None:
            signalled_gemm(a, op, out, plan, tile, counters=cnt, unit_group=ug, group_info=gi, options=opts)
        else:  # the K-split tail with another cap on its parts (the tail plan is read on the host)
            with mock.patch.object(fo_plan, "PINGPONG_MAX_PARTS", max_parts):
                signalled_gemm(a, op, out, plan, tile, counters=cnt, unit_group=ug, group_info=gi, options=opts)
        return out.view(m, n)
    return run, plan.grid, out

# AB_TIMING=graphs: each sample one CUDA graph replay of its calls (the GPU's own time, as
# `fo-tune profile --timing graphs`); eager (the default here): the host issues every call.
GRAPHS = os.environ.get("AB_TIMING", "eager") == "graphs"
def checked(a, b, ref, name, r):
    tile, opts, *max_parts = VARIANTS[name]  # (tile, options[, a cap on the K-split tail's parts])
    try:
        run, grid, out = runner(a, b, tile, opts, r, *max_parts)
        out.fill_(float("nan"))
        err = rel_err(run(), ref)
        return (run, grid, err, "ok", out) if err < 1e-2 else (None, grid, err, f"wrong result {err:.2e}", out)
    except Exception as exc:
        return None, 0, float("nan"), f"skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", None

def timed(fns, outs, ref):
    """One interleaved timing of ``fns``, then each output (poisoned right before the timed
    samples) checked against ``ref``: a variant whose timed calls left a wrong result is dropped."""
    def poison():
        for out in outs.values():
            out.fill_(float("nan"))
    t = time_interleaved(fns, dev, warmup=3, rounds=ROUNDS, min_sample_ms=STEADY_SAMPLE_MS, graphs=GRAPHS,
                         before_samples=poison)
    for name, out in outs.items():
        err = rel_err(out.view(ref.shape), ref)
        if not err < 1e-2:
            print(f"  {name}: wrong result after the timed calls ({err:.2e}): dropped")
            t.pop(name)
    return t

def timed_variants(a, b, ref, r):
    """Every variant checked at r free SMs, then the correct ones timed in alternation with cuBLAS:
    (timings by name, cuBLAS's median ms, (grid, error, status) by variant name)."""
    fns, meta, outs = {"cublas": lambda: a @ b}, {}, {}
    for name in VARIANTS:
        run, grid, err, status, out = checked(a, b, ref, name, r)
        meta[name] = (grid, err, status)
        if run is not None:
            fns[name], outs[name] = run, out
    t = timed(fns, outs, ref)
    for name in outs.keys() - t.keys():
        meta[name] = (*meta[name][:2], "wrong result after the timed calls")
    return t, t["cublas"].median_ms, meta

cols = ["m", "n", "k", "variant", "sms_free", "grid", "median_ms", "iqr_ms", "samples", "cublas_ms",
        "cublas_over_ours", "share_ratio", "rel_err", "status"]

def row(m, n, k, name, r, grid, x, cub, share, err, status):  # one CSV row of cols (x: a timing or None)
    return [m, n, k, name, r, grid, x and x.median_ms, x and x.iqr_ms, x and x.samples, cub,
            x and cub / x.median_ms, share, err, status]

def write_csv(fname, rows):
    with open(f"{out_dir}/{fname}", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(rows)
if mode == "ab":  # the last partial wave: whole, stream-K's rule, split into pieces (rule, forced)
    t4 = T(128, 256, 64, 8, 4)
    tpp = Tile(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=5, pingpong=True)
    O = KernelOptions
    OWN = dict(fuse_tail=False)  # the tail in a launch of its own
    VARIANTS = {
        "default": (t4, O()),  # the shipped options
        "waves": (t4, O(stream_k=False, split_tail=False)),
        "stream_k": (t4, O(split_tail=False, stream_k_aligned=False, **OWN)),  # where its rule says
        "split": (t4, O(stream_k_aligned=False, **OWN)),  # the split where its rule says, else stream-K's
        "split_forced": (t4, O(split_tail=True, **OWN)),
        "split_fused": (t4, O(fuse_tail=True)),
        "split_fused_forced": (t4, O(split_tail=True, fuse_tail=True)),
        "stream_k_forced": (t4, O(stream_k=True, stream_k_aligned=False, **OWN)),
        "stream_k_aligned": (t4, O(stream_k=True, stream_k_aligned=True, **OWN)),
        "stream_k_aligned_fused": (t4, O(stream_k=True, stream_k_aligned=True, fuse_tail=True)),
        "stream_k_rule_fused": (t4, O(split_tail=False)),  # where its rule says, aligned, fused
        # TMA-store epilogues, whose wait for the writes the deferred signal moves a tile later
        "waves_tma": (t4, O(stream_k=False, split_tail=False, tma_store=True)),
        "split_tma": (t4, O(tma_store=True, **OWN)),
        "split_fused_tma": (t4, O(fuse_tail=True, tma_store=True)),
        # the ping-pong kernel (128x128, 5 stages): its tail by the rules (the K-split tail first),
        # whole waves, the split tail's pieces by their rule or forced, the K-split tail forced
        "pingpong": (tpp, O()),
        "pingpong_waves": (tpp, O(stream_k=False, split_tail=False)),
        "pingpong_split": (tpp, O(stream_k=False)),
        "pingpong_split_forced": (tpp, O(split_tail=True)),
        "pingpong_k_split_forced": (tpp, O(stream_k=True)),
        "pingpong_k_split8_forced": (tpp, O(stream_k=True), 8),  # up to 8 parts a tile
    }
    if os.environ.get("AB_VARIANTS"):  # e.g. AB_VARIANTS=split,split_tma (a subset, by name)
        VARIANTS = {name: VARIANTS[name] for name in os.environ["AB_VARIANTS"].split(",")}
    SHAPES += [(16384, 8192, 4096), (8192, 4096, 7168), (8192, 3584, 9472), (4096, 8192, 14784)]
    if os.environ.get("AB_SHAPES"):  # e.g. AB_SHAPES=2048x4096x4096,8192x4096x2048
        SHAPES = [tuple(int(x) for x in s.split("x")) for s in os.environ["AB_SHAPES"].split(",")]
    ROUNDS = 10
    rows, full = [], {}
    for m, n, k in SHAPES:
        a, b = gemm_operands(m, n, k, "bfloat16", dev, seed=m + n + k)
        ref = a.float() @ b.float()
        line = []
        for r in (0, 8, 12, 16):
            t, cub, meta = timed_variants(a, b, ref, r)
            for name, (grid, err, status) in meta.items():
                x = t.get(name)
                if r == 0 and x:
                    full[(m, n, k, name)] = x.median_ms / cub  # ours over cuBLAS, this timing's
                share = x and r and x.median_ms / cub / full[(m, n, k, name)] / (SMS / (SMS - r))
                rows.append(row(m, n, k, name, r, grid, x, cub, share or "", err, status))
                line.append(f"{name}@{r} {cub / x.median_ms:.3f}" + (f"/{share:.3f}" if share else "") if x else f"{name}@{r} {status}")
        print(f"{m}x{n}x{k}: " + ", ".join(line))
        write_csv("ab.csv", rows)  # after every shape: a call cut short keeps what it timed
    sys.exit(0)
var_rows, red_rows = [], []
for m, n, k in SHAPES:
    a, b = gemm_operands(m, n, k, "bfloat16", dev, seed=m + n + k)
    ref = a.float() @ b.float()
    t, cub, meta = timed_variants(a, b, ref, 0)
    for name, (grid, err, status) in meta.items():
        var_rows.append(row(m, n, k, name, 0, grid, t.get(name), cub, "", err, status))
    ranked = sorted((nm for nm in meta if nm in t), key=lambda nm: t[nm].median_ms)
    print(f"{m}x{n}x{k}: cuBLAS {cub:.3f} ms; " + ", ".join(f"{nm} {cub / t[nm].median_ms:.3f}" for nm in ranked[:6]))
    fns, outs = {"cublas": lambda: a @ b}, {}
    for name in ranked[:4]:
        for r in (0, 8, 12, 16):
            run, grid, err, status, out = checked(a, b, ref, name, r)
            if run is not None:
                fns[f"{name}@{r}"], outs[f"{name}@{r}"] = run, out
    t = timed(fns, outs, ref)
    cub = t["cublas"].median_ms
    for key, x in t.items():
        if key == "cublas":
            continue
        name, r = key.split("@")
        full = t[f"{name}@0"].median_ms
        share = SMS / (SMS - int(r))
        red_rows.append(row(m, n, k, name, r, SMS - int(r), x, cub, x.median_ms / full / share, "", "ok"))
    best = ranked[0]
    print("   reduced " + best + ": " + ", ".join(
        f"r={r} {t[f'{best}@{r}'].median_ms / t[f'{best}@0'].median_ms / (SMS / (SMS - r)):.3f}" for r in (8, 12, 16)
        if f"{best}@{r}" in t) + " (time / full-grid time / SM share)")
write_csv(f"{mode}.csv", var_rows)
write_csv(f"{mode}_reduced.csv", red_rows)
EOF
}

profile() {  # the driver is a file: the pool spawns its rank process, which imports __main__
  cat >/tmp/profile_driver.py <<'EOF'
import os, subprocess, sys
from pathlib import Path
from fo_tune.calibrate.run import confirm_grids, profile_shape
from fo_tune.ranks.launch import FingerprintTask, open_pool
from fo_tune.calibrate.calibration import timing_name
from fo_tune.calibrate.files import grids_path, write_grids_csv, write_profile_csv
from fo_tune.space import load_space


def main():

    out_dir = Path(sys.argv[1])
    # The suite (suites/h200_tp.yaml) and five public TP=2 layer shapes (per-rank GEMM M x N x K):
    SHAPES = {
        (2048, 4096, 4096): "suite", (4096, 8192, 4096): "suite", (4096, 8192, 14336): "suite",
        (8192, 8192, 8192): "suite", (16384, 8192, 4096): "suite",
        (8192, 4096, 7168): "Llama-3-8B / Mixtral-8x7B expert down_proj (K = 14336 / 2)",
        (8192, 4096, 2048): "Llama-3-8B / Mixtral-8x7B o_proj (K = 4096 / 2)",
        (3000, 5120, 6912): "Qwen2.5-14B down_proj (K = 13824 / 2), M not a multiple of 128",
        (8192, 3584, 9472): "Qwen2.5-7B down_proj (K = 18944 / 2)",
        (4096, 8192, 14784): "Qwen2.5-72B down_proj (K = 29568 / 2)",
    }
    if os.environ.get("PROFILE_SHAPES"):  # e.g. PROFILE_SHAPES=4096x8192x14336,4096x8192x14784
        SHAPES = {s: SHAPES[s] for s in (tuple(int(x) for x in v.split("x")) for v in os.environ["PROFILE_SHAPES"].split(","))}
    FREES = (0, 8, 12, 16)
    graphs = os.environ.get("PROFILE_TIMING", "graphs") == "graphs"
    tiles = tuple(load_space("search_spaces/hopper.yaml").tile_candidates())
    with open_pool(1, backend="nccl") as pool:
        key = pool.run(FingerprintTask())[0].device_key
        for (m, n, k), what in SHAPES.items():
            points = profile_shape(pool, m, n, k, tiles, FREES, "bfloat16", graphs=graphs)
            csv_path = write_profile_csv(
                points, Path("/tmp/prof/profiles") / key / f"{m}x{n}x{k}-bfloat16.csv", key, timing_name(graphs)
            )
            grids = confirm_grids(pool, points, "bfloat16", graphs=graphs)  # each grid's fastest three, side by side
            write_grids_csv(grids, grids_path(csv_path), key)
            subprocess.run(["tar", "-C", "/tmp/prof", "-czf", str(out_dir / "profiles.tgz"), "profiles"], check=True)
            ok = [p for p in points if p.status == "ok"]
            best = {r: min((p for p in ok if p.sms_free == r), key=lambda p: p.time_ms, default=None) for r in FREES}
            b0 = best[0]
            line = f"{m}x{n}x{k} ({what}): best r=0 {b0.tile} {b0.time_ms:.3f} ms, {b0.cublas_ms / b0.time_ms:.3f}x cuBLAS"
            for r in FREES[1:]:  # the best at r over the best at full grid, over the SM share
                if best[r] is not None:
                    line += f"; r={r} {best[r].time_ms / b0.time_ms / (b0.grid / best[r].grid):.3f}"
            print(line, f"({len(points) - len(ok)} skipped, {timing_name(graphs)}); side by side: "
                  + ", ".join(f"r={g.sms_free} {g.over_share:.3f} ({g.tile})" for g in grids[1:])
                  + (f", r=0 {grids[0].cublas_ms / grids[0].time_ms:.3f}x cuBLAS" if grids else ""))


if __name__ == "__main__":  # the pool's rank process imports this file again (spawn)
    main()
EOF
  python3 /tmp/profile_driver.py "$OUT"
}

python3 cli.py profile --help >/dev/null && echo "fo-tune profile --help: ok (no optuna needed)"
case "$STAGE" in
  variants) variants variants; gpu_tests ;;
  ab) variants ab ;;
  last) VIS_ONLY=1 gpu_tests; profile; NO_VIS=1 gpu_tests ;;
  profile) profile ;;
  tests) gpu_tests ;;
  *) echo "unknown stage $STAGE: variants, ab, last, profile or tests" >&2; exit 2 ;;
esac 2>&1 | tee "$OUT/session.log"
