#!/usr/bin/env bash
# Device calls on H200 x2 for the search and bench issues; one stage per call (each < 10 min).
# Results land in $OUT/results-STAGE.tgz (the device tool returns at most 8 files, so stages can
# run one after another in one call); summaries on stdout.
#
#   bash bench/search_session.sh calib   # GPU tests, full calibration (all tiles, AR + RS),
#                                        # hybrid vs exhaustive on two suite shapes
#   bash bench/search_session.sh compare # search GPU tests; hybrid top-7 on the small space, its
#                                        # best re-timed beside the exhaustive best
#   bash bench/search_session.sh tables  # hybrid search of the suite (both collectives) into
#                                        # results/tables, M-range rows, lookup cost, bench twice
#   bash bench/search_session.sh bench   # bench again with the committed tables
#   bash bench/search_session.sh ce      # copy-engine GPU tests; hybrid search of the suite (now
#                                        # with copy-engine candidates) into results/tables; bench
#                                        # twice (two processes, 30 rounds each)
#   bash bench/search_session.sh ce-mrange  # the M-range rows again (with copy-engine candidates),
#                                        # then the bench again
#   bash bench/search_session.sh mrange-lite  # the M-range rows with fewer copy-engine candidates,
#                                        # one collective per search under --time-budget
#   bash bench/search_session.sh bench-twice  # the bench with the committed tables in two processes,
#                                        # 30 rounds each (10 rounds left 0.1 ms outliers, run 22)
#   bash bench/search_session.sh diag    # the own-graph GPU test, then a two-shape search with
#                                        # warnings shown (run 28 found a capture failure this way)
#   bash bench/search_session.sh tiled   # the copy engine's tiled mode: bench/ce_tiled_probe.py
#                                        # (suite shapes, both collectives; PROBE_ARGS adds options),
#                                        # then its GPU tests (TESTS_K picks them)
#   bash bench/search_session.sh streams # the chunk GEMMs on one stream or two: bench/ce_streams_probe.py
#                                        # (suite shapes, both collectives; PROBE_ARGS adds options),
#                                        # then the copy engine's GPU tests (TESTS_K picks them,
#                                        # TESTS_FILES their files)
#   bash bench/search_session.sh power   # a sustained GEMM's clock and power beside a duty-cycled
#                                        # one and one beside copies (bench/power_probe.py, one GPU)
#   bash bench/search_session.sh final   # the committed tables: host vs GPU time per call
#                                        # (bench/host_probe.py --profile, 2048x4096x4096), the
#                                        # bench in three processes (30 rounds), then the GPU tests
#                                        # of the ops, the copy engine and the bench (last, so a
#                                        # test that hangs cannot disturb a bench)
#   bash bench/search_session.sh mrange-s16  # a spot check at untuned M, the mrange-lite stage
#                                        # (its confirmations now take 16 ms samples), the spot
#                                        # check again
#   bash bench/search_session.sh bench3  # final's three benches only
#   bash bench/search_session.sh tests   # final's GPU tests only
#   bash bench/search_session.sh fallback  # the overlap: false fallback's own graphs: their GPU test
#                                        # and the copy engine's graph tests, eager vs graphed
#                                        # (bench/fallback_graph_probe.py), the bench at the tables'
#                                        # overlap: false shapes (20 rounds); SUITE=1: then the
#                                        # suite's bench (30 rounds); fallback-spot: the bench only
#   bash bench/search_session.sh graphs  # the engine's own graphs: eager / own-graph / replayed
#                                        # timings (bench/ce_graph_probe.py), every GPU test, then
#                                        # the bench twice with the committed tables
#
# The image's python has torch/triton/typer/rich but not optuna: its wheels travel in .whl/
# (name .whl in the run's carry). CAL is the calibration the searches read (committed after `calib`).
set -uo pipefail
STAGE="${1:?stage: calib, compare, tables, bench, bench-twice, ce, ce-mrange, mrange-lite, graphs, tiled, streams, power, final, bench3, tests, mrange-s16, fallback, fallback-spot or diag}"
KEY=nvidia-h200-cc90-132sm-w2-nvlink18
CAL="results/calibration/$KEY/tp2/calibration.yaml"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONWARNINGS=ignore FO_TUNE_DEBUG=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 3
mkdir -p /tmp/fk && ln -sfn "$PWD/kernels" /tmp/fk/fo_kernels && ln -sfn "$PWD/results" /tmp/fk/fo_results
export PYTHONPATH="/tmp/site:/tmp/fk:$PWD"
RES=/tmp/res-$STAGE; rm -rf "$RES"; mkdir -p "$RES"
finish() { tar czf "$OUT/results-$STAGE.tgz" -C "$RES" . ; }
trap finish EXIT
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
# The tables and search reports as they are now, into the returned archive.
keep_tables() {
  mkdir -p "$RES/tables" && cp -r results/tables/. "$RES/tables/"
  cp -r results/search "$RES/search" 2>/dev/null
}
# bench_suite TIMEOUT NAME LINES: the suite's bench into $RES/NAME, the last LINES of its log shown.
bench_suite() {
  timeout "$1" python3 cli.py bench --suite suites/h200_tp.yaml -c all_reduce,reduce_scatter \
    --out "$RES/$2" ${REPS:+--reps "$REPS"} > "$RES/$2.log" 2>&1
  tail -"$3" "$RES/$2.log"
}
# bench_twice TIMEOUT LINES: bench_suite in two processes, into $RES/bench1 and $RES/bench2.
bench_twice() {
  for i in 1 2; do
    stamp "bench run $i${REPS:+ ($REPS rounds)}"
    bench_suite "$1" "bench$i" "$2"
  done
}
# Hybrid searches into results/tables, both collectives, one sqlite study file for the call.
# search_suite TIMEOUT TOP_K: the suite's shapes (log search_suite.log, its last 34 lines shown).
search_suite() {
  timeout "$1" python3 cli.py search --mode hybrid --top-k "$2" --calibration "$CAL" --shapes suites/h200_tp.yaml \
    -c all_reduce,reduce_scatter --table-dir results/tables --storage "sqlite:///$RES/studies.db" \
    > "$RES/search_suite.log" 2>&1
  tail -34 "$RES/search_suite.log"
}
# search_mrange TIMEOUT LINES: M-range rows, M = 512..16384 for the suite's four (N, K) pairs.
search_mrange() {
  timeout "$1" python3 cli.py search --mode hybrid --top-k 2 --trials 120 --calibration "$CAL" \
    --shape 1x4096x4096 --shape 1x8192x4096 --shape 1x8192x14336 --shape 1x8192x8192 --m-range 512:16384 \
    -c all_reduce,reduce_scatter --table-dir results/tables --storage "sqlite:///$RES/studies.db" \
    > "$RES/search_mrange.log" 2>&1
  tail -"$2" "$RES/search_mrange.log"
}

if [ "$STAGE" = calib ]; then
  stamp "GPU tests"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -x -m "gpu or multigpu" \
    tests/test_gpu.py tests/test_search.py tests/test_bench.py 2>&1 | tee "$RES/pytest_gpu.log" | tail -4
  stamp "calibrate (all tiles of search_spaces/hopper.yaml, all_reduce + reduce_scatter)"
  timeout 330 python3 cli.py calibrate --world-size 2 --backend nccl -c all_reduce,reduce_scatter \
    --out "$RES/calibration" > "$RES/calibrate.log" 2>&1
  tail -40 "$RES/calibrate.log"
  [ -f "$RES/calibration/calibration.yaml" ] && CAL="$RES/calibration/calibration.yaml"
  SMALL=bench/h200_small_space.yaml
  stamp "exhaustive (measure every point of $SMALL) vs hybrid (model top-9), 2 shapes, AR, calibration $CAL"
  timeout 240 python3 cli.py search --mode measure --exhaustive --space $SMALL --calibration "$CAL" \
    --shape 4096x8192x4096 --shape 16384x8192x4096 --out "$RES/exh" > "$RES/exhaustive.log" 2>&1
  tail -14 "$RES/exhaustive.log"
  timeout 100 python3 cli.py search --mode hybrid --top-k 9 --space $SMALL --calibration "$CAL" \
    --shape 4096x8192x4096 --shape 16384x8192x4096 --out "$RES/exh" > "$RES/hybrid.log" 2>&1
  tail -14 "$RES/hybrid.log"
elif [ "$STAGE" = compare ]; then
  stamp "GPU tests of search and bench"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/test_search.py 2>&1 \
    | tee "$RES/pytest_search.log" | tail -3
  SMALL=bench/h200_small_space.yaml
  EXH=results/search/$KEY/hybrid-vs-exhaustive
  stamp "hybrid (model top-7) on the small space, then both bests re-timed side by side"
  timeout 60 python3 cli.py search --mode hybrid --top-k 7 --space $SMALL --calibration "$CAL" \
    --shape 4096x8192x4096 --shape 16384x8192x4096 --out "$RES/hyb" > "$RES/hybrid7.log" 2>&1
  tail -12 "$RES/hybrid7.log"
  timeout 60 python3 bench/hybrid_vs_exhaustive.py "$EXH/exhaustive/summary.yaml" \
    "$RES/hyb/report/all_reduce-w2-bfloat16-hybrid/summary.yaml" --out "$RES/hyb" 2>&1 | tail -3
elif [ "$STAGE" = tables ]; then
  stamp "GPU tests of search and bench"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/test_search.py tests/test_bench.py 2>&1 \
    | tee "$RES/pytest_search.log" | tail -3
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  stamp "hybrid search: the suite, both collectives -> results/tables"
  search_suite 150 8
  stamp "M-range rows: M = 512..16384 for the suite's (N, K)"
  search_mrange 130 6
  keep_tables
  stamp "host cost of lookup_schedule per call (remembered answer vs a file check every call)"
  python3 - <<'PY' 2>&1 | tee "$RES/lookup_cost.txt"
import time, torch
import fo_kernels.table as t
def per_call(n=2000):
    t.lookup_schedule("all_reduce", 8192, 8192, 8192, dtype=torch.bfloat16, world_size=2, device="cuda:0")
    t0 = time.perf_counter()
    for _ in range(n):
        t.lookup_schedule("all_reduce", 8192, 8192, 8192, dtype=torch.bfloat16, world_size=2, device="cuda:0")
    return (time.perf_counter() - t0) / n * 1e3
print(f"lookup_schedule: {per_call():.4f} ms/call remembered")
t.TABLE_RECHECK_S = 0.0
print(f"lookup_schedule: {per_call():.4f} ms/call checking the files every call")
PY
  bench_twice 110 28
elif [ "$STAGE" = ce ]; then
  [ "${CE_TESTS:-1}" = 0 ] || stamp "GPU tests: copy engine in CUDA graphs, the NCCL ops (CE_TESTS=0 skips)"
  [ "${CE_TESTS:-1}" = 0 ] || timeout 150 python3 -m pytest -q -p no:cacheprovider -m "multigpu" \
    tests/test_gpu.py::test_copy_engine_in_a_cuda_graph tests/test_gpu.py::test_both_ops_over_nccl \
    tests/test_gpu.py::test_copy_engine_graphs_repeated_eager_calls 2>&1 \
    | tee "$RES/pytest_ce.log" | tail -4
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  stamp "hybrid search of the suite with copy-engine candidates, both collectives -> results/tables"
  search_suite 240 4
  keep_tables
  REPS=30 bench_twice 150 30
elif [ "$STAGE" = ce-mrange ]; then
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  stamp "M-range rows with copy-engine candidates: M = 512..16384 for the suite's (N, K)"
  search_mrange 400 8
  keep_tables
  stamp "bench again"
  bench_suite 120 bench 30
elif [ "$STAGE" = mrange-lite ]; then
  # The M-range rows within little device time: hopper.yaml with the copy-engine candidates cut to
  # 1, 2 and 4 equal chunks (the suite's searches never picked 3, 6 or the light-last weightings by
  # more than noise, runs 29-30), the model's best Triton schedule only, one collective per search
  # under a time budget (a search past it skips its remaining shapes; the ranges then stretch).
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  python3 - <<'PY' || exit 3
import yaml
space = yaml.safe_load(open("search_spaces/hopper.yaml"))
space["copy_engine_chunks"] = [1, 2, 4]
space.pop("copy_engine_weights", None)
yaml.safe_dump(space, open("/tmp/mrange_space.yaml", "w"), sort_keys=False)
PY
  for coll in all_reduce reduce_scatter; do
    stamp "M-range rows, $coll: M = 512..16384 for the suite's (N, K)"
    timeout 200 python3 cli.py search --mode hybrid --top-k 1 --trials 120 --calibration "$CAL" \
      --space /tmp/mrange_space.yaml --time-budget "${MRANGE_BUDGET_S:-140}" \
      --shape 1x4096x4096 --shape 1x8192x4096 --shape 1x8192x14336 --shape 1x8192x8192 --m-range 512:16384 \
      -c "$coll" --table-dir results/tables --storage "sqlite:///$RES/studies.db" \
      > "$RES/search_mrange_$coll.log" 2>&1
    grep -v "━" "$RES/search_mrange_$coll.log" | tail -12
  done
  keep_tables
elif [ "$STAGE" = mrange-s16 ]; then
  # The M-range rows searched again with the confirmation's 16 ms samples (run 63), a spot check at
  # untuned M before and after (20 rounds each, the bench's 16 ms samples).
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  spot() {
    timeout 150 python3 cli.py bench --shape 3072x8192x4096 --shape 6144x8192x14336 --shape 1024x8192x8192 \
      --shape 1024x4096x4096 -c all_reduce,reduce_scatter --reps 20 --out "$RES/$1" > "$RES/$1.log" 2>&1
    grep -v "━" "$RES/$1.log" | grep "│" | tail -16
  }
  stamp "spot check, the shipped tables"
  spot spot-before
  bash "$0" mrange-lite  # its tables and logs come back in results-mrange-lite.tgz
  stamp "spot check, the new M-range rows"
  spot spot-after
elif [ "$STAGE" = bench-twice ]; then
  export FO_TUNE_TABLE_DIR="$PWD/results/tables" REPS=30
  bench_twice 200 24
elif [ "$STAGE" = graphs ]; then
  stamp "copy engine eager, through its own graphs, and replayed from a caller's graph"
  timeout 180 python3 bench/ce_graph_probe.py --out "$RES/probe" > "$RES/probe.log" 2>&1
  tail -8 "$RES/probe.log"
  stamp "every GPU test (the engine's own graphs, a caller's graph, the review's fixes)"
  timeout 360 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" --durations=6 \
    tests/test_gpu.py tests/test_copy_engine.py 2>&1 | tee "$RES/pytest_gpu.log" | tail -14
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  REPS=30 bench_twice 150 12  # the committed tables
elif [ "$STAGE" = tiled ]; then
  stamp "copy engine: tiled mode vs cuBLAS chunks vs cuBLAS then NCCL"
  timeout "${PROBE_TIMEOUT_S:-300}" python3 bench/ce_tiled_probe.py --out "$RES/probe" ${PROBE_ARGS:-} \
    > "$RES/probe.log" 2>&1
  grep -v "^\[" "$RES/probe.log" | tail -14
  stamp "GPU tests of the tiled mode"
  timeout "${TESTS_TIMEOUT_S:-240}" python3 -m pytest -q -p no:cacheprovider -m multigpu --durations=4 \
    tests/test_gpu.py -k "${TESTS_K:-tiled or exchange or graph}" 2>&1 | tee "$RES/pytest_tiled.log" | tail -10
elif [ "$STAGE" = streams ]; then
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  stamp "copy engine: chunk GEMMs on one stream vs two, the table's weights and equal chunks"
  timeout "${PROBE_TIMEOUT_S:-300}" python3 bench/ce_streams_probe.py --out "$RES/probe" ${PROBE_ARGS:-} \
    > "$RES/probe.log" 2>&1
  grep -v "^\[" "$RES/probe.log" | tail -14
  stamp "GPU tests of the copy engine"
  timeout "${TESTS_TIMEOUT_S:-240}" python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" --durations=4 \
    ${TESTS_FILES:-tests/test_gpu.py} -k "${TESTS_K:-copy_engine_ops or graph}" 2>&1 \
    | tee "$RES/pytest_streams.log" | tail -10
elif [ "$STAGE" = power ]; then
  stamp "GEMM sustained vs duty-cycled vs beside copies: ms per GEMM, SM clock, power"
  timeout "${PROBE_TIMEOUT_S:-120}" python3 bench/power_probe.py --out "$RES/probe" ${PROBE_ARGS:-} \
    > "$RES/probe.log" 2>&1
  grep -v "^\[" "$RES/probe.log" | tail -16
elif [ "$STAGE" = diag ]; then
  stamp "the engine's own graphs: GPU test, then a search of two shapes with warnings shown"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m multigpu \
    tests/test_gpu.py::test_copy_engine_graphs_repeated_eager_calls 2>&1 | tail -4
  PYTHONWARNINGS=always timeout 150 python3 cli.py search --mode hybrid --top-k 3 --calibration "$CAL" \
    --shape 2048x4096x4096 --shape 4096x8192x4096 -c all_reduce,reduce_scatter --out "$RES/diag" \
    > "$RES/diag.log" 2>&1
  grep -n -i -B2 -A6 "capturing a call\|Traceback" "$RES/diag.log" | head -60; tail -5 "$RES/diag.log"
elif [ "$STAGE" = fallback ] || [ "$STAGE" = fallback-spot ]; then
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  if [ "$STAGE" = fallback ]; then
    stamp "GPU tests: the fallback's own graphs, the copy engine's graphs, both ops"
    timeout "${TESTS_TIMEOUT_S:-240}" python3 -m pytest -q -p no:cacheprovider -m multigpu --durations=4 \
      tests/test_gpu.py -k "${TESTS_K:-fallback or graph or both_ops}" 2>&1 | tee "$RES/pytest_fallback.log" | tail -8
    stamp "the fallback eager vs replayed from its own graphs vs cuBLAS then NCCL"
    timeout "${PROBE_TIMEOUT_S:-200}" python3 bench/fallback_graph_probe.py --out "$RES/probe" ${PROBE_ARGS:-} \
      > "$RES/probe.log" 2>&1
    sed -n '/^SUMMARY/,$p' "$RES/probe.log" | tail -14; grep -m3 -i "Traceback\|Error" "$RES/probe.log"
  fi
  stamp "bench at the tables' overlap: false shapes (20 rounds)"
  timeout "${BENCH_TIMEOUT_S:-200}" python3 cli.py bench --shape 512x4096x4096 --shape 1024x4096x4096 \
    --shape 512x8192x4096 --shape 512x8192x8192 --shape 512x8192x14336 -c all_reduce,reduce_scatter --reps 20 \
    --out "$RES/fallback-spot" > "$RES/fallback-spot.log" 2>&1
  grep -v "━" "$RES/fallback-spot.log" | grep "│" | tail -24
  if [ -n "${SUITE:-}" ]; then
    stamp "bench of the suite (30 rounds)"
    REPS=30 bench_suite 240 suite-bench 1
  fi
elif [ "$STAGE" = bench ]; then
  stamp "bench with the committed tables"
  bench_suite 150 bench 30
elif [ "$STAGE" = final ] || [ "$STAGE" = bench3 ] || [ "$STAGE" = tests ]; then
  export FO_TUNE_TABLE_DIR="$PWD/results/tables"
  if [ "$STAGE" = final ]; then
    stamp "host vs GPU time per call, profiled (bench/host_probe.py)"
    timeout 120 python3 bench/host_probe.py --out "$RES/host" --shape 2048x4096x4096 --calls 200 --profile \
      > "$RES/host.log" 2>&1
    grep -v "^\[" "$RES/host.log" | tail -3
  fi
  if [ "$STAGE" != tests ]; then
    for i in 1 2 3; do
      stamp "bench run $i (30 rounds)"
      REPS=30 bench_suite 240 "bench$i" 1
    done
  fi
  if [ "$STAGE" != bench3 ]; then
    stamp "GPU tests: the ops, the copy engine (chunks, tiled, exchange, graphs), the bench"
    timeout "${TESTS_TIMEOUT_S:-330}" python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
      --durations=5 ${TESTS_FILES:-tests/test_gpu.py tests/test_copy_engine.py tests/test_bench.py} -k "${TESTS_K:-not tiled_ops}" \
      2>&1 | tee "$RES/pytest_final.log" | tail -9
  fi
else
  echo "unknown stage $STAGE"; exit 2
fi
stamp done
