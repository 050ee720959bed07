#!/usr/bin/env bash
# The device session that produces what results/ ships for H200 x2 (device kind nvidia-h200-x2):
# one stage per device call, each within the 10-minute limit of a call. From the repository root:
#
#   bash bench/device_session.sh STAGE
#
# Stages, in the order a new machine runs them (what each writes, and where it is committed):
#
#   tests    The GPU tests: -m "gpu or multigpu" over tests/test_gpu.py tests/test_copy_engine.py
#            tests/test_bench.py tests/test_search.py. TESTS_FILES, TESTS_K (pytest -k) and
#            TESTS_TIMEOUT_S narrow them; the whole set takes ~8-9 minutes on H200 x2, so a slow
#            machine runs it in two calls (TESTS_K="not tiled_ops", then TESTS_K=tiled_ops).
#   calib    fo-tune calibrate, both collectives, every tile of search_spaces/hopper.yaml
#            -> calibration/  (results/calibration/<key>/tp2/; docs/design.md#cost-model)
#   compare  Hybrid against exhaustive search on bench/h200_small_space.yaml, AllReduce
#            4096x8192x4096 and 16384x8192x4096: every point measured, then the model's top 7, then
#            both bests re-timed side by side (bench/hybrid_vs_exhaustive.py)
#            -> hybrid-vs-exhaustive/  (results/search/<key>/hybrid-vs-exhaustive/; docs/design.md#search)
#   suite    Hybrid search of the suite's shapes (suites/h200_tp.yaml), both collectives, with the
#            space's copy-engine candidates, rows merged into results/tables
#            -> tables/ search/  (results/tables/<key>/, results/search/<key>/*-hybrid/)
#   mrange   M-range rows, M 512..16384 for the suite's four (N, K), one collective per search under
#            a time budget (MRANGE_BUDGET_S, default 140 s), copy-engine candidates cut to 1, 2 and 4
#            equal chunks, rows merged into results/tables
#            -> tables/ search/  (results/tables/<key>/, results/search/<key>/*-hybrid-mrange/)
#   bench3   fo-tune bench of the suite with the tables in results/tables, 30 rounds, in three
#            processes -> bench1/ bench2/ bench3/  (results/bench/<key>/tp2-s16{,-rerun,-run3}/)
#   spot     The bench at M values between the tuned ones, and at the shapes where the tables say
#            overlap: false, 20 rounds each -> mrange-spot/ fallback-spot/  (results/bench/<key>/)
#
# On one GPU (device kind nvidia-h200), two stages, one call each:
#
#   gpu1-tests  The one-GPU tests (-m gpu): the signal-visibility test alone first, then the rest
#               of tests/test_gpu.py tests/test_gpu_ops.py tests/test_bench.py tests/test_cli.py
#               on GPU1_WORKERS pytest-xdist workers (default 6).
#   gpu1        fo-tune demo at world size 1; fo-tune bench --world-size 1 of the suite, all three
#               collectives, 30 rounds, in two processes (no table for world size 1: every call is a
#               table miss, the GEMM alone) -> bench-w1-1/ bench-w1-2/  (results/bench/<w1 key>/
#               w1-s16/ and w1-s16-rerun/); GPU1_BENCH_ONLY=1 stops there; fo-tune calibrate
#               --world-size 1 --only copy_engine into a copy of the shipped TP=2 calibration, then
#               fo-tune model check with it -> calibration-w1ce.yaml, model_check.log
#
# Everything a stage writes lands in $OUT/results-STAGE.tgz (the device tool returns few files), the
# summaries on stdout. The device image has torch, triton, typer and rich but not optuna, and not
# this package: optuna's wheels travel in .whl/ (an ignored folder, named in the call's carry) and are
# installed into /tmp/site, and kernels/ and results/ are exposed as fo_kernels and fo_results through
# a folder of symlinks on PYTHONPATH. NVLink multicast stays off (docs/design.md#the-card).
set -uo pipefail
STAGE="${1:?stage: tests, calib, compare, suite, mrange, bench3, spot, gpu1-tests or gpu1}"
KEY=nvidia-h200-cc90-132sm-w2-nvlink18
CAL="results/calibration/$KEY/tp2/calibration.yaml"
SUITE=suites/h200_tp.yaml
SMALL=bench/h200_small_space.yaml
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONWARNINGS=ignore FO_TUNE_DEBUG=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 3
else
  echo "no .whl/ folder: optuna must already be importable for the search stages"
fi
mkdir -p /tmp/fk && ln -sfn "$PWD/kernels" /tmp/fk/fo_kernels && ln -sfn "$PWD/results" /tmp/fk/fo_results
export PYTHONPATH="/tmp/site:/tmp/fk:$PWD"
RES=/tmp/res-$STAGE
rm -rf "$RES"
mkdir -p "$RES"
finish() { tar czf "$OUT/results-$STAGE.tgz" -C "$RES" . ; }
trap finish EXIT
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
# The tables and search reports as the stage left them, into the returned archive.
keep_tables() {
  mkdir -p "$RES/tables" && cp -r results/tables/. "$RES/tables/"
  cp -r results/search "$RES/search" 2>/dev/null
}
# bench TIMEOUT NAME REPS ARGS...: fo-tune bench into $RES/NAME, its table of results shown.
bench() {
  local timeout_s="$1" name="$2" reps="$3"
  shift 3
  timeout "$timeout_s" python3 cli.py bench "$@" -c "${COLLECTIVES:-all_reduce,reduce_scatter}" --reps "$reps" \
    --out "$RES/$name" > "$RES/$name.log" 2>&1
  grep -v "━" "$RES/$name.log" | grep "│" | tail -24
}

case "$STAGE" in
tests)
  stamp "GPU tests"
  timeout "${TESTS_TIMEOUT_S:-560}" python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
    --durations=6 \
    ${TESTS_FILES:-tests/test_gpu.py tests/test_copy_engine.py tests/test_bench.py tests/test_search.py} \
    -k "${TESTS_K:-}" 2>&1 | tee "$RES/pytest_gpu.log" | tail -14
  ;;
calib)
  stamp "calibrate: every tile of search_spaces/hopper.yaml, all_reduce + reduce_scatter"
  timeout 500 python3 cli.py calibrate --world-size 2 --backend nccl -c all_reduce,reduce_scatter \
    --out "$RES/calibration" > "$RES/calibrate.log" 2>&1
  tail -40 "$RES/calibrate.log"
  ;;
compare)
  C="$RES/hybrid-vs-exhaustive"
  SHAPES=(--shape 4096x8192x4096 --shape 16384x8192x4096)
  rm -rf /tmp/exhaustive /tmp/hybrid
  stamp "exhaustive: every point of $SMALL measured"
  timeout 240 python3 cli.py search --mode measure --exhaustive --space "$SMALL" --calibration "$CAL" \
    "${SHAPES[@]}" --out /tmp/exhaustive > "$RES/exhaustive.log" 2>&1
  tail -14 "$RES/exhaustive.log"
  stamp "hybrid: the model's top 7 measured"
  timeout 100 python3 cli.py search --mode hybrid --top-k 7 --space "$SMALL" --calibration "$CAL" \
    "${SHAPES[@]}" --out /tmp/hybrid > "$RES/hybrid.log" 2>&1
  tail -12 "$RES/hybrid.log"
  mkdir -p "$C"
  cp -r /tmp/exhaustive/report/all_reduce-w2-bfloat16-measure "$C/exhaustive"
  cp -r /tmp/hybrid/report/all_reduce-w2-bfloat16-hybrid "$C/hybrid-top7"
  stamp "both bests re-timed side by side"
  timeout 100 python3 bench/hybrid_vs_exhaustive.py "$C/exhaustive/summary.yaml" \
    "$C/hybrid-top7/summary.yaml" --out "$C" 2>&1 | tail -3
  ;;
suite)
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  stamp "hybrid search of the suite, both collectives -> results/tables"
  timeout 480 python3 cli.py search --mode hybrid --top-k 4 --calibration "$CAL" --shapes "$SUITE" \
    -c all_reduce,reduce_scatter --table-dir results/tables --storage "sqlite:///$RES/studies.db" \
    > "$RES/search_suite.log" 2>&1
  tail -34 "$RES/search_suite.log"
  keep_tables
  ;;
mrange)
  # Within one call: the suite's searches never gained from 3 or 6 chunks or light last chunks by
  # more than noise (docs/design.md#search), so the M-range rows get 1, 2 and 4 equal chunks; a
  # search past its time budget skips its remaining shapes, and the neighbouring ranges stretch.
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  python3 - <<'PY' || exit 3
import yaml
space = yaml.safe_load(open("search_spaces/hopper.yaml"))
ring = space["engines"]["copy_engine"]["ring"]
ring["chunks"] = [1, 2, 4]
ring.pop("weights", None)
yaml.safe_dump(space, open("/tmp/mrange_space.yaml", "w"), sort_keys=False)
PY
  for coll in all_reduce reduce_scatter; do
    stamp "M-range rows, $coll: M = 512..16384 for the suite's (N, K)"
    timeout 250 python3 cli.py search --mode hybrid --top-k 1 --trials 120 --calibration "$CAL" \
      --space /tmp/mrange_space.yaml --time-budget "${MRANGE_BUDGET_S:-140}" \
      --shape 1x4096x4096 --shape 1x8192x4096 --shape 1x8192x14336 --shape 1x8192x8192 --m-range 512:16384 \
      -c "$coll" --table-dir results/tables --storage "sqlite:///$RES/studies.db" \
      > "$RES/search_mrange_$coll.log" 2>&1
    grep -v "━" "$RES/search_mrange_$coll.log" | tail -12
  done
  keep_tables
  ;;
bench3)
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  for i in 1 2 3; do
    stamp "bench of the suite, process $i (30 rounds)"
    bench 180 "bench$i" 30 --suite "$SUITE"
  done
  ;;
spot)
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  stamp "bench at untuned M (20 rounds)"
  bench 200 mrange-spot 20 --shape 3072x8192x4096 --shape 6144x8192x14336 --shape 1024x8192x8192 \
    --shape 1024x4096x4096
  stamp "bench at the tables' overlap: false shapes (20 rounds)"
  bench 250 fallback-spot 20 --shape 512x4096x4096 --shape 1024x4096x4096 --shape 512x8192x4096 \
    --shape 512x8192x8192 --shape 512x8192x14336
  ;;
gpu1-tests)
  stamp "the signal-visibility test alone"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k visible 2>&1 \
    | tee "$RES/pytest_visibility.log" | tail -3
  stamp "the other one-GPU tests on ${GPU1_WORKERS:-6} workers"
  timeout 380 python3 -m pytest -q -p no:cacheprovider -m gpu -n "${GPU1_WORKERS:-6}" --durations=8 \
    tests/test_gpu.py tests/test_gpu_ops.py tests/test_bench.py tests/test_cli.py -k "not visible" 2>&1 \
    | tee "$RES/pytest_gpu1.log" | tail -16
  ;;
gpu1)
  stamp "fo-tune demo on one GPU"
  timeout 90 python3 cli.py demo > "$RES/demo.log" 2>&1
  tail -12 "$RES/demo.log"
  for i in 1 2; do
    stamp "bench of the suite at world size 1, three collectives, process $i (30 rounds)"
    COLLECTIVES=all_reduce,reduce_scatter,all_gather bench 200 "bench-w1-$i" 30 --suite "$SUITE" --world-size 1
  done
  [ -n "${GPU1_BENCH_ONLY:-}" ] && { stamp done; exit 0; }
  stamp "calibrate --world-size 1 --only copy_engine, into a copy of the shipped calibration"
  cp "$CAL" "$RES/calibration-w1ce.yaml"
  timeout 160 python3 cli.py calibrate --world-size 1 --only copy_engine --into "$RES/calibration-w1ce.yaml" \
    > "$RES/calibrate_w1.log" 2>&1
  tail -8 "$RES/calibrate_w1.log"
  timeout 40 python3 cli.py model check --calibration "$RES/calibration-w1ce.yaml" > "$RES/model_check.log" 2>&1
  tail -2 "$RES/model_check.log"
  ;;
*)
  echo "unknown stage $STAGE (tests, calib, compare, suite, mrange, bench3, spot, gpu1-tests or gpu1)"
  exit 2
  ;;
esac
stamp done
