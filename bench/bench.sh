#!/usr/bin/env bash
# The benches the README cites: fo-tune bench of the suite and spot checks, with the tables the
# runtime finds.
#
#   bash bench/bench.sh OUT_DIR [STAGE...]
#   FO_WORLD_SIZE=8 bash bench/bench.sh OUT_DIR [STAGE...]     (a TP=8 machine; 4 for TP=4)
#
# FO_WORLD_SIZE (bench/env.sh, default 2) is the ranks of the suite stage, which needs that many
# GPUs (fewer: exit 2 before anything runs). Stages (by default suite and spot on two GPUs, w1 on
# one; suite alone at other world sizes):
#
#   suite  fo-tune bench of suites/h200_tp.yaml, AllReduce and ReduceScatter, 30 rounds, in three
#          processes (between processes the same tables read differently, docs/design.md#timing)
#          -> OUT_DIR/suite-1/ suite-2/ suite-3/ (results/bench/<device-key>/tp2-s16{,-rerun,-run3}/);
#          at other world sizes suites/tp48_profile.yaml, all three collectives
#          (results/bench/<device-key>/tp<W>-s16{,-rerun,-run3}/)
#   spot   the bench at M values between the M-range rows' tuned ones (suites/h200_mrange_spot.yaml)
#          and at the shapes whose rows say overlap: false (suites/h200_fallback_spot.yaml), 20
#          rounds each -> OUT_DIR/mrange-spot/ fallback-spot/ (results/bench/<device-key>/); the
#          TP=2 tables' spots: world size 2 only
#   w1     one GPU: fo-tune demo, then fo-tune bench --world-size 1 of the suite, all three
#          collectives, 30 rounds, in two processes (no table for world size 1: every call is a
#          table miss, the GEMM alone) -> OUT_DIR/demo.log, w1-1/ w1-2/
#          (results/bench/<device-key>/w1-s16/ and w1-s16-rerun/)
#
# Tables: FO_TUNE_TABLE_DIR when set (e.g. OUT_DIR/tables of bench/tune.sh), else results/tables/
# of this checkout, ahead of the user's own table folder (see `fo-tune table --help`).
# Each stage's log is OUT_DIR/<stage>.log.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
fo_help "$0" "${1-}"
out_dir="$(fo_out_dir "$1")"
shift
cd "$FO_REPO"
export FO_TUNE_TABLE_DIR="${FO_TUNE_TABLE_DIR:-$FO_REPO/results/tables}"
explicit_world="${FO_WORLD_SIZE-}"
fo_world_size
w="$FO_WORLD_SIZE"
if [ "$w" -eq 2 ]; then
  suite=suites/h200_tp.yaml
  collectives=all_reduce,reduce_scatter
else
  suite=suites/tp48_profile.yaml
  collectives=all_reduce,reduce_scatter,all_gather
fi

suite() {
  for i in 1 2 3; do
    echo "bench of $suite at world size $w, process $i"
    fo_tune bench --world-size "$w" --suite "$suite" -c "$collectives" --reps 30 --out "$out_dir/suite-$i"
  done
}

spot() {
  echo "M values between the tuned ones"
  fo_tune bench --suite suites/h200_mrange_spot.yaml -c all_reduce,reduce_scatter --reps 20 \
    --out "$out_dir/mrange-spot"
  echo "the shapes whose rows say overlap: false"
  fo_tune bench --suite suites/h200_fallback_spot.yaml -c all_reduce,reduce_scatter --reps 20 \
    --out "$out_dir/fallback-spot"
}

w1() {
  echo "fo-tune demo on one GPU"
  fo_tune demo 2>&1 | tee "$out_dir/demo.log"
  for i in 1 2; do
    echo "bench of the suite at world size 1, process $i"
    fo_tune bench --world-size 1 --suite suites/h200_tp.yaml -c all_reduce,reduce_scatter,all_gather \
      --reps 30 --out "$out_dir/w1-$i"
  done
}

stages=("$@")
if [ "${#stages[@]}" -eq 0 ]; then
  if [ "$(fo_gpu_count)" -ge "$w" ] && [ "$w" -eq 2 ]; then
    stages=(suite spot)
  elif [ "$(fo_gpu_count)" -ge "$w" ]; then
    stages=(suite)
  elif [ -z "$explicit_world" ]; then
    stages=(w1)
  else
    fo_need_gpus "$w" "FO_WORLD_SIZE=$w bash bench/bench.sh"
  fi
fi
for stage in "${stages[@]}"; do
  case "$stage" in
    suite) fo_need_gpus "$w" "stage suite" ;;
    spot)
      if [ "$w" -ne 2 ]; then
        echo "stage spot checks the TP=2 tables' M ranges: FO_WORLD_SIZE=2 only, not $w" >&2
        exit 2
      fi
      fo_need_gpus 2 "stage spot"
      ;;
    w1) fo_need_gpu "stage w1" ;;
    *)
      echo "unknown stage $stage: suite, spot or w1" >&2
      exit 2
      ;;
  esac
done
echo "tables: $FO_TUNE_TABLE_DIR first"
for stage in "${stages[@]}"; do
  echo "== $stage ($(date -u +%FT%TZ))"
  "$stage" 2>&1 | tee "$out_dir/$stage.log"
done
